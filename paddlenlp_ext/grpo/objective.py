"""GRPO's math under TRL's names: advantages, the per-token policy losses of every ``loss_type``, their
normalisation, the k3 KL estimate.  Judged against TRL's own code in tests/test_grpo_trl.py.

Advantages of the completions ``o_1..o_G`` of one prompt with rewards ``r_i`` (TRL's GRPOTrainer)::

    A_i = r_i - mean(r of the group)     divided by std(group) + 1e-4 (scale_rewards "group"),
                                         by std(whole global batch) + 1e-4 ("batch"), or not at all ("none")

std with ddof=1 (torch's default).  RLOO (``loss_type: rloo``, TRL's RLOOTrainer): the reward first loses
``beta * sum_t (old_t - ref_t)`` (the sequence's k1 KL), then ``A_i = r_i - mean(r_j, j != i)``, optionally
normalised over the global batch (``normalize_advantages``).

Per completion token t, with ``w`` the importance weight: ``exp(logp_t - old_t)`` (importance_sampling_level
"token") or ``exp(mean over the completion's tokens of (logp - old))`` ("sequence", GSPO)::

    grpo/bnpo/dr_grpo/dapo:  loss_t = -min(w * A, clip(w, 1 - epsilon, 1 + epsilon_high) * A) + beta * kl_t
    cispo:                   loss_t = -stopgrad(min(w, epsilon_high)) * A * logp_t + beta * kl_t
    kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1            (k3, unbiased and >= 0)

and per completion for rloo: ``-min(w * A, clip(w) * A)`` with ``w = exp(sum_t logp_t - sum_t old_t)``.
Aggregation over the GLOBAL batch (every micro-batch of every rank of one optimizer step; ``m_t`` is 0 for
the tokens of a truncated completion under ``mask_truncated_completions``, else 1)::

    grpo:        mean over completions of (sum_t m_t loss_t / sum_t m_t)
    bnpo:        sum m_t loss_t / sum m_t over the MICRO-batch, averaged over micro-batches (TRL's local mean)
    dr_grpo:     sum m_t loss_t / (completions x max_completion_length)
    dapo, cispo: sum m_t loss_t / completion tokens (truncated ones counted, as TRL counts them)
    rloo:        mean over completions of their loss

Worked example: rewards [1, 0] (G=2) give A = [0.707, -0.707] (0.5 / (std 0.7071 + 1e-4)); at w = 1 and
beta 0 each token of o_1 has loss -0.707.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import paddle

ADVANTAGE_EPS = 1e-4  # TRL's
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "rloo")
SCALE_REWARDS = ("group", "batch", "none")


def scale_mode(scale) -> str:
    """TRL's spelling of ``scale_rewards``: true -> "group", false -> "none" (older configs), else as given.

    >>> scale_mode(True), scale_mode(False), scale_mode("batch")
    ('group', 'none', 'batch')
    """
    return {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else str(scale)


def group_advantages(
    rewards: np.ndarray,
    group: int,
    scale="group",
    eps: float = ADVANTAGE_EPS,
    batch_rewards: Optional[np.ndarray] = None,
) -> np.ndarray:
    """``rewards`` [n * group] (each prompt's group consecutive) -> advantages [n * group] float32.

    ``batch_rewards``: every reward of the global batch (all ranks, all micro-batches) for "batch"
    scaling; default ``rewards`` itself.

    >>> [round(float(a), 4) for a in group_advantages(np.array([1.0, 0.0, 2.0, 2.0]), group=2)]
    [0.707, -0.707, 0.0, 0.0]
    >>> group_advantages(np.array([1.0, 0.0]), group=2, scale="none").tolist()
    [0.5, -0.5]
    >>> [round(float(a), 4) for a in group_advantages(np.array([1.0, 0.0, 2.0, 2.0]), group=2, scale="batch")]
    [0.5222, -0.5222, 0.0, 0.0]
    """
    mode = scale_mode(scale)
    if mode not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}; got {scale!r}")
    r = np.asarray(rewards, dtype=np.float64).reshape([-1, group])  # [n, G]
    centred = r - r.mean(axis=1, keepdims=True)  # [n, G]
    if mode == "group":
        centred = centred / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    elif mode == "batch":
        every = np.asarray(rewards if batch_rewards is None else batch_rewards, dtype=np.float64).reshape([-1])
        centred = centred / (every.std(ddof=1) + eps)
    return centred.reshape([-1]).astype(np.float32)  # [n * G]


def rloo_advantages(
    rewards: np.ndarray,
    group: int,
    normalize: bool = False,
    eps: float = ADVANTAGE_EPS,
    batch_advantages: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Leave-one-out: ``A_i = r_i - (sum_j r_j - r_i) / (G - 1)`` per group; ``normalize``: then
    ``(A - mean) / (std + eps)`` over the global batch (``batch_advantages``: its un-normalised
    advantages, default these).  ``rewards`` already carry RLOO's KL penalty.

    >>> rloo_advantages(np.array([1.0, 0.0, 0.0, 3.0, 3.0, 3.0]), group=3).tolist()
    [1.0, -0.5, -0.5, 0.0, 0.0, 0.0]
    """
    r = np.asarray(rewards, dtype=np.float64).reshape([-1, group])  # [n, G]
    baseline = (r.sum(axis=1, keepdims=True) - r) / (group - 1)  # [n, G]
    adv = (r - baseline).reshape([-1])  # [n * G]
    if normalize:
        every = adv if batch_advantages is None else np.asarray(batch_advantages, dtype=np.float64).reshape([-1])
        adv = (adv - every.mean()) / (every.std(ddof=1) + eps)
    return adv.astype(np.float32)


def segment_sum(values, segment, n: int):
    """[T] values summed per segment -> [n] (differentiable).

    >>> segment_sum(paddle.to_tensor([1.0, 2.0, 3.0]), paddle.to_tensor([0, 1, 1]), 2).tolist()
    [1.0, 5.0]
    """
    return paddle.index_add(paddle.zeros([n], dtype=values.dtype), segment, 0, values)


def token_losses(
    logps,
    old_logps,
    advantages,
    ref_logps: Optional[paddle.Tensor],
    *,
    epsilon: float,
    beta: float,
    epsilon_high: Optional[float] = None,
    loss_type: str = "dapo",
    level: str = "token",
    segment=None,
    mask=None,
    sequences: Optional[int] = None,
):
    """Per-token loss, KL and clipped flag of every completion token.

    ``logps``, ``old_logps``: [T] log-probs of the completion tokens (policy; the policy that generated
    them); ``advantages``: [T] the advantage of each token's completion; ``ref_logps``: [T] or None;
    ``segment`` [T] int64 the completion of each token (needed for level "sequence"); ``mask`` [T] 0/1
    (default all 1).  Returns ``(loss [T], kl [T] or None, clipped [T] bool)``; ``clipped`` as TRL counts
    it (the clipped term is the active one: w < 1 - eps with A < 0, w > 1 + eps_high with A > 0; cispo:
    w > epsilon_high with A > 0).  Not for ``rloo`` (:func:`sequence_losses`).
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logps - old_logps  # [T]
    if level == "sequence":
        m = paddle.ones_like(logps) if mask is None else mask.astype(logps.dtype)  # [T]
        n = int(sequences) if sequences is not None else int(segment.max()) + 1
        per_seq = segment_sum(log_ratio * m, segment, n) / segment_sum(m, segment, n).clip(min=1.0)  # [S]
        log_w = per_seq[segment]  # [T]: every token carries its completion's weight
    elif level == "token":
        log_w = log_ratio
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence'; got {level!r}")
    w = paddle.exp(log_w)  # [T]
    if loss_type == "cispo":
        loss = -paddle.clip(w, max=eps_high).detach() * advantages * logps  # [T]
        clipped = paddle.logical_and(w > eps_high, advantages > 0)
    elif loss_type in LOSS_TYPES:
        clipped_w = paddle.clip(w, 1.0 - epsilon, 1.0 + eps_high)  # [T]
        loss = -paddle.minimum(w * advantages, clipped_w * advantages)  # [T]
        low = paddle.logical_and(w < 1.0 - epsilon, advantages < 0)  # [T]
        high = paddle.logical_and(w > 1.0 + eps_high, advantages > 0)  # [T]
        clipped = paddle.logical_or(low, high)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; one of {LOSS_TYPES}")
    kl = None
    if ref_logps is not None and beta > 0:
        delta = ref_logps - logps  # [T]
        kl = paddle.exp(delta) - delta - 1.0  # [T]
        loss = loss + beta * kl
    return loss, kl, clipped.detach()


def sequence_losses(
    logps,
    old_logps,
    advantages,
    segment,
    sequences: int,
    *,
    epsilon: float,
    epsilon_high: Optional[float] = None,
    mask=None,
):
    """RLOO's loss per completion: ``-min(w A, clip(w, 1 - eps, 1 + eps_high) A)`` with ``w`` the ratio of
    the completion's summed log-probs.  ``advantages`` [S]; returns ``(loss [S], clipped [S] bool)``."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    m = paddle.ones_like(logps) if mask is None else mask.astype(logps.dtype)  # [T]
    log_w = segment_sum((logps - old_logps) * m, segment, sequences)  # [S]
    w = paddle.exp(log_w)
    loss = -paddle.minimum(w * advantages, paddle.clip(w, 1.0 - epsilon, 1.0 + eps_high) * advantages)  # [S]
    clipped = paddle.logical_or(
        paddle.logical_and(w < 1.0 - epsilon, advantages < 0), paddle.logical_and(w > 1.0 + eps_high, advantages > 0)
    )
    return loss, clipped.detach()


def aggregate(
    loss,
    loss_type: str,
    *,
    segment=None,
    mask=None,
    sequences: int = 0,
    global_tokens: int = 1,
    global_sequences: int = 1,
    max_completion_length: int = 1,
    scale: float = 1.0,
):
    """[] this micro-batch's share of the global batch's loss (the normalisations of the module docstring).

    ``loss``: [T] per-token (``rloo``: [S] per completion); ``sequences``: completions of this micro-batch;
    ``global_tokens`` / ``global_sequences``: completion tokens / completions of the global batch;
    ``scale`` = data-parallel ranks x accumulation steps: PaddleNLP divides each micro-batch's loss by the
    accumulation steps and data parallel averages the ranks' gradients, so ``sum * scale / N`` adds up to
    the single-process ``sum / N``.  ``bnpo`` keeps TRL's micro-batch mean (no ``scale``).

    >>> float(aggregate(paddle.to_tensor([1.0, 2.0, 3.0]), "grpo", segment=paddle.to_tensor([0, 1, 1]),
    ...                 sequences=2, global_sequences=2))
    1.75
    """
    if loss_type == "rloo":
        return loss.sum() * (scale / max(int(global_sequences), 1))
    m = paddle.ones_like(loss) if mask is None else mask.astype(loss.dtype)
    masked = loss * m  # [T]
    if loss_type in ("dapo", "cispo"):
        return masked.sum() * (scale / max(int(global_tokens), 1))
    if loss_type == "grpo":
        per_seq = segment_sum(masked, segment, sequences) / segment_sum(m, segment, sequences).clip(min=1.0)  # [S]
        return per_seq.sum() * (scale / max(int(global_sequences), 1))
    if loss_type == "dr_grpo":
        return masked.sum() * (scale / (max(int(global_sequences), 1) * int(max_completion_length)))
    if loss_type == "bnpo":
        return masked.sum() / m.sum().clip(min=1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}; one of {LOSS_TYPES}")


def global_token_loss(loss_tokens, global_tokens: int, world_size: int):
    """[] ``sum(loss) * world / N`` (dapo's normalisation with one accumulation step)."""
    return aggregate(loss_tokens, "dapo", global_tokens=global_tokens, scale=float(world_size))


def step_metrics(
    rewards: np.ndarray,
    per_func: Dict[str, np.ndarray],
    group: int,
    kl_mean: Optional[float],
    clip_ratio: float,
    completion_lengths: np.ndarray,
) -> Dict[str, float]:
    """This micro-batch's logged numbers (python floats): reward (mean), reward_std (mean of the groups'
    ddof=1 std, as TRL), rewards/<function>, kl and clip_ratio (token means of the global batch, given),
    completion_length (mean tokens, EOS included).

    >>> step_metrics(np.array([1.0, 0.0]), {"f": np.array([1.0, 0.0])}, 2, None, 0.25, np.array([3, 5]))
    {'reward': 0.5, 'reward_std': 0.7071067811865476, 'completion_length': 4.0, 'clip_ratio': 0.25, 'rewards/f': 0.5}
    """
    r = np.asarray(rewards, dtype=np.float64).reshape([-1, group])  # [n, G]
    out = {
        "reward": float(r.mean()),
        "reward_std": float(r.std(axis=1, ddof=1).mean()),
        "completion_length": float(np.mean(completion_lengths)),
        "clip_ratio": float(clip_ratio),
    }
    if kl_mean is not None:
        out["kl"] = float(kl_mean)
    for name, values in per_func.items():
        out[f"rewards/{name}"] = float(np.mean(values))
    return out
