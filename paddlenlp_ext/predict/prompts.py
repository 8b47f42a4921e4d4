"""Prompt -> token ids in the format the model was trained with (no paddle).

Tokens come from ``data.tokenize.encode_turns``, the function training uses, so
the prompt of a fine-tuned model is what it saw before each answer:

* without a chat template: ``[bos] + system + src_1 + tgt_1 + eos + ... + src_n``;
* with one (the tokenizer's, or ``--chat_template``): PaddleNLP's
  ``encode_chat_inputs`` rendering of the same turns, up to the last answer.

Truncation follows training where training has a rule and PaddleNLP's predictor
meaning of the flags where it does not:

* every ``src`` keeps its first ``src_length`` tokens (training's rule);
* earlier rounds are kept newest first while the whole prompt stays within
  ``src_length`` tokens ("the longest input context", PaddleNLP's meaning);
  the last turn is always kept;
* the answer may take the rest of ``max_length`` (prompt + answer, PaddleNLP's
  meaning), so every prompt gets at least ``max_length - src_length`` new
  tokens unless the system prompt / template tokens alone eat into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ..data.reader import Example
from ..data.tokenize import encode_turns
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
    last = list(last_src[:src_length])
    used = len(prefix) + len(last)
    kept = []
    for s, t in reversed(history):
        s = s[:src_length]
        if used + len(s) + len(t) > src_length:
            break
        kept.append((s, t))
        used += len(s) + len(t)
    dropped = len(history) - len(kept)
    ids = list(prefix)
    for s, t in reversed(kept):
        ids += list(s) + list(t)
    return ids + last, dropped, truncated or dropped > 0


def build_prompt(rec: PromptRecord, tokenizer, src_length: int, max_length: int, use_template: bool) -> Prompt:
    """The prompt ids of ``rec`` and how many tokens the answer may take (``max_length - len(ids)``)."""
    example = Example(src=list(rec.src), tgt=list(rec.history) + [PLACEHOLDER_ANSWER], system=rec.system,
                      origin=rec.origin)
    try:
        prefix, turns = encode_turns(example, tokenizer, use_template)
    except Exception as e:
        # Not swallowed: a tokenizer or chat-template failure on this prompt is reported with its
        # file:line (exit 2), the original error chained as __cause__.
        raise PredictInputError(f"{rec.origin}: could not build the prompt: {type(e).__name__}: {e}") from e
    ids, dropped, truncated = fit_prompt(prefix, turns[:-1], turns[-1][0], src_length)
    if len(ids) >= max_length:
        raise PredictInputError(
            f"{rec.origin}: the prompt is {len(ids)} tokens after truncation (system prompt / chat template "
            f"included), which leaves no room to answer within --max_length {max_length}; raise --max_length")
    return Prompt(ids=ids, max_new_tokens=max_length - len(ids), dropped_rounds=dropped, truncated=truncated)
