"""One answer's text as its tokens arrive: what may be sent now, and where a stop sequence ends it (pure).

The text of a row is always the decoding of ALL its tokens so far (as the predictor's
``TokenPrinter`` does), so a word split over tokens comes out whole.  What is held back:

* a tail that is an incomplete UTF-8 sequence (byte-fallback tokens decode to U+FFFD until
  the last byte arrives);
* a tail that could be the start of a stop sequence (``stop=["###"]`` and the text ends in
  ``"#"``): sent once the next tokens show it is not one;
* everything from a stop sequence on: the answer ends there and the stop text is not part of it
  (OpenAI's behaviour).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


def first_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    """Index where the earliest stop sequence starts, or None.

    >>> first_stop("a.b##c", ["##", "."]), first_stop("abc", ["x"])
    (1, None)
    """
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop sequence.

    >>> partial_stop("hello #", ["###"]), partial_stop("hello", ["###"])
    (1, 0)
    """
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextAssembler:
    """Turns successive full decodings of one row into deltas to send.

    >>> a = TextAssembler(["##"])
    >>> a.update("Hi #"), a.update("Hi #!"), a.update("Hi #! ##x")
    (('Hi ', False), ('#!', False), (' ', True))
    >>> a.text
    'Hi #! '
    """

    def __init__(self, stops: Sequence[str]):
        self.stops: List[str] = list(stops)
        self.text = ""  # sent so far
        self.stopped = False

    def update(self, decoded: str, final: bool = False) -> Tuple[str, bool]:
        """(delta to send, whether a stop sequence ended the answer).  ``final``: no more tokens come."""
        if self.stopped:
            return "", True
        cut = first_stop(decoded, self.stops)
        if cut is not None:
            decoded, self.stopped = decoded[:cut], True
        elif not final:
            decoded = decoded.rstrip("\ufffd")  # an incomplete UTF-8 tail: wait for its last byte
            decoded = decoded[: len(decoded) - partial_stop(decoded, self.stops)]
        if not decoded.startswith(self.text) or len(decoded) <= len(self.text):
            # nothing new, or the decoding of a longer sequence changed earlier text (rare: a tokenizer's
            # clean-up of spaces); wait until it extends what was sent
            return "", self.stopped
        delta, self.text = decoded[len(self.text) :], decoded
        return delta, self.stopped


class IncrementalDecoder:
    """Text of a growing token list, decoding only its last few tokens per step (a full decode of every
    row at every step would cost O(length) each time; the tokenizer's decode is pure Python).

    The new text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``: the window starts a few tokens
    back, so a word-initial space or a multi-token character decodes as it does in the whole sequence.
    A window ending in U+FFFD (an incomplete UTF-8 sequence) waits for more tokens.

    >>> d = IncrementalDecoder(lambda ids: "".join(chr(96 + i) for i in ids))
    >>> d.add(1), d.add(2), d.text
    ('a', 'b', 'ab')
    """

    def __init__(self, decode):
        self.decode, self.ids, self.text = decode, [], ""
        self.prefix = self.read = 0

    def add(self, token: int) -> str:
        """Append a token; the text it completes (maybe empty)."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        delta = now[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta
