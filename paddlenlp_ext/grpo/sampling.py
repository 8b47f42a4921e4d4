"""G seeded completions per prompt from the KV-cache generation (PaddleNLP's ``model.generate``).

The completions of prompt ``i`` at step ``s`` depend only on ``(seed, i, s)`` -- and, within the
group, on the generation index -- never on the rank or on the other prompts of the batch: each
prompt's group is one ``generate`` call of G identical rows (no padding) after
``paddle.seed(group_seed(seed, i, s))``, and the global random state is restored afterwards, so
the Trainer's own randomness is untouched.  Two data-parallel processes therefore sample exactly
what one process samples, and a resumed run samples what the uninterrupted run did.

A completion is cut after its first EOS (kept: the policy learns to stop) or at
``max_completion_length`` tokens.

``engine="engine"`` (``rollout_engine``, the default) samples faster: every group is decoded in one batch
with one prefill per prompt, finished rows leaving it, each group keeping its own RNG state and drawing
from its logits exactly what ``generate`` draws (:mod:`paddlenlp_ext.generation.rollouts`; bit-equal tokens
where the batched forward's logits are bit-equal to ``generate``'s).
"""

from __future__ import annotations

import hashlib
from typing import List, Sequence

import numpy as np
import paddle
from paddlenlp.generation import GenerationConfig

from ..generation import SampleGroup, sample_batch

__all__ = ["group_seed", "cut_completion", "sample_groups", "sample_step"]


def group_seed(seed: int, prompt_index: int, step: int) -> int:
    """A 31-bit seed for one prompt's group at one step (a hash: neighbouring inputs do not collide).

    >>> group_seed(42, 3, 7) == group_seed(42, 3, 7), group_seed(42, 3, 7) == group_seed(42, 7, 3)
    (True, False)
    """
    digest = hashlib.sha256(f"grpo:{int(seed)}:{int(prompt_index)}:{int(step)}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def cut_completion(tokens: Sequence[int], budget: int, eos_ids: Sequence[int]) -> List[int]:
    """Up to ``budget`` tokens, ending at (and including) the first EOS.

    >>> cut_completion([5, 2, 0, 0], 4, [2]), cut_completion([5, 6, 7], 2, [2])
    ([5, 2], [5, 6])
    """
    out: List[int] = []
    for t in list(tokens)[:budget]:
        out.append(int(t))
        if int(t) in eos_ids:
            break
    return out


def sample_groups(
    model,
    prompts: Sequence[Sequence[int]],
    prompt_indices: Sequence[int],
    *,
    group: int,
    step: int,
    seed: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_ids: Sequence[int],
    pad_id: int,
    engine: str = "generate",
) -> List[List[int]]:
    """``group`` completions of every prompt (prompt k's at ``k * group .. k * group + group - 1``);
    ``engine``: "generate" (one ``model.generate`` per prompt) or "engine" (one batch, same tokens)."""
    if engine == "engine":
        groups = [
            SampleGroup(list(ids), int(group), group_seed(seed, index, step), int(max_new_tokens))
            for ids, index in zip(prompts, prompt_indices)
        ]
        drawn = sample_batch(model, groups, eos_ids=eos_ids, pad_id=pad_id, temperature=temperature, top_p=top_p)
        return [row for rows in drawn for row in rows]
    if engine != "generate":
        raise ValueError(f"rollout_engine must be engine or generate; got {engine!r}")
    cfg = GenerationConfig(
        decode_strategy="sampling",
        max_new_tokens=int(max_new_tokens),
        max_length=0,
        top_k=0,
        top_p=float(top_p),
        temperature=float(temperature),
        repetition_penalty=1.0,
        eos_token_id=list(eos_ids) if len(eos_ids) > 1 else int(eos_ids[0]),
        pad_token_id=int(pad_id),
        use_cache=True,
    )
    was_training = model.training
    state = paddle.get_rng_state()
    out: List[List[int]] = []
    model.eval()
    try:
        with paddle.no_grad():
            for ids, index in zip(prompts, prompt_indices):
                paddle.seed(group_seed(seed, index, step))
                rows = paddle.to_tensor(np.tile(np.asarray(ids, dtype=np.int64)[None], [group, 1]))  # [G, P]
                pos = paddle.to_tensor(np.tile(np.arange(len(ids), dtype=np.int64)[None], [group, 1]))  # [G, P]
                mask = paddle.ones_like(rows)  # [G, P]
                gen, _ = model.generate(input_ids=rows, attention_mask=mask, position_ids=pos, generation_config=cfg)
                gen = gen.numpy()  # [G, <= max_new_tokens]; finished rows padded with pad_id
                out += [cut_completion(gen[g], max_new_tokens, eos_ids) for g in range(group)]
    finally:
        paddle.set_rng_state(state)
        if was_training:
            model.train()
    return out


def sample_step(
    model, prompts: Sequence[Sequence[int]], plan: Sequence[Sequence[int]], *, engine: str, **kw
) -> List[List[List[int]]]:
    """The first turns of every micro-batch of one optimizer step (``plan``: each micro-batch's prompt indices,
    ``prompts[i]``: prompt i's ids): ``out[k]`` = :func:`sample_groups` of micro-batch k.  The engine decodes
    the whole step as one batch (a group's tokens do not depend on its batch, so they are the same);
    ``generate`` samples micro-batch by micro-batch."""
    if engine != "engine":
        return [sample_groups(model, [prompts[i] for i in indices], indices, engine=engine, **kw) for indices in plan]
    flat = [i for indices in plan for i in indices]
    drawn = sample_groups(model, [prompts[i] for i in flat], flat, engine=engine, **kw)
    out, at, group = [], 0, int(kw["group"])
    for indices in plan:
        out.append(drawn[at : at + len(indices) * group])
        at += len(indices) * group
    return out
