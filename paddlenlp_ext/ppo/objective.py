"""PPO's math (PaddleNLP's / safe-rlhf's PPO, TRL's PPOTrainer): the KL-penalised token rewards, GAE,
whitening, the clipped policy loss and the clipped value loss, on completions laid out flat.

A batch of completions is flat: token t of every completion in order, ``segment[t]`` its completion
(ascending, as ``grpo.rows.sequence_rows`` lays them out).  For one completion with per-token
log-probs ``logp``, reference ``ref``, values ``V`` (the critic's estimate before each token) and the
sequence's score ``s`` (reward model / functions, clipped to ``+-clip_range_score``)::

    r_t   = -kl_coeff * (logp_t - ref_t)        (+ s at the completion's last token)
    delta = r_t + gamma * V_{t+1} - V_t          (V after the last token = 0)
    A_t   = delta_t + gamma * lam * A_{t+1}      returns_t = A_t + V_t
    A     = whiten(A) over every token of the batch (mean 0, unbiased variance 1, + 1e-8)
    policy loss = mean_t max(-A_t ratio_t, -A_t clip(ratio_t, 1 - clip_range_ratio, 1 + clip_range_ratio))
    value loss  = 0.5 mean_t max((V'_t - R_t)^2, (clip(V'_t, V_t - clip_range_value, V_t + clip_range_value) - R_t)^2)

``ratio = exp(logp' - logp)`` and ``V'`` are the policy's and the critic's at training time.
Worked example (one completion of 2 tokens, no KL, gamma 1, lam 0.95, score 1, values [0.5, 0.25])::

    r = [0, 1]; delta = [0 + 0.25 - 0.5, 1 + 0 - 0.25] = [-0.25, 0.75]
    A = [-0.25 + 0.95 * 0.75, 0.75] = [0.4625, 0.75]; returns = [0.9625, 1.0]
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

__all__ = ["token_rewards", "gae", "whiten", "policy_loss", "value_loss"]


def token_rewards(
    logps: np.ndarray,
    ref_logps: np.ndarray,
    scores: np.ndarray,
    segment: np.ndarray,
    kl_coeff: float,
    clip_range_score: float = float("inf"),
) -> np.ndarray:
    """[T] rewards: the k1 KL penalty per token plus each completion's (clipped) score on its last token.

    >>> token_rewards(np.array([-1.0, -2.0, -1.0]), np.array([-1.5, -2.0, -1.0]), np.array([2.0, -1.0]),
    ...               np.array([0, 0, 1]), kl_coeff=0.1).tolist()
    [-0.05, 2.0, -1.0]
    """
    r = -float(kl_coeff) * (np.asarray(logps, np.float64) - np.asarray(ref_logps, np.float64))  # [T]
    seg = np.asarray(segment)
    last = np.flatnonzero(np.r_[seg[1:] != seg[:-1], True])  # [S] the last token of each completion
    r[last] += np.clip(np.asarray(scores, np.float64), -clip_range_score, clip_range_score)
    return r


def gae(
    rewards: np.ndarray, values: np.ndarray, segment: np.ndarray, gamma: float, lam: float
) -> Tuple[np.ndarray, np.ndarray]:
    """(advantages [T], returns [T]) by generalised advantage estimation within each completion.

    >>> a, r = gae(np.array([0.0, 1.0]), np.array([0.5, 0.25]), np.array([0, 0]), 1.0, 0.95)
    >>> a.round(6).tolist(), r.round(6).tolist()
    ([0.4625, 0.75], [0.9625, 1.0])
    """
    r, v, seg = np.asarray(rewards, np.float64), np.asarray(values, np.float64), np.asarray(segment)
    adv = np.zeros_like(r)
    last_gae, next_value = 0.0, 0.0
    for t in range(len(r) - 1, -1, -1):
        if t == len(r) - 1 or seg[t + 1] != seg[t]:  # a completion's last token: nothing after it
            last_gae, next_value = 0.0, 0.0
        delta = r[t] + gamma * next_value - v[t]
        last_gae = delta + gamma * lam * last_gae
        adv[t] = last_gae
        next_value = v[t]
    return adv, adv + v


def whiten(values: np.ndarray, shift_mean: bool = True) -> np.ndarray:
    """``(x - mean) / sqrt(var + 1e-8)`` with the unbiased variance (TRL's ``masked_whiten`` on the real tokens);
    ``shift_mean=False`` adds the mean back (reward whitening).

    >>> whiten(np.array([1.0, 3.0])).round(4).tolist()
    [-0.7071, 0.7071]
    """
    x = np.asarray(values, np.float64)
    mean, var = x.mean(), x.var(ddof=1) if len(x) > 1 else 0.0
    out = (x - mean) / np.sqrt(var + 1e-8)
    return out + mean if not shift_mean else out


def _clip(x, low, high):
    """Elementwise clip to tensor or scalar bounds in x's dtype (paddle.clip casts float64 to float32)."""
    import paddle

    low = low if hasattr(low, "shape") else paddle.full_like(x, low)
    high = high if hasattr(high, "shape") else paddle.full_like(x, high)
    return paddle.minimum(paddle.maximum(x, low), high)


def policy_loss(logps, old_logps, advantages, clip_range_ratio: float):
    """(loss [], clipped [T] bool): PPO's clipped surrogate, token mean.  Paddle tensors [T]."""
    import paddle

    ratio = paddle.exp(logps - old_logps)  # [T]
    loss1 = -advantages * ratio
    loss2 = -advantages * _clip(ratio, 1.0 - clip_range_ratio, 1.0 + clip_range_ratio)
    return paddle.maximum(loss1, loss2).mean(), (loss2 > loss1).detach()


def value_loss(values, old_values, returns, clip_range_value: float):
    """(loss [], clipped [T] bool): the clipped value loss, ``0.5 x`` token mean.  Paddle tensors [T]."""
    import paddle

    clipped_values = _clip(values, old_values - clip_range_value, old_values + clip_range_value)  # [T]
    loss1 = paddle.square(values - returns)
    loss2 = paddle.square(clipped_values - returns)
    return 0.5 * paddle.maximum(loss1, loss2).mean(), (loss2 > loss1).detach()
