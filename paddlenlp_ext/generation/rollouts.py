"""The rollout engine: many seeded sampling groups decoded as ONE batch with a KV cache; rows leave as they end.

PaddleNLP's ``model.generate`` decodes one batch until its last row ends, so a trainer that wants each
group's tokens to depend on its own seed only (GRPO: prompt i's G completions) calls it once per group.
:func:`sample_batch` decodes every group of a rollout together instead:

* **one prefill per prompt**: a group's ``size`` rows share their prompt, so it is run once and its KV cache
  copied to the rows (``generate`` prefills every row);
* **one forward per step for every row left**: prompts of different lengths are left-padded under
  attention mask 0 with positions from 0 at each row's first real token; a row that ended (its EOS, its
  budget) is gathered out of the batch and its cache columns that are padding in every row are cut;
* **the sampling of ``generate``, per group**: each group keeps its own Paddle RNG state (``paddle.seed(seed)``
  when it starts, as the caller of ``generate`` seeds it) and draws exactly what ``generate``'s sampling
  draws: temperature, softmax, PaddleNLP's ``TopKProcess`` / ``TopPProcess``, ``paddle.multinomial`` over
  the group's ``size`` rows -- a row that already ended still takes part in the draw (as in ``generate``,
  which samples every row until the batch ends), so it consumes the same random numbers.  A group's
  tokens therefore depend on its prompt, seed and settings only, never on the other groups of the
  batch, and from the same logits they are the tokens ``generate`` samples for that group alone under
  the same seed (tests/test_grpo_engine.py).  The logits themselves are bit-equal only where the
  matrix kernels agree: MKL picks them by shape, so a prompt prefilled once here and as ``size``
  identical rows in ``generate`` can differ in the last bits, and a draw falling that close to the
  boundary between two tokens flips (docs/benchmarks.md, "GRPO rollouts": 1 row in 32 on a 0.26B model).

The global Paddle RNG state is restored afterwards: the caller's randomness is untouched.

Shape of the result (token ids for illustration): ``sample_batch(model, [SampleGroup([1, 5, 6], size=2,
seed=7, max_new_tokens=3)], eos_ids=[2], pad_id=0)`` -> ``[[[9, 4, 2], [8, 8, 3]]]``: one list per group,
one per row; the first row ended with its EOS 2 (kept), the second at its budget of 3 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

__all__ = ["SampleGroup", "sample_batch", "left_pad"]


@dataclass
class SampleGroup:
    """``size`` completions of one prompt drawn together from one seed (GRPO: a prompt's G completions;
    a multi-turn tool rollout's next turn: one completion with its own seed)."""

    prompt: List[int]
    size: int
    seed: int
    max_new_tokens: int


def left_pad(rows: Sequence[Sequence[int]]):
    """(input_ids, attention_mask, position_ids), numpy int64 [B, L] each: left padding under mask 0,
    positions counted from each row's first real token (as ``generate`` numbers an unpadded row).

    >>> ids, mask, pos = left_pad([[1, 5, 6], [1, 7]])
    >>> ids.tolist(), mask.tolist(), pos.tolist()
    ([[1, 5, 6], [1, 1, 7]], [[1, 1, 1], [0, 1, 1]], [[0, 1, 2], [0, 0, 1]])
    """
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype="int64")  # [B, L]
    mask = np.zeros((len(rows), width), dtype="int64")  # [B, L]
    for i, r in enumerate(rows):
        pad = width - len(r)
        ids[i, :pad] = r[0]  # a real token id under mask 0: never attended to
        ids[i, pad:] = r
        mask[i, pad:] = 1
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)  # [B, L]
    return ids, mask, pos


def _forward(model, ids, mask, pos, cache):
    import paddle

    out = model(
        input_ids=paddle.to_tensor(ids),
        attention_mask=paddle.to_tensor(mask),
        position_ids=paddle.to_tensor(pos),
        past_key_values=cache,
        use_cache=True,
        return_dict=True,
    )
    return out.logits[:, -1, :], list(out.past_key_values)  # [B, V], [(k, v)] per layer, [B, T, H, D]


class _Sampler:
    """PaddleNLP ``generate``'s sampling step (``GenerationMixin.sample``) on a group's logits [size, V]."""

    def __init__(self, temperature: float, top_p: float, top_k: int, greedy: bool):
        self.temperature, self.top_p, self.top_k, self.greedy = float(temperature), float(top_p), int(top_k), greedy

    def probs(self, logits):
        """[N, V] float32 logits -> the probabilities ``generate`` draws from (row-wise ops only)."""
        import paddle.nn.functional as F
        from paddlenlp.generation import TopKProcess, TopPProcess

        if self.temperature != 1.0:
            logits = logits / self.temperature
        probs = F.softmax(logits)
        if self.top_k:
            probs = TopKProcess(probs, self.top_k, 1)
        if self.top_p < 1.0:
            probs = TopPProcess(probs, self.top_p, 1)
        return probs


def sample_batch(
    model,
    groups: Sequence[SampleGroup],
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
) -> List[List[List[int]]]:
    """Every group's ``size`` completions (module doc): ``out[g][m]`` = row m of group g, cut after its
    first EOS (kept) or at the group's ``max_new_tokens``.  ``greedy``: argmax instead of sampling."""
    import paddle

    if not groups:
        return []
    eos, sampler = {int(e) for e in eos_ids}, _Sampler(temperature, top_p, top_k, greedy)
    out: List[List[List[int]]] = [[[] for _ in range(g.size)] for g in groups]
    saved = paddle.get_rng_state()
    states: Dict[int, list] = {}
    for gi, g in enumerate(groups):
        paddle.seed(int(g.seed))
        states[gi] = paddle.get_rng_state()
    was_training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            ids, mask, pos = left_pad([g.prompt for g in groups])  # [n, L] each: one prefill row per group
            last, cache = _forward(model, ids, mask, pos, None)  # [n, V]
            # the rows: (group, member); each group's prefill is copied to its members
            rows = [(gi, m) for gi, g in enumerate(groups) for m in range(g.size)]
            owner = [gi for gi, _ in rows]
            last = paddle.gather(last, paddle.to_tensor(np.asarray(owner, "int64")), axis=0)  # [B, V]
            cache = _take(cache, owner)
            mask, pos = mask[owner], pos[owner, -1] + 1  # [B, T], [B]
            while True:
                nxt = _choose(last, rows, groups, states, sampler)  # [B]
                ended = []
                for b, (gi, m) in enumerate(rows):
                    t = int(nxt[b])
                    out[gi][m].append(t)
                    if t in eos or len(out[gi][m]) >= groups[gi].max_new_tokens:
                        ended.append(b)
                gone = set(ended)
                keep = [b for b in range(len(rows)) if b not in gone]
                if not keep:
                    break
                if ended:  # the rows that ended leave the batch; all-padding cache columns are cut
                    rows, nxt, mask, pos = [rows[b] for b in keep], nxt[keep], mask[keep], pos[keep]
                    cut = int(np.argmax(mask.any(axis=0)))
                    mask = mask[:, cut:]
                    cache = _take(cache, keep, cut)
                mask = np.concatenate([mask, np.ones((len(rows), 1), "int64")], axis=1)  # [B, T+1]
                last, cache = _forward(model, nxt.reshape(-1, 1), mask, pos.reshape(-1, 1), cache)  # [B, V]
                pos = pos + 1
    finally:
        paddle.set_rng_state(saved)
        if was_training:
            model.train()
    return out


def _take(cache, index: Sequence[int], cut: int = 0):
    """The cache of the rows ``index`` (batch axis 0), without its first ``cut`` columns (time axis 1)."""
    import paddle

    idx = paddle.to_tensor(np.asarray(index, "int64"))
    return [tuple(paddle.gather(x, idx, axis=0)[:, cut:] for x in kv) for kv in cache]


def _choose(last, rows, groups, states: Dict[int, list], sampler: _Sampler) -> np.ndarray:
    """The next token of every row [B] from the last logits [B, V]: argmax, or each group's draw (module doc)."""
    import paddle

    if sampler.greedy:
        return paddle.argmax(last, axis=-1).numpy().astype("int64").reshape(-1)
    # each live group's rows in member order; a member that ended draws from a live member's row
    where: Dict[int, Dict[int, int]] = {}
    for b, (gi, m) in enumerate(rows):
        where.setdefault(gi, {})[m] = b
    order: List[int] = []
    spans: List[tuple] = []
    for gi, members in where.items():
        any_b = next(iter(members.values()))
        spans.append((gi, len(order), groups[gi].size))
        order += [members.get(m, any_b) for m in range(groups[gi].size)]
    probs = sampler.probs(paddle.gather(last, paddle.to_tensor(np.asarray(order, "int64")), axis=0))  # [sum G, V]
    nxt = np.zeros(len(rows), "int64")
    for gi, start, size in spans:
        paddle.set_rng_state(states[gi])
        drawn = paddle.multinomial(probs[start : start + size]).numpy().reshape(-1)  # [size]
        states[gi] = paddle.get_rng_state()
        for m, b in where[gi].items():
            nxt[b] = drawn[m]
    return nxt
