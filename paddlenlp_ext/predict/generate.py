"""Batched generation with LEFT padding and the KV cache, and token streaming for one sequence.

PaddleNLP's ``model.generate`` appends one token per step to the right of every
row and reuses the cache (``use_cache``), so prompts of different lengths are
padded on the left.  What makes a padded row compute exactly what it computes
alone:

* ``attention_mask`` [B, L] (1 = real token) hides the padding from every query;
  ``generate`` extends it by one visible column per step;
* ``position_ids`` [B, L] = number of real tokens before each one, so real tokens
  sit at 0..n-1 as when the row is alone (PaddleNLP's Llama/Qwen2 default to
  ``arange(L)`` otherwise; rotary attention happens to be shift-invariant, learned
  or ALiBi positions are not); ``generate`` continues them with +1 per step;
* the padding token is the row's own first token (bos), never a foreign id: masked
  out, it changes nothing, and ``repetition_penalty`` -- which PaddleNLP applies to
  every id in the row, padding included -- sees the same set of ids as the row alone;
* each row's answer is cut to its own budget (``max_length - len(prompt)``) and at
  its first EOS, since the batch runs as long as its longest budget.

``tests/test_predict.py`` checks batched == one-by-one on the tiny Llama and Qwen2.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
import paddle
from paddlenlp.generation import BaseStreamer, GenerationConfig

from .options import PredictOptions
from .prompts import Prompt


def generation_config(o: PredictOptions, max_new_tokens: int, eos_ids: List[int], pad_id: int) -> GenerationConfig:
    """PaddleNLP's GenerationConfig for the options (greedy when ``o.greedy``)."""
    kw = dict(
        decode_strategy="greedy_search" if o.greedy else "sampling",
        max_new_tokens=int(max_new_tokens),
        # max_length 0: generate() would otherwise take a saved generation_config's max_length
        # as max_new_tokens whenever max_new_tokens equals its default (20)
        max_length=0,
        repetition_penalty=float(o.repetition_penalty),
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else list(eos_ids),
        pad_token_id=int(pad_id),
        use_cache=True,
    )
    if not o.greedy:
        kw.update(top_k=int(o.top_k), top_p=float(o.top_p), temperature=float(o.temperature))
    return GenerationConfig(**kw)


def left_padded(rows: Sequence[Sequence[int]]):
    """(input_ids, attention_mask, position_ids), numpy int64 [B, L] each, L the longest row; padding with the
    row's own first token under mask 0 (see the module doc).  One implementation, shared with GRPO's rollouts
    (``generation.rollouts.left_pad``).

    >>> ids, mask, pos = left_padded([[1, 5, 6], [1, 7]])
    >>> ids.tolist(), mask.tolist(), pos.tolist()
    ([[1, 5, 6], [1, 1, 7]], [[1, 1, 1], [0, 1, 1]], [[0, 1, 2], [0, 0, 1]])
    """
    from ..generation.rollouts import left_pad

    return left_pad(rows)


def cut_answer(tokens: Sequence[int], budget: int, eos_ids: Sequence[int]) -> List[int]:
    """The answer's tokens: at most ``budget``, up to (not including) the first EOS.

    >>> cut_answer([5, 6, 2, 0, 0], budget=4, eos_ids=[2])
    [5, 6]
    >>> cut_answer([5, 6, 7, 8], budget=3, eos_ids=[2])
    [5, 6, 7]
    """
    out = []
    for t in list(tokens)[:budget]:
        if t in eos_ids:
            break
        out.append(int(t))
    return out


def generate_batch(
    model,
    prompts: Sequence[Prompt],
    o: PredictOptions,
    eos_ids: List[int],
    pad_id: int,
    streamer: Optional[BaseStreamer] = None,
) -> List[List[int]]:
    """One generate() call for the prompts; each row's answer token ids (EOS and padding removed).

    ``streamer.put`` gets every row's next token [B, 1]: ``TokenPrinter`` shows one sequence, so it takes
    a single prompt; a streamer for batches (``serve.engine.BatchStreamer``) may end the call early by
    raising from ``put``, which propagates."""
    if isinstance(streamer, TokenPrinter) and len(prompts) != 1:
        raise ValueError("TokenPrinter prints one sequence: call generate_batch with a single prompt")
    ids, mask, pos = left_padded([p.ids for p in prompts])
    budget = max(p.max_new_tokens for p in prompts)
    cfg = generation_config(o, budget, eos_ids, pad_id)
    with paddle.no_grad():
        out, _ = model.generate(
            input_ids=paddle.to_tensor(ids),
            attention_mask=paddle.to_tensor(mask),
            position_ids=paddle.to_tensor(pos),
            generation_config=cfg,
            streamer=streamer,
        )
    gen = out.numpy()  # [B, T]: the generated tokens only (T <= budget), finished rows padded with pad_id
    return [cut_answer(gen[i], p.max_new_tokens, eos_ids) for i, p in enumerate(prompts)]


class TokenPrinter(BaseStreamer):
    """A ``generate(streamer=...)`` hook that writes one sequence's text as each token arrives.

    PaddleNLP calls ``put`` with every new token [1, 1] (never the prompt) and ``end`` once.  The
    text shown is always the decoding of all tokens so far; a tail that is an incomplete UTF-8
    byte sequence (byte-fallback tokens, shown as U+FFFD) waits for the next token."""

    def __init__(self, tokenizer, eos_ids: Sequence[int], write: Callable[[str], None]):
        self.tokenizer, self.eos_ids, self.write = tokenizer, set(eos_ids), write
        self.ids: List[int] = []
        self.shown = ""
        self.finished = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _show(self, text: str) -> None:
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.write(text[len(self.shown) :])
            self.shown = text

    def put(self, value) -> None:
        if self.finished:
            return  # after EOS the batch of one stops; nothing more to show
        token = int(np.asarray(value.numpy() if hasattr(value, "numpy") else value).reshape(-1)[0])
        if token in self.eos_ids:
            self.finished = True
            return
        self.ids.append(token)
        text = self._text()
        if not text.endswith("\ufffd"):
            self._show(text)

    def end(self) -> None:
        self._show(self._text())
        self.write("\n")
