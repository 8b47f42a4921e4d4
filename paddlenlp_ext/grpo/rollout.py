"""One rollout: the completions, rewards, advantages and fixed log-probs of every micro-batch of a step.

TRL generates the whole global batch of an optimizer step before its first micro-batch trains
("generation batch"), so the normalisers that span the global batch (the completion tokens for dapo and
cispo, the completions for grpo, dr_grpo and rloo, the batch std for ``scale_rewards: batch``) are known,
and keeps it for ``num_iterations`` optimizer steps.  Here :class:`RolloutSampler` tells every micro-batch
the plan of its step (this rank's prompt indices of all accumulation micro-batches, and which micro-batch
it is) and yields each global batch ``num_iterations`` times; the trainer builds a :class:`Rollout` at the
first micro-batch of the first iteration and reuses it until the next.

Worked example of the sampler's tags (per_device 1, accumulation 2, one rank, num_iterations 2): global
batch [7, 3] yields [7] tagged (0, 7, 3), [3] tagged (1, 7, 3), then the same two again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from ..data.global_batches import GlobalBatchSampler, TaggedIndex, global_batches, rank_micro_batches

__all__ = [
    "RolloutSampler",
    "MicroRollout",
    "Rollout",
    "split_plan",
    "truncation_mask",
    "save_rollout",
    "load_rollout",
    "rollout_file",
]

#: tensors of a MicroRollout kept in a checkpoint (paddle [T] or numpy), besides its lists
_TENSORS = ("mask", "old_logps", "ref_logps", "old_values", "token_advantages", "returns")


class RolloutSampler(GlobalBatchSampler):
    """GlobalBatchSampler's order, each global batch ``iterations`` times; every index is tagged with
    ``(micro-batch, *this rank's prompts of the whole step)`` instead of a token count.

    >>> s = RolloutSampler(list(range(2)), per_device=1, accumulation=2, ranks=1, rank=0, seed=0,
    ...                    drop_last=False, iterations=2)
    >>> [[(int(i), i.global_label_tokens) for i in b] for b in s], len(s)
    ([[(1, (0, 1, 0))], [(0, (1, 1, 0))], [(1, (0, 1, 0))], [(0, (1, 1, 0))]], 4)
    """

    def __init__(self, *args, iterations: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.iterations = int(iterations)

    def __len__(self) -> int:
        return super().__len__() * self.iterations

    def __iter__(self):
        for batch in global_batches(self.n, self.global_batch, self.seed, self.epoch, self.drop_last):
            micros = rank_micro_batches(batch, self.per_device, self.accumulation, self.ranks, self.rank)
            plan = tuple(int(i) for m in micros for i in m)
            for _ in range(self.iterations):
                for a, micro in enumerate(micros):
                    yield [TaggedIndex(i, (a,) + plan) for i in micro]


def split_plan(tag, per_device: int):
    """The tag array -> (this micro-batch's number, [prompt indices of each micro-batch of the step]).

    >>> split_plan(np.array([1, 7, 3, 5, 2]), 2)
    (1, [[7, 3], [5, 2]])
    """
    flat = [int(x) for x in np.asarray(tag).reshape([-1])]
    plan = flat[1:]
    return flat[0], [plan[k : k + per_device] for k in range(0, len(plan), per_device)]


def truncation_mask(completions, eos_ids, trained=None) -> np.ndarray:
    """[T] float32 over the completions' scored tokens in order (``trained``: the multi-turn masks, only
    generated tokens are scored): 0 for every token of a completion that does not end with an EOS (cut at
    max_completion_length), else 1 (``mask_truncated_completions``).

    >>> truncation_mask([[5, 2], [6, 7]], [2]).tolist()
    [1.0, 1.0, 0.0, 0.0]
    >>> truncation_mask([[5, 9, 2], [6, 7]], [2], trained=[[1, 0, 1], [1, 1]]).tolist()
    [1.0, 1.0, 0.0, 0.0]
    """
    sizes = [len(c) if trained is None else int(sum(m)) for c, m in zip(completions, trained or completions)]
    parts = [np.full(n, float(bool(c) and int(c[-1]) in eos_ids), dtype=np.float32) for c, n in zip(completions, sizes)]
    return np.concatenate(parts) if parts else np.zeros([0], dtype=np.float32)


@dataclass
class MicroRollout:
    indices: List[int]  # prompt indices
    completions: List[List[int]]  # n * G token lists
    rewards: np.ndarray  # [n * G] total reward (RLOO: before its KL penalty)
    per_func: Dict[str, np.ndarray]
    advantages: np.ndarray  # [n * G]
    batch: Dict[str, Any]  # rows.sequence_rows as tensors
    mask: Any = None  # [T] paddle float32 (mask_truncated_completions) or None
    old_logps: Any = None  # [T] paddle (num_iterations > 1, RLOO's KL) or None: the policy's own, detached
    ref_logps: Any = None  # [T] paddle (beta > 0) or None
    # PPO (ppo.trainer): the rollout's values, GAE's whitened advantages and returns, the k1 KL per token
    old_values: Any = None  # [T] paddle
    token_advantages: Any = None  # [T] paddle
    returns: Any = None  # [T] paddle
    kl_tokens: Optional[np.ndarray] = None  # [T]
    # multi-turn (tools): 1 for the tokens the policy generated, 0 for tool results and the template between turns
    trained: Optional[List[List[int]]] = None
    tool_calls: Optional[np.ndarray] = None  # [n * G] calls made by each completion
    tool_failures: Optional[np.ndarray] = None  # [n * G] of them answered with an error (or a timeout)
    turns: Optional[np.ndarray] = None  # [n * G] assistant turns


@dataclass
class Rollout:
    step: int  # the optimizer step that generated it (its sampling seed)
    micro: List[MicroRollout] = field(default_factory=list)
    global_tokens: int = 0  # completion tokens of the global batch (every rank, every micro-batch)
    global_sequences: int = 0  # completions of the global batch
    seconds: float = 0.0  # wall time of generation, rewards, advantages and the fixed log-probs
    logged: bool = False  # its rollout_time is in the log (once, at the step that generated it)


def rollout_file(directory: str, rank: int) -> str:
    """Where a checkpoint keeps rank ``rank``'s rollout (one rank's prompts: each rank writes its own)."""
    import os

    return os.path.join(directory, f"rollout-rank{int(rank)}.npz")


def save_rollout(rollout: Rollout, path: str) -> None:
    """The rollout without its row batches (rebuilt from prompts and completions on load), as one npz."""
    arrays: Dict[str, np.ndarray] = {
        "step": np.asarray(rollout.step),
        "micro": np.asarray(len(rollout.micro)),
        "global": np.asarray([rollout.global_tokens, rollout.global_sequences]),
    }
    for k, m in enumerate(rollout.micro):
        arrays[f"{k}/indices"] = np.asarray(m.indices, dtype=np.int64)
        arrays[f"{k}/lengths"] = np.asarray([len(c) for c in m.completions], dtype=np.int64)
        arrays[f"{k}/tokens"] = np.asarray([t for c in m.completions for t in c], dtype=np.int64)
        if m.trained is not None:
            arrays[f"{k}/trained"] = np.asarray([t for c in m.trained for t in c], dtype=np.int8)
            for name in ("tool_calls", "tool_failures", "turns"):
                arrays[f"{k}/{name}"] = np.asarray(getattr(m, name), dtype=np.float64)
        arrays[f"{k}/rewards"] = np.asarray(m.rewards, dtype=np.float64)
        arrays[f"{k}/advantages"] = np.asarray(m.advantages, dtype=np.float32)
        for name, values in m.per_func.items():
            arrays[f"{k}/func/{name}"] = np.asarray(values, dtype=np.float64)
        for name in _TENSORS:
            value = getattr(m, name)
            if value is not None:
                arrays[f"{k}/{name}"] = value if isinstance(value, np.ndarray) else value.numpy()
        if m.kl_tokens is not None:
            arrays[f"{k}/kl_tokens"] = np.asarray(m.kl_tokens)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load_rollout(path: str, rebuild) -> Rollout:
    """:func:`save_rollout`'s file -> a Rollout; ``rebuild(indices, completions)`` makes each micro-batch's rows
    (``rebuild(indices, completions, trained)`` for a multi-turn rollout: ``trained`` its masks)."""
    import paddle

    data = np.load(path)
    rollout = Rollout(
        step=int(data["step"]), global_tokens=int(data["global"][0]), global_sequences=int(data["global"][1])
    )
    for k in range(int(data["micro"])):
        ends = np.cumsum(data[f"{k}/lengths"])
        completions = [c.tolist() for c in np.split(data[f"{k}/tokens"], ends[:-1])]
        indices = data[f"{k}/indices"].tolist()
        trained = (
            [c.tolist() for c in np.split(data[f"{k}/trained"], ends[:-1])] if f"{k}/trained" in data.files else None
        )
        per_func = {key.split("/", 2)[2]: data[key] for key in data.files if key.startswith(f"{k}/func/")}
        m = MicroRollout(
            indices=indices,
            completions=completions,
            rewards=data[f"{k}/rewards"],
            per_func=per_func,
            advantages=data[f"{k}/advantages"],
            trained=trained,
            batch=rebuild(indices, completions) if trained is None else rebuild(indices, completions, trained),
        )
        if trained is not None:
            for name in ("tool_calls", "tool_failures", "turns"):
                setattr(m, name, data[f"{k}/{name}"])
        for name in _TENSORS:
            if f"{k}/{name}" in data.files:
                setattr(m, name, paddle.to_tensor(data[f"{k}/{name}"]))
        if f"{k}/kl_tokens" in data.files:
            m.kl_tokens = data[f"{k}/kl_tokens"]
        rollout.micro.append(m)
    return rollout
