"""Constrained decoding through llguidance: the token mask of a JSON schema (or a tool-call grammar) per step.

``response_format`` ``json_object`` / ``json_schema`` and ``tool_choice`` ``required`` / named become an
llguidance grammar (``LLMatcher.grammar_from_json_schema``, or Lark with ``%json`` for a tool call in
the template's own format); no grammar is written by hand here.  Each generating row owns a
:class:`Constraint`: ``mask(V)`` is the set of tokens that keep the output inside the grammar (only
EOS once it is complete), ``consume(token)`` advances it.  JSON is compiled without free whitespace,
so a row cannot spend its budget on blanks.

The tokenizer is given to llguidance as the bytes of every token id (:func:`token_bytes`: sentencepiece
``▁`` pieces and ``<0xHH>`` byte pieces, GPT-2 byte-level pieces, added/special tokens), built once per
served tokenizer.
"""

from __future__ import annotations

import json
import re
import threading
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from .protocol import ApiError

BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
JSON_OPTIONS = {"whitespace_flexible": False}
_lock = threading.Lock()
_tokenizers: Dict[int, Any] = {}


@lru_cache(maxsize=1)
def _byte_decoder() -> Dict[str, int]:
    """GPT-2's byte <-> printable-unicode table, inverted (byte-level BPE pieces back to bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def piece_bytes(piece: Optional[str], byte_level: bool) -> bytes:
    """One vocabulary piece as the bytes it stands for.

    >>> piece_bytes("▁the", False), piece_bytes("<0x0A>", False), piece_bytes("Ġthe", True)
    (b' the', b'\\n', b' the')
    """
    if not piece:
        return b""
    m = BYTE_PIECE.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    if byte_level:
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
    return piece.replace("▁", " ").encode("utf-8")


def token_bytes(tokenizer) -> List[bytes]:
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    byte_level = sum("Ġ" in (p or "") for p in pieces) > sum("▁" in (p or "") for p in pieces)
    return [piece_bytes(p, byte_level) for p in pieces]


def longest_match(data: bytes, by_bytes: Dict[bytes, int], longest: int) -> List[int]:
    """Token ids that spell ``data`` exactly, longest token first at each position.

    >>> longest_match(b"abc", {b"a": 1, b"ab": 2, b"c": 3, b"b": 4}, 2)
    [2, 3]
    """
    out, i = [], 0
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            t = by_bytes.get(data[i : i + n])
            if t is not None:
                out.append(t)
                i += n
                break
        else:
            raise ValueError(f"no token spells byte {data[i]:#04x}")
    return out


class _Wrapped:
    """What llguidance.TokenizerWrapper reads: tokens as bytes, eos/bos/special ids, and an encoder of text."""

    def __init__(self, tokenizer, eos_id: int):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = token_bytes(tokenizer)
        self.special_token_ids = [int(t) for t in getattr(tokenizer, "all_special_ids", []) or []]
        special = set(self.special_token_ids)
        self.by_bytes = {}
        for i, b in enumerate(self.tokens):
            if b and i not in special:
                self.by_bytes.setdefault(b, i)
        self.longest = max(len(b) for b in self.by_bytes)

    def _encode(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"])

    def __call__(self, text):
        if isinstance(text, bytes):
            raise TypeError("text only")  # TokenizerWrapper then passes str
        # sentencepiece adds a "dummy prefix" space to every text, so "{" would come back as " {": encode
        # after a NUL byte and drop its tokens (kept only when the rest decodes to the text itself)
        head = self._encode("\x00")
        ids = self._encode("\x00" + text)
        if ids[: len(head)] == head and b"".join(self.tokens[t] for t in ids[len(head) :]) == text.encode("utf-8"):
            return ids[len(head) :]
        # the tokenizer normalizes the text (e.g. drops newlines): the longest tokens that spell its bytes exactly
        return longest_match(text.encode("utf-8"), self.by_bytes, self.longest)


def ll_tokenizer(tokenizer, eos_id: int):
    """The llguidance tokenizer of a served tokenizer (built once: it reads the whole vocabulary)."""
    import llguidance

    with _lock:
        key = id(tokenizer)
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(tokenizer, eos_id)))
        return _tokenizers[key]


def json_grammar(schema: Dict[str, Any]) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def response_format_schema(fmt: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON schema of a ``response_format``.

    >>> response_format_schema({"type": "json_object"})
    {'type': 'object'}
    """
    if fmt["type"] == "json_object":
        return {"type": "object"}
    return fmt["json_schema"].get("schema", {})


def tool_call_schema(tools: List[Dict[str, Any]], style: str) -> Dict[str, Any]:
    """The JSON schema of one call to any of ``tools`` in the template's style (hermes: ``arguments``,
    llama3: ``parameters``)."""
    key = "parameters" if style == "llama3" else "arguments"
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                key: t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_call_grammar(tools: List[Dict[str, Any]], style: str) -> str:
    """A Lark grammar (llguidance's) for exactly one tool call as the template writes it."""
    import llguidance

    schema = json.dumps(dict(tool_call_schema(tools, style), **{"x-guidance": JSON_OPTIONS}))
    if style == "hermes":
        lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {schema}\n'
    else:
        lark = f"start: call\ncall: %json {schema}\n"
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Constraint:
    """One row's llguidance matcher: ``mask(V)`` -> bool [V] of allowed tokens, ``consume(token)``."""

    def __init__(self, tokenizer, eos_id: int, grammar: str):
        import llguidance

        self.eos_id = eos_id
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, eos_id), grammar, log_level=0)
        if self.matcher.is_error():
            raise ApiError(
                400,
                f"cannot compile this schema for constrained decoding: {self.matcher.get_error()}",
                "response_format",
                "invalid_schema",
            )

    def mask(self, vocab: int) -> np.ndarray:
        allowed = np.zeros(vocab, dtype=bool)
        if self.matcher.is_error() or self.matcher.is_stopped():
            allowed[self.eos_id] = True
            return allowed
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        n = min(vocab, bits.shape[0])
        allowed[:n] = bits[:n].astype(bool)
        if not allowed.any():
            allowed[self.eos_id] = True
        return allowed

    def consume(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(int(token))


def check_grammar(tokenizer, eos_id: int, grammar: str, param: str) -> None:
    """400 naming ``param`` when llguidance cannot compile the grammar (bad schema), before the request queues."""
    import llguidance

    err = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer, eos_id))
    if err and not err.startswith("WARNING"):
        raise ApiError(400, f"{param}: cannot use this schema for constrained decoding: {err}", param, "invalid_schema")


def request_constraint(req, session) -> Optional[Callable[[], Constraint]]:
    """A factory of per-row constraints for a request (tool_choice required / named, or a JSON
    response_format), or None; 400 before the request queues when the schema cannot be compiled."""
    from .tools import tool_style

    tools = req.tools if req.kind == "chat" else None
    if tools and req.tool_choice not in ("none", "auto"):
        if isinstance(req.tool_choice, dict):
            tools = [t for t in tools if t["function"]["name"] == req.tool_choice["function"]["name"]]
        grammar, param = tool_call_grammar(tools, tool_style(session.jinja)), "tools"
    elif req.response_format is not None:
        grammar, param = json_grammar(response_format_schema(req.response_format)), "response_format"
    else:
        return None
    eos = session.eos_ids[0]
    check_grammar(session.tokenizer, eos, grammar, param)
    return lambda: Constraint(session.tokenizer, eos, grammar)
