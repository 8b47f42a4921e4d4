"""RoPE frequencies of the decoder: the default, ``linear``, ``llama3``, ``yarn`` and ``longrope`` scalings (numpy).

transformers' ``modeling_rope_utils.py`` is the reference for the formulas; this is
our own numpy code (float32 where transformers computes in float32, so that angles
agree to the last bits).  :func:`inv_freq` returns ``(inv_freq [rotary_dim / 2],
attention_scaling)``; cos/sin are ``cos(pos * inv_freq) * attention_scaling``.

    >>> f, s = inv_freq(4, 10000.0, None, max_positions=64)
    >>> f.tolist(), s
    ([1.0, 0.009999999776482582], 1.0)
    >>> f, s = inv_freq(4, 10000.0, {"rope_type": "linear", "factor": 2.0}, max_positions=64)
    >>> f.tolist()
    [0.5, 0.004999999888241291]
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np


def _default(dim: int, theta: float) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)  # [dim / 2]
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def _llama3(freq: np.ndarray, rope: dict) -> np.ndarray:
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = (2 * math.pi / freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, freq / np.float32(factor), freq).astype(np.float32)
    smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(dim: int, theta: float, rope: dict, max_positions: int) -> Tuple[np.ndarray, float]:
    factor = float(rope["factor"])
    if "original_max_position_embeddings" in rope:
        original = float(rope["original_max_position_embeddings"])
        factor = max_positions / original
    else:
        original = float(max_positions)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no division by zero
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))  # [dim / 2]
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra_weight = (1 - ramp).astype(np.float32)
    return (interpolation * (1 - extra_weight) + extrapolation * extra_weight).astype(np.float32), float(attention)


def _longrope(
    dim: int, theta: float, rope: dict, max_positions: int, original: Optional[int], long: bool
) -> Tuple[np.ndarray, float]:
    factor = rope.get("factor")
    if original:
        factor = max_positions / original
    else:
        original = max_positions
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(rope["long_factor" if long else "short_factor"], dtype=np.float32)  # [dim / 2]
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (ext * np.float32(theta) ** shape)).astype(np.float32), float(attention)


def inv_freq(
    dim: int,
    theta: float,
    rope: Optional[dict],
    max_positions: int,
    original_max_positions: Optional[int] = None,
    seq_len: int = 0,
) -> Tuple[np.ndarray, float]:
    """(inverse frequencies [dim / 2] float32, attention scaling) for ``dim`` rotary channels.

    ``seq_len`` matters for ``longrope`` only: its long factors apply when the largest position + 1
    exceeds ``original_max_positions`` (transformers' per-forward switch)."""
    rtype = (rope or {}).get("rope_type", "default")
    if rtype == "default":
        return _default(dim, theta), 1.0
    if rtype == "linear":
        return (_default(dim, theta) / np.float32(rope["factor"])).astype(np.float32), 1.0
    if rtype == "llama3":
        return _llama3(_default(dim, theta), rope), 1.0
    if rtype == "yarn":
        return _yarn(dim, theta, rope, max_positions)
    if rtype == "longrope":
        limit = original_max_positions or max_positions
        return _longrope(dim, theta, rope, max_positions, original_max_positions, long=seq_len > limit)
    raise ValueError(f"rope_type {rtype!r} is not implemented")
