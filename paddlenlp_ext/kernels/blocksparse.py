"""Block-sparse FlashAttention-2 forward and backward over a tile schedule.

The forward is a FlashAttention-2 style loop with an online softmax (running
max + log-sum-exp) across the key tiles of each query block; the backward is
hand written in a ``PyLayer`` and recomputes tile probabilities from the
saved log-sum-exp, so only q, k, v, out and lse are kept for backward.

Query rows that see no key produce 0 (and 0 gradient): their lse is +inf, as
in FlashAttention-2, which makes every recomputed probability exactly 0.

GQA: q-side operands are laid out as [hk, group * bq, d] (the query group
folded into the rows), so k/v are never repeated and the k/v-side matmuls sum
over the group.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from .schedule import tile_mask

_NEG_INF = float("-inf")
_INF = float("inf")


# --------------------------------------------------------------------------
# Layout helpers
# --------------------------------------------------------------------------
def _split_q(x4, plan):
    """[hk, group, seq_q, X] -> list over query blocks of [hk, group*bq, X]."""
    sizes = [e - s for s, e in plan.q_ranges]
    return [blk.reshape([plan.hk, plan.group * sz, -1]) for blk, sz in zip(paddle.split(x4, sizes, axis=2), sizes)]


def _q_blocks(xb, plan):
    """One batch row [seq_q, hq, d] -> list of [hk, group*bq, d] (query blocks)."""
    return _split_q(xb.transpose([1, 0, 2]).reshape([plan.hk, plan.group, plan.seq_q, -1]), plan)


def _lse_blocks(lse, plan, b):
    """[batch, hq, seq_q] -> list of [hk, group*bq, 1] for batch row b."""
    return _split_q(lse[b].reshape([plan.hk, plan.group, plan.seq_q, 1]), plan)


def _q_merge(blocks, plan):
    """Inverse of _q_blocks: list of [hk, group*bq, d] -> [seq_q, hq, d]."""
    parts = [blk.reshape([plan.hk, plan.group, e - s, -1]) for blk, (s, e) in zip(blocks, plan.q_ranges)]
    xb = paddle.concat(parts, axis=2).reshape([plan.hq, plan.seq_q, -1])  # [hq, sq, d]
    return xb.transpose([1, 0, 2])


def _row_operands(q, k, v, plan, b):
    """Batch row b: scaled query blocks (list of [hk, g*bq, d]; the scale is
    folded into q once) and contiguous k, v [hk, sk, d]."""
    # Contiguous: Paddle's CPU matmul takes a very slow strided path for
    # non-contiguous operands (~50x on [8, 512, 64]).
    kb, vb = (x[b].transpose([1, 0, 2]).contiguous() for x in (k, v))
    return _q_blocks(q[b] * plan.scale, plan), kb, vb


def _cols(x, t):
    """Key range of a tile, [hk, bk, d] (contiguous, see _row_operands)."""
    return x[:, t.ks : t.ke].contiguous()


def _masked_fill(x, masked, value, plan):
    """masked_fill on a tile tensor [hk, group*bq, bk] with a mask that
    broadcasts over its [hk, group, bq, bk] view."""
    if masked is None:
        return x
    shape = x.shape
    x4 = x.reshape([plan.hk, plan.group, shape[1] // plan.group, shape[2]])
    return paddle.masked_fill(x4, masked, value).reshape(shape)


def _tile_scores(qi, kt, plan, b, i, t):
    """Scores [hk, g*bq, bk] of tile t of query block i, and its "masked"
    (None for unmasked tiles)."""
    s = paddle.matmul(qi, kt, transpose_y=True)  # [hk, g*bq, bk]
    return s, (tile_mask(plan, b, i, t) if t.partial else None)


def _probs(s, shift, masked, plan):
    """exp(s - shift) with masked entries exactly 0.  Paddle's CPU exp() maps
    -inf to ~3e-39, a denormal that makes the following matmul ~50x slower and
    leaks into empty rows, so masked probabilities are zeroed explicitly."""
    return _masked_fill(paddle.exp(s - shift), masked, 0.0, plan)


# --------------------------------------------------------------------------
# Forward / backward
# --------------------------------------------------------------------------
def _forward_block(qi, kb, vb, plan, b, i):
    """Online softmax over the tiles of query block i.
    qi [hk, g*bq, d] -> out [hk, g*bq, d], lse [hk, g*bq, 1]."""
    rows = qi.shape[1]
    m = l = acc = None  # running max, sum of exp and P V, [hk, g*bq, 1|1|d]
    for t in plan.tiles[b][i]:
        s, masked = _tile_scores(qi, _cols(kb, t), plan, b, i, t)
        s = _masked_fill(s, masked, _NEG_INF, plan)
        m_blk = s.max(-1, keepdim=True)  # [hk, g*bq, 1]
        m_new = m_blk if m is None else paddle.maximum(m, m_blk)
        if t.partial:
            # Rows without any visible key so far have max -inf; shift by 0
            # instead so exp() yields 0, not NaN.  Unmasked tiles give every
            # row a finite max, so they skip this.
            m_safe = paddle.where(paddle.isinf(m_new), paddle.zeros_like(m_new), m_new)
        else:
            m_safe = m_new
        p = _probs(s, m_safe, masked, plan)  # [hk, g*bq, bk]
        pv = paddle.matmul(p, _cols(vb, t))  # [hk, g*bq, d]
        if m is None:
            l, acc = p.sum(-1, keepdim=True), pv
        else:
            alpha = paddle.exp(m - m_safe)  # rescale earlier tiles to the new max
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + pv
        m = m_new
    if m is None:  # every key block skipped: the rows see nothing
        return (
            paddle.zeros([plan.hk, rows, plan.head_dim], dtype=qi.dtype),
            paddle.full([plan.hk, rows, 1], _INF, dtype=qi.dtype),
        )
    # Rows that never saw a key keep max -inf (and l == 0).
    empty = paddle.isinf(m)  # [hk, g*bq, 1]
    l_safe = paddle.where(empty, paddle.ones_like(l), l)
    out = paddle.where(empty, paddle.zeros_like(acc), acc / l_safe)
    # FlashAttention-2 convention: lse = +inf for rows with no visible key.
    lse = paddle.where(empty, paddle.zeros_like(m), m) + paddle.log(l_safe)
    return out, paddle.where(empty, paddle.full_like(lse, _INF), lse)


def attention_forward(q, k, v, plan):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (fp32) -> out [B, Sq, Hq, D], lse [B, Hq, Sq]."""
    outs, lses = [], []
    for b in range(plan.batch):
        qb, kb, vb = _row_operands(q, k, v, plan, b)
        o_blocks, l_blocks = zip(*(_forward_block(qi, kb, vb, plan, b, i) for i, qi in enumerate(qb)))
        outs.append(_q_merge(o_blocks, plan))  # [sq, hq, d]
        lses.append(_q_merge(l_blocks, plan)[:, :, 0].transpose([1, 0]))  # [hq, sq]
    return paddle.stack(outs), paddle.stack(lses)


def attention_backward(q, k, v, out, lse, dout, plan):
    """FlashAttention-2 backward: recompute P per tile from lse.

    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
    dQ = dS K * scale, dK = dS^T (Q * scale).
    """
    dqs, dks, dvs = [], [], []
    for b in range(plan.batch):
        qb, kb, vb = _row_operands(q, k, v, plan, b)  # q blocks [hk, g*bq, d]; k, v [hk, sk, d]
        dob, ob, lb = _q_blocks(dout[b], plan), _q_blocks(out[b], plan), _lse_blocks(lse, plan, b)
        dk, dv = paddle.zeros_like(kb), paddle.zeros_like(vb)
        dq_blocks = []
        for i, (qi, doi) in enumerate(zip(qb, dob)):
            dqi = paddle.zeros_like(qi)
            tiles = plan.tiles[b][i]
            if tiles:
                delta = (doi * ob[i]).sum(-1, keepdim=True)  # [hk, g*bq, 1]
            for t in tiles:
                kt, vt = _cols(kb, t), _cols(vb, t)  # [hk, bk, d]
                # No -inf fill needed here: masked probabilities are zeroed
                # after exp.  Rows without any visible key (lse = +inf) only
                # occur in partial tiles, where all their entries are masked.
                s, masked = _tile_scores(qi, kt, plan, b, i, t)
                p = _probs(s, lb[i], masked, plan)  # [hk, g*bq, bk]
                dv[:, t.ks : t.ke] += paddle.matmul(p, doi, transpose_x=True)  # [hk, bk, d]
                dp = paddle.matmul(doi, vt, transpose_y=True)  # [hk, g*bq, bk]
                ds = p * (dp - delta)
                dqi = dqi + paddle.matmul(ds, kt)  # [hk, g*bq, d]
                dk[:, t.ks : t.ke] += paddle.matmul(ds, qi, transpose_x=True)  # [hk, bk, d]
            dq_blocks.append(dqi * plan.scale)
        dqs.append(_q_merge(dq_blocks, plan))  # [sq, hq, d]
        dks.append(dk.transpose([1, 0, 2]))  # [sk, hk, d]
        dvs.append(dv.transpose([1, 0, 2]))
    return paddle.stack(dqs), paddle.stack(dks), paddle.stack(dvs)


def _as(x, dtype):
    """x cast to dtype (no copy when it already has it)."""
    return x if x.dtype == dtype else x.astype(dtype)


class FlashMaskFn(PyLayer):
    """(query, key, value, plan) -> (out [B, Sq, Hq, D] in query's dtype, lse [B, Hq, Sq] fp32)."""

    @staticmethod
    def forward(ctx, query, key, value, plan):
        # fp16/bf16 inputs: accumulate in fp32 (CPU kernels for half matmul are
        # slow or missing, and the online softmax needs the range).
        q, k, v = (_as(x, paddle.float32) for x in (query, key, value))
        out, lse = attention_forward(q, k, v, plan)
        ctx.plan = plan
        ctx.dtypes = (query.dtype, key.dtype, value.dtype)
        # PyLayer wants None for an input that needs no gradient (e.g. a frozen model's query
        # next to trained prefix keys/values)
        ctx.needs_grad = tuple(not x.stop_gradient for x in (query, key, value))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return _as(out, query.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensor()
        grads = attention_backward(q, k, v, out, lse, _as(dout, paddle.float32), ctx.plan)
        return tuple(_as(g, dt) if need else None for g, dt, need in zip(grads, ctx.dtypes, ctx.needs_grad))
