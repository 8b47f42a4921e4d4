"""Causal attention that keeps O(seq) memory for the backward, on CPU (the unpacked, unpadded case).

Dense attention keeps the softmax probabilities ``[b, heads, s, s]`` of every layer until the
backward: at 700 tokens x 16 heads that is 31 MB per layer, 0.5 GB for a 16-layer model, more than
all other activations of a LoRA step together.  :class:`CausalAttention` computes the same
``softmax(q k^T * scale + causal) v`` in chunks of query rows and keeps only q * scale, k and v;
the backward recomputes each chunk's probabilities (FlashAttention's scheme, with
Paddle's softmax kernel)::

    p     = softmax(q_c k^T * scale + causal)               [b, h, c, n]   (n = last row of the chunk + 1)
    dv   += p^T do_c                     dp = do_c v^T
    ds    = p * (dp - rowsum(p * dp))
    dq_c  = ds k * scale                 dk += ds^T (q_c * scale)

Chunk c only reads keys ``[0, n)``: the causal upper triangle beyond the chunk is never computed.
The extra cost is one q k^T and one softmax per layer in the backward.  Results equal the dense masked softmax within fp32 rounding (``tests/test_causal.py``:
<= 1e-5 relative, outputs and gradients).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

__all__ = ["CausalAttention", "causal_attention", "DEFAULT_CHUNK"]

#: query rows per chunk: bounds the transient scores at [b, heads, chunk, seq]
DEFAULT_CHUNK = 256


_BIAS_CACHE: dict = {}


def _bias(lo: int, hi: int, dtype) -> paddle.Tensor:
    """[hi - lo, hi] additive causal mask of query rows lo..hi-1 over keys 0..hi-1: 0 where key <= row.
    Cached: every layer of a forward asks for the same ones."""
    key = (lo, hi, str(dtype))
    bias = _BIAS_CACHE.get(key)
    if bias is None:
        if len(_BIAS_CACHE) > 64:  # lengths change from batch to batch: keep the cache small
            _BIAS_CACHE.clear()
        full = paddle.full([hi - lo, hi], paddle.finfo(dtype).min, dtype=dtype)
        bias = _BIAS_CACHE[key] = paddle.triu(full, diagonal=lo + 1)  # keeps j >= lo + i + 1: the future keys
    return bias


def _rows(x, lo: int, hi: int):
    """x[:, :, lo:hi] without a copy when that is all of x."""
    return x if lo == 0 and hi == x.shape[2] else x[:, :, lo:hi]


def _chunks(s: int, chunk: int):
    for lo in range(0, s, chunk):
        yield lo, min(lo + chunk, s)


def _probabilities(q_scaled, k, lo: int, hi: int) -> paddle.Tensor:
    """softmax(q_c k^T * scale + causal) of query rows lo..hi-1 over keys 0..hi-1: [b, h, c, hi].  The mask is
    expanded before the add: Paddle's CPU add is ~2x slower when one operand broadcasts."""
    scores = paddle.matmul(_rows(q_scaled, lo, hi), _rows(k, 0, hi), transpose_y=True)  # [b, h, c, hi]
    return F.softmax(scores + _bias(lo, hi, scores.dtype).expand(scores.shape), axis=-1)


class CausalAttention(PyLayer):
    """``softmax(q k^T * scale + causal) v`` for q, k, v [b, heads, s, d] -> [b, heads, s, d] (see the module)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, chunk: int):
        q_scaled = q * scale  # [b, h, s, d]: scaling q costs s*d, scaling the scores s*s
        outs = [
            paddle.matmul(_probabilities(q_scaled, k, lo, hi), _rows(v, 0, hi))  # [b, h, c, d]
            for lo, hi in _chunks(q.shape[2], chunk)
        ]
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=2)  # [b, h, s, d]
        ctx.save_for_backward(q_scaled, k, v)  # not out: the backward gets rowsum(p * dp) from p and dp
        ctx.scale, ctx.chunk = scale, chunk
        ctx.needs_grad = tuple(not t.stop_gradient for t in (q, k, v))
        return out

    @staticmethod
    def backward(ctx, dout):
        q_scaled, k, v = ctx.saved_tensor()
        s = q_scaled.shape[2]
        dq_parts, dk, dv = [], None, None
        for lo, hi in _chunks(s, ctx.chunk):
            do_c, k_n, v_n = _rows(dout, lo, hi), _rows(k, 0, hi), _rows(v, 0, hi)
            p = _probabilities(q_scaled, k, lo, hi)  # [b, h, c, hi]: the forward's probabilities, recomputed
            dp = paddle.matmul(do_c, v_n, transpose_y=True)  # [b, h, c, hi]
            delta = (p * dp).sum(-1, keepdim=True)  # [b, h, c, 1]: whole rows (keys past hi have p = 0)
            ds = p * (dp - delta.expand(dp.shape))  # [b, h, c, hi]: gradient of the scaled scores
            dq_parts.append(paddle.matmul(ds, k_n) * ctx.scale)  # [b, h, c, d]
            dk_n = paddle.matmul(ds, _rows(q_scaled, lo, hi), transpose_x=True)  # [b, h, hi, d]
            dv_n = paddle.matmul(p, do_c, transpose_x=True)  # [b, h, hi, d]
            if hi < s:  # keys [0, hi) only: pad the rows hi..s-1 with zeros
                dk_n, dv_n = F.pad(dk_n, [0, 0, 0, s - hi]), F.pad(dv_n, [0, 0, 0, s - hi])
            dk = dk_n if dk is None else dk + dk_n  # [b, h, s, d]
            dv = dv_n if dv is None else dv + dv_n
        dq = dq_parts[0] if len(dq_parts) == 1 else paddle.concat(dq_parts, axis=2)
        # PyLayer wants None for an input that takes no gradient (a frozen projection's output)
        return tuple(g if need else None for need, g in zip(ctx.needs_grad, (dq, dk, dv)))


def causal_attention(q, k, v, scale: float, chunk: int = DEFAULT_CHUNK) -> paddle.Tensor:
    """Causal attention of q, k, v [b, heads, s, d] (same heads) with O(s) saved memory -> [b, heads, s, d]."""
    return CausalAttention.apply(q, k, v, float(scale), int(chunk))
