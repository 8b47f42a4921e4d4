"""Tile schedule of the block-sparse FlashMask kernel.

The score matrix is cut into ``block_q x block_k`` tiles.  Per key block the
host takes min/max of the interval ends (O(seq) work) and classifies every
tile as fully masked (never computed), fully visible (computed without a
mask) or partial (a mask is built for that tile only, from the bounds).  No
``seq x seq`` mask is ever materialized, and a packed row with block-diagonal
causal masks costs ~ sum of squared segment lengths.

The schedule reads host copies of the bounds (``.numpy()``), which is why the
kernel is dynamic-graph only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

from .bounds import intervals

__all__ = ["BLOCK_SIZE", "KV_MERGE", "flashmask_stats"]

# Tile edge (query rows x key columns).  128 matches the FlashMask CUDA kernel
# and the granularity of ``block_mask``.
BLOCK_SIZE = 128
# Adjacent non-skipped key blocks of one query block are fused into a single
# tile of up to KV_MERGE blocks: fewer, larger GEMMs matter more on CPU than
# the few extra masked scores (temporaries stay O(BLOCK_SIZE * KV_MERGE * BLOCK_SIZE)).
KV_MERGE = 4

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


@dataclass
class Tile:
    """Key columns [ks, ke) of one query block, possibly several fused key blocks."""

    ks: int
    ke: int
    partial: bool
    # Per interval (lower, upper): None when it masks no entry of the tile,
    # else which comparisons (row >= start, row < end) the mask needs; the
    # others are known to hold for the whole tile from the block min/max.
    needs: tuple = (None, None)
    # Per-head block-mask drop flags, bool [hm, gm, 1, 1] (only when
    # block_mask varies across heads for this tile).
    bm_drop: object = None


@dataclass
class Plan:
    """Everything the forward and backward need besides q, k, v: shapes, the
    tiles of every (batch row, query block), and device copies of the bounds
    for building partial-tile masks."""

    batch: int
    seq_q: int
    seq_k: int
    hq: int
    hk: int
    group: int
    head_dim: int
    scale: float
    q_ranges: list
    # tiles[b][i] -> list of Tile for query block i of batch row b.
    tiles: list
    # Per batch row: ((lo_s, lo_e), (up_s, up_e)) device int32 tensors [hm, gm, 1, seq_k].
    bounds: list = field(default_factory=list)
    mask_heads: tuple = (1, 1)
    rows: list = field(default_factory=list)  # per query block: [1, 1, bq, 1] int32


@dataclass
class _IntervalBlocks:
    """What the block min/max say about one interval, bool [batch, hb, nqb, nkb]."""

    start_true: np.ndarray  # every column's interval starts at/above the tile top
    end_true: np.ndarray  # every column's interval ends at/below the tile bottom
    disjoint: np.ndarray  # no column's interval reaches into the tile rows

    @property
    def covers(self):
        """The interval masks the whole tile."""
        return self.start_true & self.end_true

    def at(self, b, i):
        """The facts of batch row b, query block i: each [hb, nkb]."""
        return _IntervalBlocks(self.start_true[b, :, i], self.end_true[b, :, i], self.disjoint[b, :, i])


def _blocks(n, size):
    """[(start, end)] edges of consecutive blocks of `size` covering range(n); the last may be short."""
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _classify(interval, starts, qs, qe):
    """Compare one interval's per-key-block min/max with the query block edges.

    interval: (start, end) int64 [batch, hb, seq_k]; starts: first column of
    each key block; qs/qe: query block edges [1, 1, nqb, 1].
    """
    # [batch, hb, nkb] -> [batch, hb, 1, nkb], broadcast against [1, 1, nqb, 1].
    s_min, s_max, e_min, e_max = (
        red.reduceat(a, starts, -1)[:, :, None, :] for a in interval for red in (np.minimum, np.maximum)
    )
    return _IntervalBlocks(start_true=s_max <= qs, end_true=e_min >= qe, disjoint=(s_min >= qe) | (e_max <= qs))


def _mask_heads(hb, hk, group):
    """Head layout of mask tensors so they broadcast onto scores viewed as
    [hk, group, bq, bk]: per-q-head bounds map q head h to (h // group, h % group)."""
    if hb == 1:
        return (1, 1)
    if hb == hk:
        return (hk, 1)
    return (hk, group)


def _key_runs(skip_row, bm_row):
    """Key block indices of one query block, grouped into fused tiles.

    skip_row: bool [nkb]; bm_row: bool [hb, nkb] block_mask (True = keep) or None.
    Runs are cut at skipped blocks, after KV_MERGE blocks, and around blocks the
    block_mask keeps for some heads only, so that one per-head keep/drop term
    describes each such tile.
    """
    runs, run, prev_split = [], [], False
    for j, skip in enumerate(skip_row):
        if skip:
            if run:
                runs.append(run)
            run = []
            continue
        split = bm_row is not None and not bm_row[:, j].all()
        if run and (len(run) >= KV_MERGE or split or prev_split):
            runs.append(run)
            run = []
        run.append(j)
        prev_split = split
    if run:
        runs.append(run)
    return runs


def _make_tile(js, k_ranges, visible, classes, bm_row, mask_heads):
    """Tile of the fused key blocks js; visible: bool [nkb] of its query block,
    classes: per interval, _IntervalBlocks sliced to [hb, nkb]."""
    tile = Tile(k_ranges[js[0]][0], k_ranges[js[-1]][1], partial=not visible[js].all())
    if not tile.partial:
        return tile
    cols = slice(js[0], js[-1] + 1)
    # A comparison is needed if any head/column in the run needs it.
    tile.needs = tuple(
        (bool((~c.start_true[:, cols]).any()), bool((~c.end_true[:, cols]).any()))
        if (~c.disjoint[:, cols]).any()
        else None
        for c in classes
    )
    if bm_row is not None and (~bm_row[:, cols]).any():
        # Runs are split at block-mask changes (_key_runs), so one keep/drop
        # value per head covers the whole run.
        drop = ~bm_row[:, js[0]]  # [hb]
        tile.bm_drop = paddle.to_tensor(drop.reshape(list(mask_heads) + [1, 1]))
    return tile


def build_plan(query, key, sri, causal, scale, block_mask, block_q, block_k):
    """Classify every tile and record the per-tile work; query [batch, seq_q, hq, d],
    key [batch, seq_k, hk, d], sri int [batch, hb, seq_k, nb] or None."""
    batch, seq_q, hq, head_dim = query.shape
    seq_k, hk = key.shape[1], key.shape[2]
    group = hq // hk
    q_ranges, k_ranges = _blocks(seq_q, block_q), _blocks(seq_k, block_k)

    bounds = intervals(None if sri is None else sri.numpy(), causal, batch, seq_q, seq_k)  # 2 x (s, e) [b, hb, sk]
    hb = bounds[0][0].shape[1]
    starts = np.array([r[0] for r in k_ranges])
    qs = np.array([r[0] for r in q_ranges])[None, None, :, None]  # [1, 1, nqb, 1]
    qe = np.array([r[1] for r in q_ranges])[None, None, :, None]
    classes = [_classify(iv, starts, qs, qe) for iv in bounds]  # [batch, hb, nqb, nkb] each
    skip = (classes[0].covers | classes[1].covers).all(1)  # [batch, nqb, nkb]: masked for every head
    visible = (classes[0].disjoint & classes[1].disjoint).all(1)

    bm_np = None
    if block_mask is not None:
        bm_np = block_mask.numpy().astype(bool)  # [batch, hb, nqb, nkb], True = keep
        skip = skip | ~bm_np.any(1)
        visible = visible & ~(bm_np.any(1) & ~bm_np.all(1))  # blocks kept for some heads only are partial

    mask_heads = _mask_heads(hb, hk, group)
    tiles = []  # [batch][query block] -> list of Tile
    for b in range(batch):
        rows_b = []
        for i in range(len(q_ranges)):
            bm_row = None if bm_np is None else bm_np[b, :, i]  # [hb, nkb]
            facts = [c.at(b, i) for c in classes]
            rows_b.append(
                [
                    _make_tile(js, k_ranges, visible[b, i], facts, bm_row, mask_heads)
                    for js in _key_runs(skip[b, i], bm_row)
                ]
            )
        tiles.append(rows_b)
    plan = Plan(batch, seq_q, seq_k, hq, hk, group, head_dim, scale, q_ranges, tiles, mask_heads=mask_heads)
    if any(t.partial for rb in tiles for row in rb for t in row):
        # Only partial tiles build masks: upload the bounds once per batch row,
        # [hb, seq_k] -> [hm, gm, 1, seq_k].
        plan.bounds = [
            tuple(
                tuple(paddle.to_tensor(a[b].astype(np.int32).reshape(list(mask_heads) + [1, seq_k])) for a in iv)
                for iv in bounds
            )
            for b in range(batch)
        ]
        plan.rows = [paddle.arange(q0, q1, dtype="int32").reshape([1, 1, q1 - q0, 1]) for q0, q1 in q_ranges]
    _record_stats(plan, skip, hb, len(k_ranges))
    return plan


def _record_stats(plan, skip, hb, nkb):
    """Fill _LAST_STATS from the finished plan (see flashmask_stats)."""
    n_visible = n_partial = score_elems = peak_mask = peak_score = 0
    for row_tiles in plan.tiles:
        for (q0, q1), tiles in zip(plan.q_ranges, row_tiles):
            for t in tiles:
                elems = plan.hq * (q1 - q0) * (t.ke - t.ks)
                score_elems += elems
                peak_score = max(peak_score, elems * 4)
                if t.partial:
                    n_partial += 1
                    peak_mask = max(peak_mask, plan.mask_heads[0] * plan.mask_heads[1] * (q1 - q0) * (t.ke - t.ks))
                else:
                    n_visible += 1
    per_head_cols = plan.batch * hb * plan.seq_k
    bounds_bytes = 4 * per_head_cols * 8  # host int64 intervals
    bounds_bytes += 12 * plan.batch * hb * nkb * 8  # per-block min/max
    if plan.bounds:
        bounds_bytes += 4 * per_head_cols * 4  # device int32 copies
    _LAST_STATS.clear()
    _LAST_STATS.update(
        tiles_total=plan.batch * len(plan.q_ranges) * nkb,
        tiles_skipped=int(skip.sum()),
        tiles_visible=n_visible,
        tiles_partial=n_partial,
        score_elems=int(score_elems),
        dense_score_elems=int(plan.batch * plan.hq * plan.seq_q * plan.seq_k),
        bounds_bytes=int(bounds_bytes),
        peak_tile_mask_bytes=int(peak_mask),
        peak_tile_score_bytes=int(peak_score),
        dense_mask_bytes=int(plan.batch * hb * plan.seq_q * plan.seq_k),
    )


def tile_mask(plan, b, i, t):
    """Bool "masked" of one partial tile, broadcastable to [hk, group, bq, bk]
    (stored as [hm, gm, bq, bk]), built from the bounds of its columns."""
    masked = None
    if plan.bounds:
        rows = plan.rows[i]  # [1, 1, bq, 1]
        for need, (start, end) in zip(t.needs, plan.bounds[b]):
            if need is None:
                continue
            term = _interval_term(rows, need, start[..., t.ks : t.ke], end[..., t.ks : t.ke])  # [hm, gm, bq, bk]
            masked = term if masked is None else masked | term
    if t.bm_drop is not None:
        masked = t.bm_drop if masked is None else masked | t.bm_drop
    return masked


def _interval_term(rows, need, start, end):
    """rows in [start, end), with only the comparisons the tile needs.
    rows [1, 1, bq, 1]; start/end [hm, gm, 1, bk]."""
    need_s, need_e = need
    term = None
    if need_s:
        term = rows >= start
    if need_e:
        term = (rows < end) if term is None else term & (rows < end)
    if term is None:  # both comparisons trivially true for every column
        term = paddle.ones([1, 1, rows.shape[2], start.shape[-1]], dtype="bool")
    return term
