"""Logprobs in OpenAI's two shapes, from ``serve.decode.token_info`` records (pure; no paddle).

A record is ``{"logprob": float, "top": [(token_id, logprob), ...]}`` (most likely first), or None
for the first prompt token (nothing predicts it).  ``text(id)`` is a token's text.

* completions (the legacy shape lm-eval reads): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, ``top_logprobs`` a ``{text: logprob}`` per token;
* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence


def top_dict(top: Sequence[tuple], text: Callable[[int], str]) -> Dict[str, float]:
    """{text: logprob}, most likely first; of two tokens with the same text the more likely one is kept.

    >>> top_dict([(5, -0.1), (6, -2.0), (7, -3.0)], {5: "a", 6: "b", 7: "a"}.get)
    {'a': -0.1, 'b': -2.0}
    """
    out: Dict[str, float] = {}
    for t, lp in top:
        out.setdefault(text(t), lp)
    return out


def completion_logprobs(
    tokens: Sequence[int], infos: Sequence[Optional[dict]], text: Callable[[int], str], offset: int = 0
) -> Dict[str, list]:
    """The legacy ``logprobs`` object of ``tokens`` (prompt tokens first when echoed).

    >>> completion_logprobs([1, 2], [None, {"logprob": -0.5, "top": [(3, -0.2)]}], {1: "A", 2: "b", 3: "c"}.get)
    {'tokens': ['A', 'b'], 'token_logprobs': [None, -0.5], 'top_logprobs': [None, {'c': -0.2}], 'text_offset': [0, 1]}
    """
    out: Dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, info in zip(tokens, infos):
        s = text(t)
        out["tokens"].append(s)
        out["token_logprobs"].append(None if info is None else info["logprob"])
        out["top_logprobs"].append(None if info is None else top_dict(info["top"], text))
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def merge_completion(a: Optional[dict], b: dict) -> dict:
    """Two legacy logprobs objects one after the other (echoed prompt + answer).

    >>> merge_completion({"tokens": ["a"], "text_offset": [0]}, {"tokens": ["b"], "text_offset": [0]})
    {'tokens': ['a', 'b'], 'text_offset': [0, 1]}
    """
    if a is None:
        return b
    shift = (a["text_offset"][-1] + len(a["tokens"][-1])) if a["tokens"] else 0
    out = {k: list(a[k]) + list(b[k]) for k in a if k != "text_offset"}
    out["text_offset"] = list(a["text_offset"]) + [o + shift for o in b["text_offset"]]
    return out


def _entry(s: str, lp: float) -> dict:
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tokens: Sequence[int], infos: Sequence[Optional[dict]], text: Callable[[int], str]) -> dict:
    """The chat ``logprobs`` object.

    >>> chat_logprobs([2], [{"logprob": -0.5, "top": [(2, -0.5)]}], {2: "b"}.get)["content"][0]["top_logprobs"]
    [{'token': 'b', 'logprob': -0.5, 'bytes': [98]}]
    """
    content: List[dict] = []
    for t, info in zip(tokens, infos):
        if info is None:
            continue
        e = _entry(text(t), info["logprob"])
        e["top_logprobs"] = [_entry(text(u), lp) for u, lp in info["top"]]
        content.append(e)
    return {"content": content, "refusal": None}
