"""The decoder's attention core: the mask forms the toolkit feeds, sliding windows, soft-capping, GQA.

Masks arrive in three forms (``MaskPlan.build``):

* a padding mask ``attention_mask`` [B, Lk] (1 = real token; generation), combined with causality;
* a dense [B, 1, Lq, Lk] mask: bool or integer (non-zero = may attend, PaddleNLP's reading) or float
  (additive when it holds negative values: 0 = attend; otherwise non-zero = attend), used as given;
* FlashMask start rows ``attn_mask_startend_row_indices`` [B, 1, L] / [B, L] / [B, 1, L, 1] (packed
  documents; ``position_ids`` restart per document).

A layer without window or soft-cap given start rows calls FlashMask (``integrations.flashmask.
flashmask_dispatch``: Paddle's kernel on a GPU/XPU in fp16/bf16, else ``kernels.flashmask_attention``,
the CPU block-sparse one).  Every other case takes the
dense path: the start rows become a dense bool mask (``kernels.dense_mask_from_startend``), and a
sliding window ``w`` keeps key j for query i only when ``i - j < w`` (absolute indices in the row,
transformers' ``kv_idx > q_idx - window``).  Packed rows (start rows or a dense 4-D mask, no cache) measure
the distance in ``position_ids`` instead: within a packed document that is the same distance, and in a
preference pair row (prompt, chosen, rejected; the rejected answer's positions restart at len(prompt)) it is
the distance the rejected answer has to its prompt when run alone.
"""

from __future__ import annotations

from typing import Dict, Optional

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from ...integrations.flashmask import flashmask_dispatch
from ...kernels import dense_mask_from_startend
from ...kernels.causal import causal_attention

__all__ = ["MaskPlan", "attend"]


def _startend_4d(sri):
    """[B, L] / [B, 1, L] / [B, 1, L, 1] -> [B, 1, L, 1] int32 (FlashMask's causal LTS form)."""
    if sri.ndim == 2:
        sri = sri.unsqueeze(1)
    if sri.ndim == 3:
        sri = sri.unsqueeze(-1)
    return sri.astype("int32")


class MaskPlan:
    """The masks of one forward: built once, shared by every layer (one dense mask per distinct window)."""

    def __init__(self, batch: int, q_len: int, past_len: int, attention_mask=None, startend=None, position_ids=None):
        self.batch, self.q_len, self.past_len = batch, q_len, past_len
        packed = startend is not None or (attention_mask is not None and attention_mask.ndim == 4)
        # [B, L] positions that measure window distances in packed rows (see the module docstring), else None
        self.positions = position_ids if packed and past_len == 0 and position_ids is not None else None
        self.k_len = past_len + q_len
        self.startend = _startend_4d(startend) if startend is not None else None
        self._allowed = None  # bool [B | 1, 1, Lq, Lk]
        self._additive: Dict[Optional[int], paddle.Tensor] = {}
        self._mask_in = attention_mask
        self._plain: Optional[bool] = None  # plain_causal(), once computed
        self.sp_pad = 0  # sequence parallel: zero token rows appended so the tokens divide over the ranks
        # True when the layers are recomputed in the backward (recompute=true): plain autograd only, since
        # Paddle's non-reentrant recompute gives wrong gradients through the memory-saving PyLayers below
        # (_RecomputedProbsAttention, layers._Rotary); there the layers keep no activations anyway
        self.autograd_only = False

    def allowed(self) -> paddle.Tensor:
        """Bool [B | 1, 1, Lq, Lk], True where query i may attend key j (before windows)."""
        if self._allowed is not None:
            return self._allowed
        m = self._mask_in
        q_idx = paddle.arange(self.past_len, self.k_len, dtype="int64").reshape([1, 1, -1, 1])  # [1,1,Lq,1]
        k_idx = paddle.arange(0, self.k_len, dtype="int64").reshape([1, 1, 1, -1])  # [1,1,1,Lk]
        causal = k_idx <= q_idx  # [1, 1, Lq, Lk]
        if self.startend is not None:
            allowed = dense_mask_from_startend(self.startend, self.q_len, True)  # [B, 1, Lq, Lk] bool
        elif m is None:
            allowed = causal
        elif m.ndim == 2:  # padding mask over all keys (past + current)
            allowed = causal & (m.astype("bool").reshape([m.shape[0], 1, 1, -1]))  # [B, 1, Lq, Lk]
        elif m.ndim == 4:
            m = m[:, :, -self.q_len :, -self.k_len :]
            if m.dtype == paddle.bool:
                allowed = m
            elif m.is_floating_point() and bool((m < 0).any()):
                allowed = m > -1.0  # additive: 0 attend, a large negative number masks
            else:
                allowed = m != 0
        else:
            raise ValueError(f"attention_mask of rank {m.ndim}: expected [B, L] or [B, 1, Lq, Lk]")
        self._allowed = allowed
        return allowed

    def plain_causal(self) -> bool:
        """True when every query sees exactly the keys at or before it: no cache, no start rows, and no mask
        or a padding mask without padding (checked once per forward)."""
        if self._plain is None:
            m = self._mask_in
            self._plain = (
                self.past_len == 0
                and self.startend is None
                and (m is None or (m.ndim == 2 and bool(m.astype("bool").all())))
            )
        return self._plain

    def additive(self, window: Optional[int], dtype=paddle.float32) -> paddle.Tensor:
        """Float [B | 1, 1, Lq, Lk]: 0 where allowed (within ``window``), the dtype's minimum elsewhere."""
        if window not in self._additive:
            allowed = self.allowed()
            if window is not None and self.positions is not None:
                pos = self.positions.astype("int64")  # [B, L]
                allowed = allowed & (pos.unsqueeze([1, 3]) - pos.unsqueeze([1, 2]) < window)  # [B, 1, L, L]
            elif window is not None:
                q_idx = paddle.arange(self.past_len, self.k_len, dtype="int64").reshape([1, 1, -1, 1])
                k_idx = paddle.arange(0, self.k_len, dtype="int64").reshape([1, 1, 1, -1])
                allowed = allowed & (q_idx - k_idx < window)  # [B | 1, 1, Lq, Lk]
            zero = paddle.zeros([], dtype=dtype)
            low = paddle.full([], paddle.finfo(dtype).min, dtype=dtype)
            self._additive[window] = paddle.where(allowed, zero, low)
        return self._additive[window]


def _repeat_kv(x, rep: int):
    """[B, L, Hkv, D] -> [B, L, Hkv * rep, D]; query head h reads kv head h // rep."""
    if rep == 1:
        return x
    b, s, h, d = x.shape
    return x.unsqueeze(3).expand([b, s, h, rep, d]).reshape([b, s, h * rep, d])


#: training attention whose [B, H, Lq, Lk] probabilities hold at most this many numbers (8 MiB in fp32) keeps
#: them for the backward (plain autograd): 192 tokens x 16 heads is 2.4 MB per layer, and recomputing them (the
#: two paths below) costs more time than that memory is worth (about 1.5x the attention; docs/benchmarks.md)
KEEP_PROBS_UP_TO = 2**21


def attend(
    q,
    k,
    v,
    plan: MaskPlan,
    scale: float,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks=None,
    dropout: float = 0.0,
):
    """Attention output [B, Lq, H * D] of q [B, Lq, H, D] over k, v [B, Lk, Hkv, D].

    ``sinks`` [H] (gpt-oss): one learned logit per head joins each query's softmax as an extra key with no
    value, so the real keys' weights sum to less than 1; such layers take the dense path (start rows become
    the dense mask), which applies them under every mask form.  ``dropout`` (training only; the config's
    ``attention_dropout``, as transformers and PaddleNLP's eager attention): dropout on the probabilities, on
    the dense autograd path."""
    b, lq, h, d = q.shape
    plain = softcap is None and sinks is None and not dropout
    if plan.startend is not None and window is None and plain and plan.past_len == 0:
        # FlashMask start rows, nothing else to apply: the block-sparse kernel (GQA inside)
        out = flashmask_dispatch(q, k, v, plan.startend, causal=True, softmax_scale=scale)  # [B, Lq, H, D]
        return out.reshape([b, lq, h * d])
    rep = h // k.shape[2]
    qt = q.transpose([0, 2, 1, 3])  # [B, H, Lq, D]
    kt = _repeat_kv(k, rep).transpose([0, 2, 1, 3])  # [B, H, Lk, D]
    vt = _repeat_kv(v, rep).transpose([0, 2, 1, 3])  # [B, H, Lk, D]
    if (
        plain
        and q.dtype == paddle.float32
        and not plan.autograd_only
        and not (q.stop_gradient and k.stop_gradient and v.stop_gradient)
        and b * h * lq * kt.shape[2] > KEEP_PROBS_UP_TO
    ):
        # training in fp32: keep q/k/v, not the [B, H, Lq, Lk] probabilities, for the backward
        if window is None and plan.plain_causal():
            # nothing masked but the future: query chunks over their keys only (kernels.causal; skips the
            # upper triangle's products, about half of the two attention matmuls)
            out = causal_attention(qt, kt, vt, scale)  # [B, H, Lq, D]
        else:
            out = _RecomputedProbsAttention.apply(qt, kt, vt, plan.additive(window), scale)  # [B, H, Lq, D]
        return out.transpose([0, 2, 1, 3]).reshape([b, lq, h * d])
    scores = paddle.matmul(qt, kt, transpose_y=True) * scale  # [B, H, Lq, Lk]
    if softcap is not None:
        scores = paddle.tanh(scores / softcap) * softcap
    # the mask [B | 1, 1, Lq, Lk] expanded over the heads first: the same sums, and Paddle's CPU add is ~2x
    # slower when an operand broadcasts
    scores = scores.astype("float32")
    scores = scores + plan.additive(window).expand(scores.shape)
    if sinks is not None:
        sink = sinks.astype("float32").reshape([1, h, 1, 1]).expand([scores.shape[0], h, lq, 1])  # [B, H, Lq, 1]
        probs = F.softmax(paddle.concat([scores, sink], axis=-1), axis=-1)[..., :-1].astype(q.dtype)  # [B, H, Lq, Lk]
    else:
        probs = F.softmax(scores, axis=-1).astype(q.dtype)  # [B, H, Lq, Lk]
    if dropout:
        probs = F.dropout(probs, p=dropout, training=True)
    out = paddle.matmul(probs, vt).transpose([0, 2, 1, 3])  # [B, Lq, H, D]
    return out.reshape([b, lq, h * d])


def _probs(qt, kt, additive, scale: float):
    """softmax(q k^T * scale + mask) [B, H, Lq, Lk] in float32, by the same ops as :func:`attend`'s dense
    path (so the backward's recomputation is bitwise the forward's)."""
    scores = paddle.matmul(qt, kt, transpose_y=True) * scale  # [B, H, Lq, Lk]
    return F.softmax(scores + additive.expand(scores.shape), axis=-1)  # mask [B | 1, 1, Lq, Lk] over the heads


class _RecomputedProbsAttention(PyLayer):
    """softmax(q k^T * scale + mask) v for fp32 training, saving q, k, v instead of the probabilities.

    Autograd through the dense path keeps the [B, H, Lq, Lk] probabilities of every layer until the
    backward (13.9 MB per layer at 16 heads and 466 tokens, quadratic in the length); here the backward
    recomputes them (one q k^T and softmax per layer, ~1% of a layer's matmul work at that length) and
    applies softmax's gradient by hand: dS = P * (dP - sum(dP * P)).  The forward is bitwise the dense
    path's; the gradients agree with autograd's within float rounding (~1e-7 relative).  qt [B, H, Lq, D], kt / vt [B, H, Lk, D] (kv heads already repeated), additive
    [B | 1, 1, Lq, Lk] (no gradient) -> [B, H, Lq, D].
    """

    @staticmethod
    def forward(ctx, qt, kt, vt, additive, scale):
        ctx.scale = scale
        ctx.additive = additive  # not saved as an input: it never takes a gradient
        ctx.needs_grad = tuple(not t.stop_gradient for t in (qt, kt, vt))
        ctx.save_for_backward(qt, kt, vt)
        return paddle.matmul(_probs(qt, kt, additive, scale), vt)  # [B, H, Lq, D]

    @staticmethod
    def backward(ctx, dout):
        qt, kt, vt = ctx.saved_tensor()
        probs = _probs(qt, kt, ctx.additive, ctx.scale)  # [B, H, Lq, Lk], bitwise the forward's
        dv = paddle.matmul(probs, dout, transpose_x=True)  # [B, H, Lk, D]
        dp = paddle.matmul(dout, vt, transpose_y=True)  # [B, H, Lq, Lk]
        # softmax's gradient by hand (no paddle.grad here: a nested grad breaks under the layers' recompute)
        ds = probs * (dp - (dp * probs).sum(axis=-1, keepdim=True))  # [B, H, Lq, Lk]
        dq = paddle.matmul(ds, kt) * ctx.scale  # [B, H, Lq, D]
        dk = paddle.matmul(ds, qt, transpose_x=True) * ctx.scale  # [B, H, Lk, D]
        # PyLayer wants None for an input that takes no gradient (the mask never does)
        return tuple(g if need else None for need, g in zip(ctx.needs_grad, (dq, dk, dv))) + (None,)
