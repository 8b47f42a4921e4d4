"""Conversations and text documents -> token ids + labels (pure functions over a tokenizer; never the model).

With a jinja template (:mod:`.chat_template`) the whole conversation is rendered once and tokenized
once (``tokenizer(text, add_special_tokens=False)``, as ``apply_chat_template(tokenize=True)``), so the
ids are the template's.  Which tokens carry loss is found by rendering prefixes and diffing:

* an assistant message's span starts where ``render(messages[:i], add_generation_prompt=True)`` ends
  (after its header) and ends where ``render(messages[:i+1])`` ends, minus trailing whitespace: its
  content (reasoning and tool calls as the template writes them) and its end-of-turn token;
* a character span becomes a token span by tokenizing the prefix text and taking its common prefix
  with the full ids (a token that straddles the start is supervised);
* default: every assistant message is supervised; ``loss_weight`` 0 turns one off, 1 turns a user or
  system message on; ``train_on_prompt`` supervises everything but tool results, which are never
  supervised.

Worked example (template ``{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}``
with generation prompt ``<assistant>``): ``[user "hi", assistant "yo"]`` renders ``<user>hi</s><assistant>yo</s>``;
the supervised text is ``yo</s>``.

Without a jinja template a conversation of plain user/assistant turns becomes PaddleNLP's
``Example(src, tgt, system)`` and is rendered as before (byte-identical to the src/tgt form).

Text documents (``autoregressive: true``): ``[bos] + ids + [eos]``, every token a label, cut into
chunks of ``max_length + 1`` tokens that overlap by one (each token is predicted exactly once) --
a long document becomes several rows, never dropped.
"""

from typing import Dict, List, Optional, Tuple

from .chat_template import TemplateRenderError, render
from .formats.convo import Conversation, TextDoc
from .reader import Example
from .tokenize import IGNORE_INDEX, _encode
from .truncation import fit_segments


def _common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def char_spans(
    conv: Conversation, source: str, special: Dict, train_on_prompt: bool
) -> Tuple[str, List[Tuple[int, int, bool]]]:
    """(rendered text, [(start, end, supervised)]) -- the character spans of the messages whose loss
    differs from the background (background: supervised iff ``train_on_prompt``)."""
    msgs = [m.as_template_dict() for m in conv.messages]
    full = render(source, msgs, conv.tools, False, special)
    spans = []
    for i, m in enumerate(conv.messages):
        if m.role == "assistant":
            want = m.loss is not False
        elif m.role == "tool":
            want = False
        else:
            want = bool(m.loss) or (train_on_prompt and m.loss is not False)
        if want == train_on_prompt and m.role != "assistant":
            continue
        head = render(source, msgs[:i], conv.tools, m.role == "assistant", special) if i else ""
        upto = render(source, msgs[: i + 1], conv.tools, False, special)
        if not (full.startswith(head) and full.startswith(upto)):
            raise TemplateRenderError(
                f"the chat template renders message {i + 1} differently when later messages follow (e.g. it drops "
                "earlier reasoning), so its tokens cannot be located; split the conversation into one example per "
                "assistant turn"
            )
        start, end = (len(head), len(upto.rstrip())) if m.role == "assistant" else (len(head), len(upto))
        spans.append((start, max(end, start), want))
    return full, spans


def conversation_tokens(
    conv: Conversation, tokenizer, source: str, special: Dict, train_on_prompt: bool
) -> Tuple[List[int], List[bool]]:
    """(token ids of the rendered conversation, supervised flag per token)."""
    full, spans = char_spans(conv, source, special, train_on_prompt)
    return _tokens_and_mask(tokenizer, full, spans, train_on_prompt)


def _tokens_and_mask(tokenizer, full: str, spans, train_on_prompt: bool) -> Tuple[List[int], List[bool]]:
    ids = _encode(tokenizer, full)
    mask = [train_on_prompt] * len(ids)
    for start, end, want in spans:
        a = _common_prefix(_encode(tokenizer, full[:start]), ids) if start else 0
        upto = _encode(tokenizer, full[:end])
        b = _common_prefix(upto, ids)
        b = b if b == len(upto) else min(b + 1, len(ids))  # a token straddling the end belongs to the span
        for k in range(a, b):
            mask[k] = want
    return ids, mask


def _token_at(tokenizer, full: str, pos: int, ids: List[int]) -> int:
    """Index of the first token of ``ids`` (the tokens of ``full``) that starts at or after character ``pos``."""
    return _common_prefix(_encode(tokenizer, full[:pos]), ids) if pos else 0


def user_bounds(
    conv: Conversation, n: int, tokenizer, source: str, special: Dict, full: str, ids: List[int], limit: int
) -> List[int]:
    """Token index where each user turn among ``conv.messages[:n]`` starts in ``ids`` (the tokens of the
    rendering ``full``), increasing and at most ``limit``; ``[0]`` when none can be placed (a template that
    renders a cut conversation differently merges those rounds)."""
    msgs = [m.as_template_dict() for m in conv.messages]
    bounds: List[int] = []
    for i, m in enumerate(conv.messages[:n]):
        if m.role != "user":
            continue
        try:
            text = render(source, msgs[:i], conv.tools, False, special) if i else ""
        except TemplateRenderError:
            continue
        if full.startswith(text):
            k = _token_at(tokenizer, full, len(text), ids)
            if (not bounds or k > bounds[-1]) and k <= limit:
                bounds.append(k)
    return bounds or [0]


def answer_segments(
    conv: Conversation, answer, tokenizer, source: str, special: Dict
) -> Tuple[List[int], List[List[int]], List[int], List[int]]:
    """``(prefix, history rounds, last, answer)`` token segments of ``conv`` + the ``answer`` message rendered
    by the jinja ``source`` (tokenized once, as :func:`conversation_tokens`): ``prefix`` up to the first user
    turn (system, tools), one history round per earlier user turn (with the assistant and tool turns after
    it), ``last`` the final round up to the answer's header, ``answer`` its content and end-of-turn token --
    the segments :func:`~.truncation.fit_segments` cuts.  Their concatenation is a prefix of the ids of
    the whole rendering (what follows the answer's end-of-turn token, e.g. a newline, is left out)."""
    full_conv = Conversation(list(conv.messages) + [answer], tools=conv.tools, origin=conv.origin)
    full, spans = char_spans(full_conv, source, special, False)
    start, end, _ = spans[-1]  # the last assistant message: the answer
    ids = _encode(tokenizer, full)
    a = _token_at(tokenizer, full, start, ids)
    upto = _encode(tokenizer, full[:end])
    b = _common_prefix(upto, ids)
    b = b if b == len(upto) else min(b + 1, len(ids))
    bounds = user_bounds(conv, len(conv.messages), tokenizer, source, special, full, ids, a)
    rounds = [ids[x:y] for x, y in zip(bounds, bounds[1:])]
    return ids[: bounds[0]], rounds, ids[bounds[-1] : a], ids[a:b]


def fit_conversation(
    conv: Conversation, tokenizer, source: str, special: Dict, train_on_prompt: bool, max_length: int, src_length: int
) -> Tuple[Optional[Dict], bool, int]:
    """A rendered conversation -> ``(feature or None, truncated, dropped_rounds)`` by the one truncation policy
    (:mod:`.truncation`, fine-tuning's form): a conversation of at most ``max_length`` tokens is whole; a longer
    one loses its oldest rounds (user turn + the answers after it) while it does not fit, the last prompt
    (system / tools + the last round up to the last answer) is cut from the left to ``src_length`` tokens,
    then the last answer loses its tail.  None: no learned token is left (the example is dropped, and counted)."""
    full, spans = char_spans(conv, source, special, train_on_prompt)
    ids, mask = _tokens_and_mask(tokenizer, full, spans, train_on_prompt)
    if len(ids) <= max_length:
        return shift_and_fit(ids, mask, max_length, conv.origin)[0], False, 0
    last = max(i for i, m in enumerate(conv.messages) if m.role == "assistant")
    msgs = [m.as_template_dict() for m in conv.messages]
    head = render(source, msgs[:last], conv.tools, True, special)
    if not full.startswith(head):  # the template renders the cut conversation differently: keep a window
        try:
            return shift_and_fit(ids, mask, max_length, conv.origin)[0], True, 0
        except ValueError:
            return None, True, 0
    a = _token_at(tokenizer, full, len(head), ids)
    pos = list(range(len(ids)))
    bounds = user_bounds(conv, last, tokenizer, source, special, full, ids, a)
    rounds = [pos[x:y] for x, y in zip(bounds, bounds[1:])]
    prompt, (answer,), info = fit_segments(
        pos[: bounds[0]],
        rounds,
        pos[bounds[-1] : a],
        [pos[a:]],
        max_length,
        min(src_length, max_length - 1),
        bound_history=False,
    )
    keep = prompt + answer
    w_ids, w_mask = [ids[k] for k in keep], [mask[k] for k in keep]
    labels = [t if m else IGNORE_INDEX for t, m in zip(w_ids[1:], w_mask[1:])]
    if all(x == IGNORE_INDEX for x in labels):
        return None, True, info["dropped_rounds"]
    return {"input_ids": w_ids[:-1], "labels": labels}, True, info["dropped_rounds"]


def shift_and_fit(ids: List[int], mask: List[bool], max_length: int, origin: str) -> Tuple[Dict, bool]:
    """Tokens + flags -> ``{"input_ids", "labels"}`` shifted, cut to ``max_length`` tokens.

    A longer conversation keeps its start; if no supervised token would remain there (a long tool list
    or prompt), it keeps its end instead (the last answer).  Either way it is counted as truncated.

    >>> shift_and_fit([1, 5, 6, 2], [False, False, True, True], 8, "f:1")
    ({'input_ids': [1, 5, 6], 'labels': [-100, 6, 2]}, False)
    >>> shift_and_fit([1, 5, 5, 5, 6, 2], [False, False, False, False, True, True], 3, "f:1")
    ({'input_ids': [5, 6], 'labels': [6, 2]}, True)
    """
    truncated = len(ids) > max_length
    for window in (slice(0, max_length), slice(max(len(ids) - max_length, 0), len(ids))):
        w_ids, w_mask = ids[window], mask[window]
        labels = [t if m else IGNORE_INDEX for t, m in zip(w_ids[1:], w_mask[1:])]
        if any(x != IGNORE_INDEX for x in labels):
            return {"input_ids": w_ids[:-1], "labels": labels}, truncated
    raise ValueError(
        f"{origin}: no supervised token"
        + (
            f" within max_length={max_length}; raise max_length"
            if truncated
            else " (every assistant turn has loss_weight 0)"
        )
    )


def to_example(conv: Conversation) -> Example:
    """A plain conversation -> PaddleNLP's src/tgt ``Example`` (for tokenizers without a jinja template).

    ``[system "s", user "a", assistant "b"]`` -> ``Example(src=["a"], tgt=["b"], system="s")``.  Tool
    calls, tool results, reasoning or loss_weight need a jinja template: ValueError saying so."""
    msgs = conv.messages
    system = msgs[0].content if msgs and msgs[0].role == "system" else None
    rest = msgs[1:] if system is not None else msgs
    need = None
    if conv.tools or any(m.tool_calls or m.role == "tool" for m in rest):
        need = "tool calls"
    elif any(m.reasoning is not None for m in rest):
        need = "reasoning_content"
    elif any(m.loss is not None for m in rest):
        need = "loss_weight"
    elif [m.role for m in rest] != ["user", "assistant"] * (len(rest) // 2) or len(rest) % 2:
        need = "this order of roles"
    if need:
        raise ValueError(
            f"{conv.origin}: {need} can only be rendered with a jinja chat template, and the tokenizer "
            "has none: add chat_template to its tokenizer_config.json or set chat_template to a jinja file"
        )
    return Example(
        src=[m.content for m in rest[0::2]], tgt=[m.content for m in rest[1::2]], system=system, origin=conv.origin
    )


def text_features(doc: TextDoc, tokenizer, max_length: int) -> List[Dict]:
    """A document -> rows of at most ``max_length`` inputs, every token a label.

    bos=1, eos=2, text -> [5, 6, 7, 8], max_length 3: tokens ``[1, 5, 6, 7, 8, 2]`` give
    ``[{"input_ids": [1, 5, 6], "labels": [5, 6, 7]}, {"input_ids": [7, 8], "labels": [8, 2]}]``.
    """
    ids = _encode(tokenizer, doc.text)
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    ids = ids + [tokenizer.eos_token_id]
    out = []
    for start in range(0, len(ids) - 1, max_length):
        chunk = ids[start : start + max_length + 1]
        out.append({"input_ids": chunk[:-1], "labels": chunk[1:]})
    return out


class Renderer:
    """Tokenizes any item the readers produce: ``Example`` (PaddleNLP's path, unchanged), ``Conversation``
    (jinja template, or an ``Example`` without one) and ``TextDoc`` (autoregressive).  ``__call__`` returns
    ``(features, truncated, dropped_rounds)`` with ``features`` a list (a long text document gives several)."""

    def __init__(
        self,
        tokenizer,
        src_length: int,
        max_length: int,
        use_paddle_template: bool,
        templates: Optional[Dict[bool, Optional[str]]] = None,
        special: Optional[Dict] = None,
        train_on_prompt: bool = False,
        autoregressive: bool = False,
    ):
        self.tokenizer, self.src_length, self.max_length = tokenizer, src_length, max_length
        self.use_paddle_template = use_paddle_template
        self.templates = templates or {}  # {has_tools: jinja source or None}
        self.special = special or {}
        self.train_on_prompt, self.autoregressive = train_on_prompt, autoregressive

    @property
    def jinja(self) -> bool:
        return bool(self.templates.get(False) or self.templates.get(True))

    def __call__(self, item) -> Tuple[List[Dict], bool, int]:
        from .tokenize import tokenize_example

        if isinstance(item, TextDoc):
            if not self.autoregressive:
                raise ValueError(f"{item.origin}: a raw text record; set autoregressive: true to train on text")
            feats = text_features(item, self.tokenizer, self.max_length)
            return feats, len(feats) > 1, 0
        if self.autoregressive:
            raise ValueError(
                f"{item.origin}: autoregressive: true trains on raw text, but this record is a "
                'conversation; give text records ({"text": ...} or a .txt file) or set it false'
            )
        if isinstance(item, Conversation):
            source = self.templates.get(bool(item.tools)) or self.templates.get(False)
            if source:
                feat, truncated, dropped = fit_conversation(
                    item, self.tokenizer, source, self.special, self.train_on_prompt, self.max_length, self.src_length
                )
                return ([feat] if feat is not None else []), truncated, dropped
            item = to_example(item)
        feat, truncated, dropped = tokenize_example(
            item, self.tokenizer, self.src_length, self.max_length, self.use_paddle_template
        )
        if self.train_on_prompt:
            feat = {"input_ids": feat["input_ids"], "labels": feat["input_ids"][1:] + [feat["labels"][-1]]}
        return [feat], truncated, dropped
