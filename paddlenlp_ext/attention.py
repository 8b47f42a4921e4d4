"""CPU drop-in for ``paddle.nn.functional.flashmask_attention``.

Paddle ships FlashMask only as a CUDA/XPU kernel.  This module re-implements
the same API (signature, ``[batch, seq, heads, head_dim]`` layout, the
column-wise ``startend_row_indices`` mask forms, GQA/MQA) with ordinary Paddle
ops so packed-sequence training runs on CPU and in unit tests.

How it works
------------
* The bounds are turned, per key column ``j``, into two masked row intervals:
  a "lower" interval ``[lo_s, lo_e)`` and an "upper" interval ``[up_s, up_e)``
  (``causal`` becomes the upper interval ``[0, j)``).  Every documented form
  (causal LTS / LTS+LTE, non-causal LTS+UTE / LTS+LTE+UTS+UTE, no bounds) is a
  special case, so one tile kernel serves them all.
* The score matrix is cut into ``BLOCK_SIZE x BLOCK_SIZE`` tiles.  Per key
  block we take min/max of the interval ends (O(seq) work, done on the host)
  and classify every tile as fully masked (never computed), fully visible
  (computed without a mask) or partial (a mask is built for that tile only,
  from the bounds).  No ``seq x seq`` mask is ever materialized, and a packed
  row with block-diagonal causal masks costs ~ sum of squared segment lengths.
* The forward is a FlashAttention-2 style loop with an online softmax (running
  max + log-sum-exp) across key tiles; the backward is hand written in a
  ``PyLayer`` and recomputes tile probabilities from the saved log-sum-exp, so
  only q, k, v, out and lse are kept for backward.
* Query rows that see no key produce 0 (and 0 gradient): their lse is +inf,
  as in FlashAttention-2, which makes every recomputed probability exactly 0.

The tile schedule is built from host copies of the bounds (``.numpy()``), so
this is a dynamic-graph implementation; it is meant for CPU, not for
``paddle.jit.to_static``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import paddle
from paddle.autograd import PyLayer

__all__ = [
    "BLOCK_SIZE",
    "KV_MERGE",
    "flashmask_attention",
    "dense_mask_from_startend",
    "flashmask_stats",
]

# Tile edge (query rows x key columns).  128 matches the FlashMask CUDA kernel
# and the granularity of ``block_mask``.
BLOCK_SIZE = 128
# Adjacent non-skipped key blocks of one query block are fused into a single
# tile of up to KV_MERGE blocks: fewer, larger GEMMs matter more on CPU than
# the few extra masked scores (temporaries stay O(BLOCK_SIZE * KV_MERGE * BLOCK_SIZE)).
KV_MERGE = 4

_NEG_INF = float("-inf")

# Statistics of the most recent call, for the benchmark and tests.
_LAST_STATS: dict = {}


def flashmask_stats() -> dict:
    """Tile/memory statistics of the most recent ``flashmask_attention`` call.

    Keys: ``tiles_total`` (query blocks x key blocks x batch), ``tiles_skipped``,
    ``tiles_visible`` / ``tiles_partial`` (after merging), ``score_elems`` (score
    entries computed, summed over heads), ``dense_score_elems`` (what dense
    attention computes), ``bounds_bytes`` (normalized O(seq) bounds, host +
    device), ``peak_tile_mask_bytes`` / ``peak_tile_score_bytes`` (largest
    per-tile temporaries), ``dense_mask_bytes`` (a bool seq_q x seq_k mask per
    bound head, what the dense path would allocate).
    """
    return dict(_LAST_STATS)


# --------------------------------------------------------------------------
# Bounds -> row intervals
# --------------------------------------------------------------------------
def _intervals_np(sri, causal, batch, seq_q, seq_k):
    """Host-side normalization of the bounds into two masked row intervals.

    sri: int numpy array [batch, hb, seq_k, nb] or None.
    Returns lo_s, lo_e, up_s, up_e as int64 [batch, hb, seq_k]: rows in
    [lo_s, lo_e) and in [up_s, up_e) are masked for that key column.
    """
    # Causal is bottom-right aligned as in FlashAttention-2: query row i is at
    # absolute position i + (seq_k - seq_q), so it may see columns j <= i + off.
    off = seq_k - seq_q
    cols = np.arange(seq_k, dtype=np.int64)
    if sri is None:
        shape = (batch, 1, seq_k)
        lo_s = np.full(shape, seq_q, np.int64)
        lo_e = np.full(shape, seq_q, np.int64)
        up_s = np.zeros(shape, np.int64)
        up_e = np.broadcast_to(cols - off, shape).copy() if causal else np.zeros(shape, np.int64)
    else:
        nb = sri.shape[-1]
        sri = sri.astype(np.int64)
        shape = sri.shape[:-1]
        lo_s = sri[..., 0]
        if causal:
            lo_e = sri[..., 1] if nb == 2 else np.full(shape, seq_q, np.int64)
            up_s = np.zeros(shape, np.int64)
            up_e = np.broadcast_to(cols - off, shape).copy()
        elif nb == 2:
            lo_e = np.full(shape, seq_q, np.int64)
            up_s = np.zeros(shape, np.int64)
            up_e = sri[..., 1]
        else:
            lo_e, up_s, up_e = sri[..., 1], sri[..., 2], sri[..., 3]
    lo_s, lo_e, up_s, up_e = (np.clip(a, 0, seq_q) for a in (lo_s, lo_e, up_s, up_e))
    # Canonical empty intervals keep the per-block min/max informative: an
    # empty "lower" interval sits at the bottom edge, an empty "upper" one at
    # the top edge, where their non-empty siblings usually are.
    lo_empty = lo_s >= lo_e
    lo_s = np.where(lo_empty, seq_q, lo_s)
    lo_e = np.where(lo_empty, seq_q, lo_e)
    up_empty = up_s >= up_e
    up_s = np.where(up_empty, 0, up_s)
    up_e = np.where(up_empty, 0, up_e)
    return lo_s, lo_e, up_s, up_e


def _interval_masked(rows, lo_s, lo_e, up_s, up_e):
    """Boolean "masked" from broadcastable row indices and interval bounds."""
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
    _check_bound_count(sri.shape[-1], causal)
    batch, hb, seq_k, _ = sri.shape
    lo_s, lo_e, up_s, up_e = (
        paddle.to_tensor(a[:, :, None, :].astype(np.int32))  # [batch, hb, 1, seq_k]
        for a in _intervals_np(sri.numpy(), causal, batch, seq_q, seq_k)
    )
    rows = paddle.arange(seq_q, dtype="int32").reshape([1, 1, seq_q, 1])
    visible = ~_interval_masked(rows, lo_s, lo_e, up_s, up_e)  # [batch, hb, seq_q, seq_k]
    if not additive:
        return visible
    return paddle.where(
        visible, paddle.zeros([], dtype=dtype), paddle.full([], _NEG_INF, dtype=dtype)
    )


def _check_bound_count(nb, causal):
    if causal and nb not in (1, 2):
        raise ValueError(
            f"Invalid shape of startend_row_indices, when causal is True, the last dimension should be "
            f"either 1 or 2 but got {nb}"
        )
    if not causal and nb not in (2, 4):
        raise ValueError(
            f"Invalid shape of startend_row_indices, when causal is False, the last dimension should be "
            f"either 2 or 4 but got {nb}"
        )


# --------------------------------------------------------------------------
# Tile schedule
# --------------------------------------------------------------------------
@dataclass
class _Tile:
    ks: int
    ke: int
    partial: bool
    # Which comparisons the partial mask needs (others are known to be
    # constant over the tile from the block min/max).
    lo_s: bool = False
    lo_e: bool = False
    lo_rel: bool = False
    up_s: bool = False
    up_e: bool = False
    up_rel: bool = False
    # Per-head block-mask drop flags, bool [hm, gm, 1, 1] (only when
    # block_mask varies across heads for this tile).
    bm_drop: object = None


@dataclass
class _Plan:
    batch: int
    seq_q: int
    seq_k: int
    hq: int
    hk: int
    group: int
    head_dim: int
    scale: float
    q_ranges: list
    # tiles[b][i] -> list of _Tile for query block i of batch row b.
    tiles: list
    # Per batch row: device int32 interval tensors shaped [hm, gm, 1, seq_k].
    bounds: list = field(default_factory=list)
    mask_heads: tuple = (1, 1)
    rows: list = field(default_factory=list)  # per query block: [1, 1, bq, 1] int32


def _blocks(n, size):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _build_plan(query, key, sri, causal, scale, block_mask, block_q, block_k):
    batch, seq_q, hq, head_dim = query.shape
    seq_k, hk = key.shape[1], key.shape[2]
    group = hq // hk
    q_ranges = _blocks(seq_q, block_q)
    k_ranges = _blocks(seq_k, block_k)
    nqb, nkb = len(q_ranges), len(k_ranges)

    sri_np = None if sri is None else sri.numpy()
    lo_s, lo_e, up_s, up_e = _intervals_np(sri_np, causal, batch, seq_q, seq_k)  # [batch, hb, seq_k]
    hb = lo_s.shape[1]

    # Per key block min/max over its columns: [batch, hb, nkb].
    starts = np.array([r[0] for r in k_ranges])
    lo_s_min, lo_s_max = np.minimum.reduceat(lo_s, starts, -1), np.maximum.reduceat(lo_s, starts, -1)
    lo_e_min, lo_e_max = np.minimum.reduceat(lo_e, starts, -1), np.maximum.reduceat(lo_e, starts, -1)
    up_s_min, up_s_max = np.minimum.reduceat(up_s, starts, -1), np.maximum.reduceat(up_s, starts, -1)
    up_e_min, up_e_max = np.minimum.reduceat(up_e, starts, -1), np.maximum.reduceat(up_e, starts, -1)

    # Broadcast to [batch, hb, nqb, nkb] against the query block edges.
    qs = np.array([r[0] for r in q_ranges])[None, None, :, None]
    qe = np.array([r[1] for r in q_ranges])[None, None, :, None]

    def kb(a):
        return a[:, :, None, :]

    # "start cmp trivially true": every column's interval starts at/above the
    # tile top; "end cmp trivially true": every interval ends at/below the tile bottom.
    lo_s_true, lo_e_true = kb(lo_s_max) <= qs, kb(lo_e_min) >= qe
    up_s_true, up_e_true = kb(up_s_max) <= qs, kb(up_e_min) >= qe
    lo_disj = (kb(lo_s_min) >= qe) | (kb(lo_e_max) <= qs)
    up_disj = (kb(up_s_min) >= qe) | (kb(up_e_max) <= qs)
    covered = (lo_s_true & lo_e_true) | (up_s_true & up_e_true)  # whole tile masked for that head
    skip = covered.all(1)  # [batch, nqb, nkb]
    visible = (lo_disj & up_disj).all(1)

    bm_np = None
    if block_mask is not None:
        bm_np = block_mask.numpy().astype(bool)  # [batch, hb, nqb, nkb], True = keep
        skip = skip | ~bm_np.any(1)
        bm_mixed = bm_np.any(1) & ~bm_np.all(1)
        visible = visible & ~bm_mixed

    # Head layout of mask tensors so they broadcast onto scores viewed as
    # [hk, group, bq, bk]: per-q-head bounds map q head h to (h // group, h % group).
    if hb == 1:
        mask_heads = (1, 1)
    elif hb == hk:
        mask_heads = (hk, 1)
    else:
        mask_heads = (hk, group)

    tiles = []
    n_visible = n_partial = 0
    score_elems = 0
    peak_mask = peak_score = 0
    for b in range(batch):
        rows_b = []
        for i, (q0, q1) in enumerate(q_ranges):
            run = []  # key block indices of the tile being grown
            row_tiles = []
            prev_bm_split = False

            def flush():
                if not run:
                    return
                js = run
                partial = not all(visible[b, i, j] for j in js)
                t = _Tile(k_ranges[js[0]][0], k_ranges[js[-1]][1], partial)
                if partial:
                    sel = (b, slice(None), i, slice(js[0], js[-1] + 1))
                    # A comparison is needed if any head/column in the run needs it.
                    t.lo_rel = bool((~lo_disj[sel]).any())
                    t.up_rel = bool((~up_disj[sel]).any())
                    t.lo_s = t.lo_rel and bool((~lo_s_true[sel]).any())
                    t.lo_e = t.lo_rel and bool((~lo_e_true[sel]).any())
                    t.up_s = t.up_rel and bool((~up_s_true[sel]).any())
                    t.up_e = t.up_rel and bool((~up_e_true[sel]).any())
                    if bm_np is not None and (~bm_np[sel]).any():
                        # Runs are split at block-mask changes (see below), so
                        # one keep/drop value per head covers the whole run.
                        drop = ~bm_np[b, :, i, js[0]]  # [hb]
                        t.bm_drop = paddle.to_tensor(drop.reshape(list(mask_heads) + [1, 1]))
                row_tiles.append(t)
                run.clear()

            for j in range(nkb):
                if skip[b, i, j]:
                    flush()
                    continue
                # Keep mixed block-mask blocks in their own tile so a single
                # per-head keep/drop term describes it.
                bm_split = bm_np is not None and not (bm_np[b, :, i, j].all())
                if run and (len(run) >= KV_MERGE or bm_split or prev_bm_split):
                    flush()
                run.append(j)
                prev_bm_split = bm_split
            flush()
            for t in row_tiles:
                w = t.ke - t.ks
                score_elems += hq * (q1 - q0) * w
                peak_score = max(peak_score, hq * (q1 - q0) * w * 4)
                if t.partial:
                    n_partial += 1
                    peak_mask = max(peak_mask, mask_heads[0] * mask_heads[1] * (q1 - q0) * w)
                else:
                    n_visible += 1
            rows_b.append(row_tiles)
        tiles.append(rows_b)

    plan = _Plan(batch, seq_q, seq_k, hq, hk, group, head_dim, scale, q_ranges, tiles, mask_heads=mask_heads)
    need_bounds = any(t.partial for rb in tiles for row in rb for t in row)
    bounds_bytes = 4 * lo_s.size * 8  # host int64 intervals
    bounds_bytes += 12 * lo_s_min.size * 8  # per-block min/max
    if need_bounds:
        for b in range(batch):
            # [hb, seq_k] -> [hm, gm, 1, seq_k]
            plan.bounds.append(
                tuple(
                    paddle.to_tensor(a[b].astype(np.int32).reshape(list(mask_heads) + [1, seq_k]))
                    for a in (lo_s, lo_e, up_s, up_e)
                )
            )
        bounds_bytes += 4 * batch * hb * seq_k * 4
        plan.rows = [paddle.arange(q0, q1, dtype="int32").reshape([1, 1, q1 - q0, 1]) for q0, q1 in q_ranges]

    _LAST_STATS.clear()
    _LAST_STATS.update(
        tiles_total=batch * nqb * nkb,
        tiles_skipped=int(skip.sum()),
        tiles_visible=n_visible,
        tiles_partial=n_partial,
        score_elems=int(score_elems),
        dense_score_elems=int(batch * hq * seq_q * seq_k),
        bounds_bytes=int(bounds_bytes),
        peak_tile_mask_bytes=int(peak_mask),
        peak_tile_score_bytes=int(peak_score),
        dense_mask_bytes=int(batch * hb * seq_q * seq_k),
    )
    return plan


def _tile_mask(plan, b, i, t):
    """Bool "masked" of one partial tile, broadcastable to [hk, group, bq, bk]
    (stored as [hm, gm, bq, bk]), built from the bounds of its columns."""
    masked = None
    if plan.bounds:
        rows = plan.rows[i]  # [1, 1, bq, 1]
        lo_s, lo_e, up_s, up_e = (x[..., t.ks : t.ke] for x in plan.bounds[b])  # [hm, gm, 1, bk]
        masked = _bounds_mask(t, rows, lo_s, lo_e, up_s, up_e)
    if t.bm_drop is not None:
        masked = t.bm_drop if masked is None else masked | t.bm_drop
    return masked


def _bounds_mask(t, rows, lo_s, lo_e, up_s, up_e):
    masked = None
    for rel, need_s, need_e, s, e in (
        (t.lo_rel, t.lo_s, t.lo_e, lo_s, lo_e),
        (t.up_rel, t.up_s, t.up_e, up_s, up_e),
    ):
        if not rel:
            continue
        term = None
        if need_s:
            term = rows >= s
        if need_e:
            term = (rows < e) if term is None else term & (rows < e)
        if term is None:  # both comparisons trivially true for every column
            term = paddle.ones([1, 1, rows.shape[2], t.ke - t.ks], dtype="bool")
        masked = term if masked is None else masked | term
    return masked


def _masked_fill(x, masked, value, plan, t):
    """masked_fill on a tile tensor [hk, group*bq, bk] with a mask that
    broadcasts over its [hk, group, bq, bk] view."""
    if masked is None:
        return x
    shape = x.shape
    x4 = x.reshape([plan.hk, plan.group, shape[1] // plan.group, shape[2]])
    return paddle.masked_fill(x4, masked, value).reshape(shape)


# --------------------------------------------------------------------------
# Layout helpers
# --------------------------------------------------------------------------
def _q_blocks(xb, plan):
    """One batch row [seq_q, hq, d] -> list of [hk, group*bq, d] (query blocks)."""
    xb = xb.transpose([1, 0, 2]).reshape([plan.hk, plan.group, plan.seq_q, -1])  # [hk, g, sq, d]
    sizes = [e - s for s, e in plan.q_ranges]
    return [blk.reshape([plan.hk, plan.group * sz, -1]) for blk, sz in zip(paddle.split(xb, sizes, axis=2), sizes)]


def _q_merge(blocks, plan):
    """Inverse of _q_blocks: list of [hk, group*bq, d] -> [seq_q, hq, d]."""
    parts = [blk.reshape([plan.hk, plan.group, e - s, -1]) for blk, (s, e) in zip(blocks, plan.q_ranges)]
    xb = paddle.concat(parts, axis=2).reshape([plan.hq, plan.seq_q, -1])  # [hq, sq, d]
    return xb.transpose([1, 0, 2])


def _lse_blocks(lse, plan, b):
    """[batch, hq, seq_q] -> list of [hk, group*bq, 1]."""
    lb = lse[b].reshape([plan.hk, plan.group, plan.seq_q, 1])
    sizes = [e - s for s, e in plan.q_ranges]
    return [blk.reshape([plan.hk, plan.group * sz, 1]) for blk, sz in zip(paddle.split(lb, sizes, axis=2), sizes)]


def _kv_heads_first(x, b):
    """[batch, sk, hk, d] -> contiguous [hk, sk, d] for batch row b."""
    return x[b].transpose([1, 0, 2]).contiguous()


def _cols(x, t):
    """Key range of a tile, [hk, bk, d].  Made contiguous because Paddle's CPU
    matmul takes a very slow strided path for non-contiguous operands
    (~50x on [8, 512, 64])."""
    return x[:, t.ks : t.ke].contiguous()


# --------------------------------------------------------------------------
# Forward / backward
# --------------------------------------------------------------------------
def _forward(q, k, v, plan):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (fp32) -> out [B, Sq, Hq, D], lse [B, Hq, Sq]."""
    outs, lses = [], []
    for b in range(plan.batch):
        qb = _q_blocks(q[b] * plan.scale, plan)  # scale folded into q once
        kb = _kv_heads_first(k, b)  # [hk, sk, d]
        vb = _kv_heads_first(v, b)
        o_blocks, l_blocks = [], []
        for i, (q0, q1) in enumerate(plan.q_ranges):
            qi = qb[i]  # [hk, g*bq, d]
            rows = qi.shape[1]
            m = l = acc = None
            for t in plan.tiles[b][i]:
                s = paddle.matmul(qi, _cols(kb, t), transpose_y=True)  # [hk, g*bq, bk]
                masked = _tile_mask(plan, b, i, t) if t.partial else None
                s = _masked_fill(s, masked, _NEG_INF, plan, t)
                m_blk = s.max(-1, keepdim=True)  # [hk, g*bq, 1]
                m_new = m_blk if m is None else paddle.maximum(m, m_blk)
                if t.partial:
                    # Rows without any visible key so far have max -inf; shift by
                    # 0 instead so exp() yields 0, not NaN.  Unmasked tiles give
                    # every row a finite max, so they skip this.
                    m_safe = paddle.where(paddle.isinf(m_new), paddle.zeros_like(m_new), m_new)
                else:
                    m_safe = m_new
                # Paddle's CPU exp() maps -inf to ~3e-39, a denormal that makes
                # the following matmul ~50x slower and leaks into empty rows:
                # zero masked probabilities explicitly.
                p = _masked_fill(paddle.exp(s - m_safe), masked, 0.0, plan, t)  # [hk, g*bq, bk]
                pv = paddle.matmul(p, _cols(vb, t))  # [hk, g*bq, d]
                if m is None:
                    l, acc = p.sum(-1, keepdim=True), pv
                else:
                    alpha = paddle.exp(m - m_safe)  # rescale earlier tiles to the new max
                    l = l * alpha + p.sum(-1, keepdim=True)
                    acc = acc * alpha + pv
                m = m_new
            if m is None:  # every key block skipped: the rows see nothing
                o_blocks.append(paddle.zeros([plan.hk, rows, plan.head_dim], dtype=q.dtype))
                l_blocks.append(paddle.full([plan.hk, rows, 1], float("inf"), dtype=q.dtype))
                continue
            # Rows that never saw a key keep max -inf (and l == 0).
            empty = paddle.isinf(m)  # [hk, g*bq, 1]
            l_safe = paddle.where(empty, paddle.ones_like(l), l)
            o_blocks.append(paddle.where(empty, paddle.zeros_like(acc), acc / l_safe))
            # FlashAttention-2 convention: lse = +inf for rows with no visible key.
            lse_i = paddle.where(empty, paddle.zeros_like(m), m) + paddle.log(l_safe)
            l_blocks.append(paddle.where(empty, paddle.full_like(lse_i, float("inf")), lse_i))
        outs.append(_q_merge(o_blocks, plan))  # [sq, hq, d]
        lses.append(_q_merge(l_blocks, plan)[:, :, 0].transpose([1, 0]))  # [hq, sq]
    return paddle.stack(outs), paddle.stack(lses)


def _backward(q, k, v, out, lse, dout, plan):
    """FlashAttention-2 backward: recompute P per tile from lse.

    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
    dQ = dS K * scale, dK = dS^T (Q * scale).  GQA: the group axis is folded
    into the rows of the q-side operands, so the k/v-side matmuls sum over it.
    """
    dqs, dks, dvs = [], [], []
    for b in range(plan.batch):
        qb = _q_blocks(q[b] * plan.scale, plan)
        dob = _q_blocks(dout[b], plan)
        ob = _q_blocks(out[b], plan)
        lb = _lse_blocks(lse, plan, b)
        kb = _kv_heads_first(k, b)  # [hk, sk, d]
        vb = _kv_heads_first(v, b)
        dk = paddle.zeros_like(kb)
        dv = paddle.zeros_like(vb)
        dq_blocks = []
        for i in range(len(plan.q_ranges)):
            qi, doi = qb[i], dob[i]  # [hk, g*bq, d]
            dqi = paddle.zeros_like(qi)
            tiles = plan.tiles[b][i]
            if tiles:
                delta = (doi * ob[i]).sum(-1, keepdim=True)  # [hk, g*bq, 1]
                lse_i = lb[i]
            for t in tiles:
                kt, vt = _cols(kb, t), _cols(vb, t)  # [hk, bk, d]
                s = paddle.matmul(qi, kt, transpose_y=True)  # [hk, g*bq, bk]
                # No -inf fill needed here: masked probabilities are zeroed
                # after exp (exp(-inf) is not exactly 0 on CPU, see _forward).
                # Rows without any visible key (lse = +inf) only occur in
                # partial tiles, where all their entries are masked.
                masked = _tile_mask(plan, b, i, t) if t.partial else None
                p = _masked_fill(paddle.exp(s - lse_i), masked, 0.0, plan, t)  # [hk, g*bq, bk]
                dv[:, t.ks : t.ke] += paddle.matmul(p, doi, transpose_x=True)  # [hk, bk, d]
                dp = paddle.matmul(doi, vt, transpose_y=True)  # [hk, g*bq, bk]
                ds = p * (dp - delta)
                dqi = dqi + paddle.matmul(ds, kt)
                dk[:, t.ks : t.ke] += paddle.matmul(ds, qi, transpose_x=True)
            dq_blocks.append(dqi * plan.scale)
        dqs.append(_q_merge(dq_blocks, plan))
        dks.append(dk.transpose([1, 0, 2]))
        dvs.append(dv.transpose([1, 0, 2]))
    return paddle.stack(dqs), paddle.stack(dks), paddle.stack(dvs)


class _FlashMaskFn(PyLayer):
    @staticmethod
    def forward(ctx, query, key, value, plan):
        dtypes = (query.dtype, key.dtype, value.dtype)
        # fp16/bf16 inputs: accumulate in fp32 (CPU kernels for half matmul are
        # slow or missing, and the online softmax needs the range).
        q, k, v = (x if x.dtype == paddle.float32 else x.astype("float32") for x in (query, key, value))
        out, lse = _forward(q, k, v, plan)
        ctx.plan = plan
        ctx.dtypes = dtypes
        ctx.save_for_backward(q, k, v, out, lse)
        out = out if dtypes[0] == paddle.float32 else out.astype(dtypes[0])
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensor()
        dout = dout if dout.dtype == paddle.float32 else dout.astype("float32")
        dq, dk, dv = _backward(q, k, v, out, lse, dout, ctx.plan)
        return tuple(g if g.dtype == dt else g.astype(dt) for g, dt in zip((dq, dk, dv), ctx.dtypes))


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------
def _window_to_startend(window_size, causal, batch, seq):
    """Same conversion as Paddle's flashmask_attention for ``window_size``."""
    if isinstance(window_size, int):
        window_size = (window_size, window_size)
    if causal:
        lts = np.clip(np.arange(window_size[0] + 1, seq + window_size[0] + 1), None, seq)
        sri = lts.reshape(1, 1, seq, 1)
    else:
        lts = np.arange(window_size[0] + 1, seq + window_size[0] + 1)
        ute = np.arange(-window_size[1], seq - window_size[1])
        sri = np.clip(np.stack([lts, ute], -1), 0, seq).reshape(1, 1, seq, 2)
    return paddle.to_tensor(np.repeat(sri, batch, 0).astype(np.int32))


def flashmask_attention(
    query,
    key,
    value,
    startend_row_indices=None,
    *,
    dropout=0.0,
    causal=False,
    window_size=None,
    return_softmax_lse=False,
    return_seed_offset=False,
    fixed_seed_offset=None,
    rng_name="",
    training=True,
    name=None,
    softmax_scale=None,
    block_mask=None,
):
    r"""CPU implementation of ``paddle.nn.functional.flashmask_attention``.

    ``softmax(Q K^T * scale + M) V`` where M is described column-wise by
    ``startend_row_indices``; rows in ``[start, end)`` of key column j are masked.

    Args:
        query: [batch, seq_q, num_heads, head_dim].
        key, value: [batch, seq_k, k_num_heads, head_dim]; num_heads must be a
            multiple of k_num_heads (GQA/MQA; query head h uses kv head
            h // (num_heads // k_num_heads)).
        startend_row_indices: int tensor [batch, 1 | num_heads | k_num_heads,
            seq_k, {1, 2, 4}] or None.
            * causal, 1 bound  (LTS): rows >= LTS masked (plus the causal mask).
            * causal, 2 bounds (LTS, LTE): rows in [LTS, LTE) masked (plus causal).
            * non-causal, 2 bounds (LTS, UTE): rows >= LTS and rows < UTE masked.
            * non-causal, 4 bounds (LTS, LTE, UTS, UTE): rows in [LTS, LTE)
              and in [UTS, UTE) masked.
            * None: plain (causal or full) attention.
        dropout: only 0 is supported while training (raises NotImplementedError
            otherwise); ignored when ``training=False``, as in Paddle.
        causal: causal masking; for seq_q != seq_k it is bottom-right aligned
            (FlashAttention-2 convention).
        window_size: sliding window, converted to bounds exactly like Paddle.
        return_softmax_lse: also return the log-sum-exp [batch, num_heads,
            seq_q] (fp32, +inf for rows that see no key; not differentiable).
        return_seed_offset: also return a [2] int64 zero tensor (no dropout RNG
            is consumed).
        fixed_seed_offset, rng_name, name: accepted for compatibility; unused.
        softmax_scale: defaults to 1/sqrt(head_dim).
        block_mask: optional int [batch, hb, ceil(seq_q/128), ceil(seq_k/128)],
            1 keeps a 128x128 block, 0 masks it (on top of the bounds).

    Returns:
        out [batch, seq_q, num_heads, head_dim] (dtype of query), followed by
        lse and/or seed_offset if requested, as in Paddle.
    """
    return _flashmask_attention_impl(
        query,
        key,
        value,
        startend_row_indices,
        dropout=dropout,
        causal=causal,
        window_size=window_size,
        return_softmax_lse=return_softmax_lse,
        return_seed_offset=return_seed_offset,
        training=training,
        softmax_scale=softmax_scale,
        block_mask=block_mask,
    )


def _flashmask_attention_impl(
    query,
    key,
    value,
    startend_row_indices=None,
    *,
    dropout=0.0,
    causal=False,
    window_size=None,
    return_softmax_lse=False,
    return_seed_offset=False,
    training=True,
    softmax_scale=None,
    block_mask=None,
    block_q=None,
    block_k=None,
):
    """flashmask_attention with tile sizes exposed (tests, benchmarks)."""
    block_q = block_q or BLOCK_SIZE
    block_k = block_k or BLOCK_SIZE
    if dropout and training:
        raise NotImplementedError(
            "paddlenlp_ext.attention.flashmask_attention: dropout > 0 is not implemented on the CPU path; "
            "use dropout=0.0 (or training=False)."
        )
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError("query/key/value must be 4-D [batch, seq, heads, head_dim]")
    batch, seq_q, hq, head_dim = query.shape
    _, seq_k, hk, _ = key.shape
    if list(key.shape) != list(value.shape) or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(
            f"query {query.shape}, key {key.shape}, value {value.shape}: key and value must have the same "
            "shape, and agree with query on batch and head_dim"
        )
    if hq % hk != 0:
        raise ValueError(f"num_heads ({hq}) must be a multiple of k_num_heads ({hk})")

    if window_size is not None:
        assert startend_row_indices is None, "can't use window_size with startend_row_indices"
        startend_row_indices = _window_to_startend(window_size, causal, batch, seq_q)

    sri = startend_row_indices
    if sri is not None:
        if sri.dtype not in (paddle.int32, paddle.int64):
            raise TypeError(f"startend_row_indices must be an integer tensor (int32), got {sri.dtype}")
        if sri.ndim != 4:
            raise ValueError(f"startend_row_indices rank must be 4, but got {sri.shape}")
        if sri.shape[0] != batch:
            raise ValueError(f"startend_row_indices.shape[0] must be batch_size {batch}, got {sri.shape[0]}")
        if sri.shape[2] != seq_k:
            raise ValueError(f"startend_row_indices.shape[2] must be seqlen_k {seq_k}, got {sri.shape[2]}")
        if sri.shape[1] not in (1, hq, hk):
            raise ValueError(
                f"startend_row_indices head_num must be 1 (broadcast), num_heads ({hq}) or k_num_heads ({hk}); "
                f"got {sri.shape[1]}"
            )
        _check_bound_count(sri.shape[-1], causal)
    if block_mask is not None:
        if sri is None:
            raise ValueError("must provide startend_row_indices when using block_mask")
        if block_q != 128 or block_k != 128:
            raise ValueError("block_mask describes 128x128 blocks; it needs block_q = block_k = 128")
        want = [batch, sri.shape[1], (seq_q + 127) // 128, (seq_k + 127) // 128]
        if list(block_mask.shape) != want:
            raise ValueError(f"block_mask shape must be {want}, got {block_mask.shape}")

    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    plan = _build_plan(query, key, sri, causal, scale, block_mask, block_q, block_k)
    out, lse = _FlashMaskFn.apply(query, key, value, plan)

    outputs = [out]
    if return_softmax_lse:
        outputs.append(lse)
    if return_seed_offset:
        outputs.append(paddle.zeros([2], dtype="int64"))
    return outputs[0] if len(outputs) == 1 else outputs
