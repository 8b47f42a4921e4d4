"""Prompt -> token ids in the format the model was trained with (no paddle).

Tokens come from ``data.tokenize.encode_turns``, the function training uses, so
the prompt of a fine-tuned model is what it saw before each answer:

* without a chat template: ``[bos] + system + src_1 + tgt_1 + eos + ... + src_n``;
* with a jinja chat template (``--chat_template FILE.jinja``, or the model directory's
  ``tokenizer_config.json`` / ``chat_template.jinja``): the messages (system first, when given)
  rendered by ``data.chat_template`` -- training's renderer, transformers' rules -- with the
  generation prompt, so the ids are ``apply_chat_template(..., add_generation_prompt=True)``'s;
* with PaddleNLP's ``chat_template.json``: its ``encode_chat_inputs`` rendering of the same
  turns, up to the last answer.

Truncation follows training where training has a rule and PaddleNLP's predictor
meaning of the flags where it does not:

* every ``src`` keeps its last ``src_length`` tokens (cut from the left: training's rule, docs/data.md);
* earlier rounds are kept newest first while the whole prompt stays within
  ``src_length`` tokens ("the longest input context", PaddleNLP's meaning);
  the last turn is always kept;
* the answer may take the rest of ``max_length`` (prompt + answer, PaddleNLP's
  meaning), so every prompt gets at least ``max_length - src_length`` new
  tokens unless the system prompt / template tokens alone eat into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..data.chat_template import render, special_tokens_of
from ..data.reader import Example
from ..data.tokenize import _encode, encode_turns
from .inputs import PredictInputError, PromptRecord

#: stands in for the answer to predict while the turns are encoded; its tokens are dropped.
#: A plain word, so no chat template transforms it and it cannot split a template's markup.
PLACEHOLDER_ANSWER = "answer"


@dataclass
class Prompt:
    ids: List[int]
    max_new_tokens: int
    dropped_rounds: int = 0  # earlier rounds left out to fit src_length
    truncated: bool = False  # some src was cut to src_length, or rounds were dropped


def fit_prompt(prefix: List[int], history, last_src: List[int], src_length: int):
    """(ids, dropped_rounds, truncated) by the rules of the module doc.

    ``history`` is ``[(src_ids, answer_ids_with_eos), ...]``.  With prefix [1], one earlier
    round and the last src [7], the whole is 1+2+2+1 = 6 tokens: it is dropped for src_length 4.

    >>> fit_prompt([1], [([5, 5], [6, 2])], [7], src_length=4)
    ([1, 7], 1, True)
    >>> fit_prompt([1], [([5, 5], [6, 2])], [7], src_length=6)
    ([1, 5, 5, 6, 2, 7], 0, False)
    """
    truncated = len(last_src) > src_length or any(len(s) > src_length for s, _ in history)
    last = list(last_src[len(last_src) - src_length :]) if len(last_src) > src_length else list(last_src)
    used = len(prefix) + len(last)
    kept = []
    for s, t in reversed(history):
        s = s[len(s) - src_length :] if len(s) > src_length else s  # from the left, as training cuts
        if used + len(s) + len(t) > src_length:
            break
        kept.append((s, t))
        used += len(s) + len(t)
    dropped = len(history) - len(kept)
    ids = list(prefix)
    for s, t in reversed(kept):
        ids += list(s) + list(t)
    return ids + last, dropped, truncated or dropped > 0


def template_messages(rec: PromptRecord, rounds: Optional[int] = None) -> List[Dict[str, str]]:
    """The messages a jinja template renders for ``rec``: the system message, the ``rounds`` most
    recent earlier rounds (all if None), the last question.

    >>> template_messages(PromptRecord(src=["a", "b"], history=["x"], system="s"), rounds=0)
    [{'role': 'system', 'content': 's'}, {'role': 'user', 'content': 'b'}]
    """
    earlier = list(zip(rec.src[:-1], rec.history))
    kept = earlier[len(earlier) - (len(earlier) if rounds is None else rounds) :]
    msgs = [{"role": "system", "content": rec.system}] if rec.system is not None else []
    for question, answer in kept:
        msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return msgs + [{"role": "user", "content": rec.src[-1]}]


def render_prompt(rec: PromptRecord, tokenizer, jinja: str, rounds: Optional[int] = None) -> List[int]:
    """The ids of ``rec`` rendered by the jinja template with the generation prompt, tokenized as
    transformers' ``apply_chat_template(tokenize=True)`` does (no special tokens added)."""
    text = render(jinja, template_messages(rec, rounds), None, True, special_tokens_of(tokenizer))
    return _encode(tokenizer, text)


def fit_rendered(rec: PromptRecord, tokenizer, jinja: str, src_length: int):
    """(ids, dropped_rounds, truncated) of a jinja-rendered prompt, by the rules of the module doc: each
    question keeps its last ``src_length`` tokens (cut from the left, as training), earlier rounds are kept newest first while the
    rendered prompt stays within ``src_length`` tokens, the last question always stays."""
    cut, truncated = [], False
    for question in rec.src:
        ids = _encode(tokenizer, question)
        if len(ids) > src_length:
            question, truncated = tokenizer.decode(ids[len(ids) - src_length :]), True
        cut.append(question)
    rec = PromptRecord(src=cut, history=list(rec.history), system=rec.system, origin=rec.origin)
    for rounds in range(len(rec.history), -1, -1):
        ids = render_prompt(rec, tokenizer, jinja, rounds)
        if len(ids) <= src_length:
            break
    dropped = len(rec.history) - rounds
    return ids, dropped, truncated or dropped > 0 or len(ids) > src_length


def full_prompt_ids(rec: PromptRecord, tokenizer, use_template: bool, jinja: Optional[str] = None) -> List[int]:
    """The whole prompt of ``rec``, nothing left out (the server's context-length message)."""
    if jinja:
        return render_prompt(rec, tokenizer, jinja)
    prefix, turns = encode_turns(_example(rec), tokenizer, use_template)
    return prefix + [t for s, a in turns[:-1] for t in s + a] + turns[-1][0]


def _example(rec: PromptRecord) -> Example:
    return Example(
        src=list(rec.src), tgt=list(rec.history) + [PLACEHOLDER_ANSWER], system=rec.system, origin=rec.origin
    )


def build_prompt(
    rec: PromptRecord, tokenizer, src_length: int, max_length: int, use_template: bool, jinja: Optional[str] = None
) -> Prompt:
    """The prompt ids of ``rec`` and how many tokens the answer may take (``max_length - len(ids)``).

    ``jinja``: the chat template's source (``session.prompt_template``); it renders the prompt, system
    message included.  Without it, ``use_template`` selects PaddleNLP's ``encode_chat_inputs``."""
    try:
        if jinja:
            ids, dropped, truncated = fit_rendered(rec, tokenizer, jinja, src_length)
        else:
            prefix, turns = encode_turns(_example(rec), tokenizer, use_template)
            ids, dropped, truncated = fit_prompt(prefix, turns[:-1], turns[-1][0], src_length)
    except Exception as e:
        # Not swallowed: a tokenizer or chat-template failure on this prompt is reported with its
        # file:line (exit 2), the original error chained as __cause__.
        raise PredictInputError(f"{rec.origin}: could not build the prompt: {type(e).__name__}: {e}") from e
    if len(ids) >= max_length:
        raise PredictInputError(
            f"{rec.origin}: the prompt is {len(ids)} tokens after truncation (system prompt / chat template "
            f"included), which leaves no room to answer within --max_length {max_length}; raise --max_length"
        )
    return Prompt(ids=ids, max_new_tokens=max_length - len(ids), dropped_rounds=dropped, truncated=truncated)
