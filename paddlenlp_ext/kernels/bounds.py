"""FlashMask bounds -> two masked row intervals per key column.

Every documented ``startend_row_indices`` form (causal LTS / LTS+LTE,
non-causal LTS+UTE / LTS+LTE+UTS+UTE, no bounds) and ``causal`` itself are
special cases of: for key column ``j``, rows in a "lower" interval
``[lo_s, lo_e)`` and in an "upper" interval ``[up_s, up_e)`` are masked
(``causal`` is the upper interval ``[0, j)``).  Normalizing to that one shape
here lets a single tile kernel serve all forms.

All functions here work on host (numpy) copies of the bounds: they are O(seq)
and feed the tile schedule, which is decided on the host.
"""

from __future__ import annotations

import numpy as np
import paddle

__all__ = ["dense_mask_from_startend"]

_NEG_INF = float("-inf")


def check_bound_count(nb, causal):
    """Paddle's rule (and error text) for the size of the last bounds axis."""
    allowed = (1, 2) if causal else (2, 4)
    if nb not in allowed:
        raise ValueError(
            f"Invalid shape of startend_row_indices, when causal is {causal}, the last dimension should be "
            f"either {allowed[0]} or {allowed[1]} but got {nb}"
        )


def _empty_at(s, e, edge):
    """Move empty intervals (s >= e) to ``[edge, edge)``.

    Canonical empty intervals keep the per-block min/max of the schedule
    informative: an empty "lower" interval sits at the bottom edge, an empty
    "upper" one at the top edge, where their non-empty siblings usually are.
    """
    empty = s >= e
    return np.where(empty, edge, s), np.where(empty, edge, e)


def intervals(sri, causal, batch, seq_q, seq_k):
    """Host-side normalization of the bounds into the two masked row intervals.

    sri: int numpy array [batch, hb, seq_k, nb] or None.
    Returns ((lo_s, lo_e), (up_s, up_e)), each int64 [batch, hb, seq_k]
    (hb = 1 when sri is None): rows in [lo_s, lo_e) and in [up_s, up_e) are
    masked for that key column.
    """
    # Causal is bottom-right aligned as in FlashAttention-2: query row i is at
    # absolute position i + (seq_k - seq_q), so it may see columns j <= i + off.
    off = seq_k - seq_q
    cols = np.arange(seq_k, dtype=np.int64)  # [seq_k]
    shape = (batch, 1, seq_k) if sri is None else sri.shape[:-1]
    top, bottom = np.zeros(shape, np.int64), np.full(shape, seq_q, np.int64)
    causal_up_e = np.broadcast_to(cols - off, shape).copy()
    if sri is None:
        lo_s, lo_e = bottom, bottom
        up_s, up_e = top, (causal_up_e if causal else top)
    else:
        nb = sri.shape[-1]
        sri = sri.astype(np.int64)
        lo_s = sri[..., 0]
        if causal:
            lo_e = sri[..., 1] if nb == 2 else bottom
            up_s, up_e = top, causal_up_e
        elif nb == 2:
            lo_e, up_s, up_e = bottom, top, sri[..., 1]
        else:
            lo_e, up_s, up_e = sri[..., 1], sri[..., 2], sri[..., 3]
    lo_s, lo_e, up_s, up_e = (np.clip(a, 0, seq_q) for a in (lo_s, lo_e, up_s, up_e))
    return _empty_at(lo_s, lo_e, seq_q), _empty_at(up_s, up_e, 0)


def interval_masked(rows, lower, upper):
    """Boolean "masked" from broadcastable row indices and the two (start, end) intervals."""
    (lo_s, lo_e), (up_s, up_e) = lower, upper
    return ((rows >= lo_s) & (rows < lo_e)) | ((rows >= up_s) & (rows < up_e))


def dense_mask_from_startend(startend_row_indices, seq_q, causal, *, additive=False, dtype="float32"):
    """Dense mask equivalent to FlashMask bounds, for references, tests and
    models that can only consume a dense mask.

    Args:
        startend_row_indices: int tensor [batch, hb, seq_k, {1,2,4}] (same
            forms as ``flashmask_attention``).
        seq_q: number of query rows.
        causal: same meaning as in ``flashmask_attention``.
        additive: return a float mask with 0 (attend) / -inf (masked) instead
            of a bool mask.
    Returns:
        [batch, hb, seq_q, seq_k]; bool with True = may attend (the
        ``scaled_dot_product_attention`` convention), or additive float.
    """
    sri = startend_row_indices
    if sri.ndim != 4 or sri.shape[-1] not in (1, 2, 4):
        raise ValueError(f"startend_row_indices must be [batch, heads, seq_k, 1|2|4], got {sri.shape}")
    check_bound_count(sri.shape[-1], causal)
    batch, _, seq_k, _ = sri.shape
    lower, upper = (
        tuple(paddle.to_tensor(a[:, :, None, :].astype(np.int32)) for a in pair)  # [batch, hb, 1, seq_k]
        for pair in intervals(sri.numpy(), causal, batch, seq_q, seq_k)
    )
    rows = paddle.arange(seq_q, dtype="int32").reshape([1, 1, seq_q, 1])
    visible = ~interval_masked(rows, lower, upper)  # [batch, hb, seq_q, seq_k]
    if not additive:
        return visible
    return paddle.where(visible, paddle.zeros([], dtype=dtype), paddle.full([], _NEG_INF, dtype=dtype))


def window_to_startend(window_size, causal, batch, seq):
    """Same conversion as Paddle's flashmask_attention for ``window_size``:
    int32 [batch, 1, seq, 1] (causal LTS) or [batch, 1, seq, 2] (LTS, UTE)."""
    if isinstance(window_size, int):
        window_size = (window_size, window_size)
    # Column j is visible to rows [j - right, j + left]: LTS = j + left + 1.
    lts = np.arange(window_size[0] + 1, seq + window_size[0] + 1)  # [seq]
    if causal:
        sri = np.clip(lts, None, seq).reshape(1, 1, seq, 1)
    else:
        ute = np.arange(-window_size[1], seq - window_size[1])  # [seq]
        sri = np.clip(np.stack([lts, ute], -1), 0, seq).reshape(1, 1, seq, 2)
    return paddle.to_tensor(np.repeat(sri, batch, 0).astype(np.int32))
