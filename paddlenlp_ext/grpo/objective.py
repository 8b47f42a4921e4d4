"""GRPO's math: group-normalised advantages, the clipped objective, the k3 KL estimate.

For the completions ``o_1..o_G`` of one prompt with rewards ``r_i`` (DeepSeekMath eq. 3, TRL's
GRPOTrainer)::

    A_i = (r_i - mean(r)) / (std(r) + eps)        std with ddof=1 (torch's default, as TRL);
                                                    scale_rewards=false: A_i = r_i - mean(r)

and for every completion token t (ratio against the policy that generated it, "old")::

    ratio  = exp(logp_t - old_logp_t)
    obj_t  = min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon) * A)
    kl_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (k3, unbiased and >= 0)
    loss_t = -obj_t + beta * kl_t

The loss is ``sum_t loss_t / N`` with ``N`` the completion tokens of the GLOBAL batch.  With one
optimizer step per generated batch (num_iterations=1) old_logp is logp detached: ratio is 1 in
value, its gradient is the policy gradient.  Worked example: rewards [1, 0] (G=2) give
A = [0.707, -0.707] (0.5 / (std 0.7071 + eps 1e-4)); at ratio 1, beta 0, each token of o_1 has loss -0.707.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import paddle

ADVANTAGE_EPS = 1e-4  # TRL's


def group_advantages(rewards: np.ndarray, group: int, scale: bool = True, eps: float = ADVANTAGE_EPS) -> np.ndarray:
    """``rewards`` [n * group] (each prompt's group consecutive) -> advantages [n * group] float32.

    >>> [round(float(a), 4) for a in group_advantages(np.array([1.0, 0.0, 2.0, 2.0]), group=2)]
    [0.707, -0.707, 0.0, 0.0]
    >>> group_advantages(np.array([1.0, 0.0]), group=2, scale=False).tolist()
    [0.5, -0.5]
    """
    r = np.asarray(rewards, dtype=np.float64).reshape([-1, group])  # [n, G]
    centred = r - r.mean(axis=1, keepdims=True)  # [n, G]
    if scale:
        centred = centred / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    return centred.reshape([-1]).astype(np.float32)  # [n * G]


def token_losses(logps, old_logps, advantages, ref_logps: Optional[paddle.Tensor], *, epsilon: float, beta: float):
    """Per-token loss, KL and clipped flag.

    ``logps``, ``old_logps``: [T] float32 log-probs of the completion tokens (policy, generating
    policy); ``advantages``: [T] the advantage of each token's completion; ``ref_logps``: [T] or
    None (beta 0).  Returns ``(loss [T], kl [T] or None, clipped [T] bool)``, ``clipped`` as TRL's
    clip ratio counts it: the clipped term is the active one (ratio below 1-eps with A<0, above
    1+eps with A>0).
    """
    ratio = paddle.exp(logps - old_logps)  # [T]
    clipped_ratio = paddle.clip(ratio, 1.0 - epsilon, 1.0 + epsilon)  # [T]
    objective = paddle.minimum(ratio * advantages, clipped_ratio * advantages)  # [T]
    loss = -objective  # [T]
    kl = None
    if ref_logps is not None and beta > 0:
        delta = ref_logps - logps  # [T]
        kl = paddle.exp(delta) - delta - 1.0  # [T]
        loss = loss + beta * kl
    low = paddle.logical_and(ratio < 1.0 - epsilon, advantages < 0)  # [T]
    high = paddle.logical_and(ratio > 1.0 + epsilon, advantages > 0)  # [T]
    return loss, kl, paddle.logical_or(low, high).detach()


def global_token_loss(loss_tokens, global_tokens: int, world_size: int):
    """[] this process's share of the global batch's token mean: ``sum(loss) * world / N``.

    Data parallel averages the gradients over the ``world_size`` ranks, so each rank's
    ``sum * world / N`` averages to ``(sum over every rank's tokens) / N``, one process's value.
    """
    return loss_tokens.sum() * (float(world_size) / max(int(global_tokens), 1))


def step_metrics(rewards: np.ndarray, per_func: Dict[str, np.ndarray], group: int, kl_mean: Optional[float],
                 clip_ratio: float, completion_lengths: np.ndarray) -> Dict[str, float]:
    """This micro-batch's logged numbers (python floats): reward (mean), reward_std (mean of the groups'
    ddof=1 std, as TRL), rewards/<function>, kl and clip_ratio (token means of the global batch, given),
    completion_length (mean tokens, EOS included).

    >>> step_metrics(np.array([1.0, 0.0]), {"f": np.array([1.0, 0.0])}, 2, None, 0.25, np.array([3, 5]))
    {'reward': 0.5, 'reward_std': 0.7071067811865476, 'completion_length': 4.0, 'clip_ratio': 0.25, 'rewards/f': 0.5}
    """
    r = np.asarray(rewards, dtype=np.float64).reshape([-1, group])  # [n, G]
    out = {"reward": float(r.mean()), "reward_std": float(r.std(axis=1, ddof=1).mean()),
           "completion_length": float(np.mean(completion_lengths)), "clip_ratio": float(clip_ratio)}
    if kl_mean is not None:
        out["kl"] = float(kl_mean)
    for name, values in per_func.items():
        out[f"rewards/{name}"] = float(np.mean(values))
    return out
