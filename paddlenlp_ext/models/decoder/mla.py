"""DeepSeek's multi-head latent attention (MLA) for the deepseek_v2 / deepseek_v3 rows of the decoder.

transformers 4.55's ``DeepseekV2Attention`` / ``DeepseekV3Attention`` are the reference.  Per token x [H]:

    q = q_b_proj(norm(q_a_proj(x)))          (or q_proj(x) when q_lora_rank is None: V2-Lite)   [heads, nope + rope]
    c, k_rope = split(kv_a_proj_with_mqa(x), [kv_lora_rank, rope])                             [kv_lora_rank], [rope]
    k_nope, v = split(kv_b_proj(norm(c)), [nope, v])                                            [heads, nope], [heads, v]
    q = [q_nope, RoPE(q_rope)],  k = [k_nope, RoPE(k_rope) shared by every head]

then softmax attention with scale ``(nope + rope) ** -0.5`` (V3: times yarn's mscale squared, ``rows._mla``)
and ``o_proj`` over the heads' values.  The two norms are RMSNorms with eps 1e-6 (transformers builds them
without ``rms_norm_eps``).

RoPE of the rope slice: V2 multiplies interleaved pairs (x0 + i x1) by e^{i theta}; V3 with
``rope_interleave`` de-interleaves the slice ([x0, x2, ..., x1, x3, ...]) and rotates halves.  Both equal
rotating interleaved pairs; here the slice is de-interleaved (one gather) and rotated by halves with the
decoder's ordinary tables, for q and k alike, so every q . k product is transformers' exactly (the cached
keys hold the de-interleaved order, which nothing outside this layer reads).

Tensor parallel (``tp``, N ranks): each rank computes heads / N heads -- ``q_proj`` / ``q_b_proj`` and
``kv_b_proj`` column-parallel over the heads (each head's output columns are contiguous), ``o_proj``
row-parallel -- while the latent path (``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``) is replicated: every rank computes it for every token, the column layers' ``identity`` sums
the ranks' partial gradients of their inputs, and the rope key shared by every head goes through ``identity``
too.  Under sequence parallelism the layer first gathers every rank's tokens (a flat all-gather whose backward
keeps this rank's rows of its own, complete, gradient) and ``o_proj`` reduce-scatters them back.

Masks, windows and FlashMask are the decoder's (:func:`.attention.attend`).  Its kernels take one head width
for q, k and v; when ``v_head_dim`` differs from ``nope + rope`` the narrower side is zero-padded to the wider
and the output cut back to ``v_head_dim`` (transformers pads v for flash attention): zero channels change no
score and no output.
"""

from __future__ import annotations

import paddle
from paddle import nn

from .attention import MaskPlan, attend
from .layers import Norm, apply_rotary
from .rows import Knobs

__all__ = ["LatentAttention", "deinterleave"]

#: transformers builds q_a_layernorm / kv_a_layernorm with DeepseekV3RMSNorm's default eps
_LATENT_NORM_EPS = 1e-6


def deinterleave(x):
    """[..., D] -> [..., D]: the even channels, then the odd ones.

    >>> deinterleave(paddle.to_tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])).tolist()
    [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    """
    return paddle.concat([x[..., 0::2], x[..., 1::2]], axis=-1)


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias_attr=None if bias else False)


class LatentAttention(nn.Layer):
    """MLA with transformers' sublayer names (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``); biases on q_a / kv_a / o with
    ``attention_bias`` (``Knobs.qkv_bias`` / ``o_bias``), as transformers."""

    def __init__(self, k: Knobs, layer_idx: int, tp=None):
        super().__init__()
        m = k.mla
        self.k, self.m, self.idx, self.tp = k, m, layer_idx, tp
        n = 1 if tp is None else tp.degree
        if k.heads % n:
            raise ValueError(f"num_attention_heads={k.heads} must be a multiple of tensor_parallel_degree={n}")
        self.heads = k.heads // n  # this rank's
        self.qk_dim = m.nope + m.rope
        q_out = k.heads * self.qk_dim
        # the head-split projections see every token (gathered under sequence parallelism): plain column layers
        column = _linear if tp is None else type(tp)(tp.group, False).column
        if m.q_lora_rank is None:
            self.q_proj = column(k.hidden, q_out, False)
        else:
            self.q_a_proj = _linear(k.hidden, m.q_lora_rank, k.qkv_bias)
            self.q_a_layernorm = Norm(m.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = column(m.q_lora_rank, q_out, False)
        self.kv_a_proj_with_mqa = _linear(k.hidden, m.kv_lora_rank + m.rope, k.qkv_bias)
        self.kv_a_layernorm = Norm(m.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = column(m.kv_lora_rank, k.heads * (m.nope + m.v), False)
        self.o_proj = (_linear if tp is None else tp.row)(k.heads * m.v, k.hidden, k.o_bias)
        self.window = k.windows[layer_idx]

    def _rope(self, x, rope):
        """RoPE on the rope slice x [B, L, h, rope] (see the module docstring)."""
        if self.m.interleave:
            x = deinterleave(x)
        cos, sin = rope
        return apply_rotary(x, cos, sin, False)

    def forward(self, x, rope, plan: MaskPlan, past=None, use_cache: bool = False):
        """x [B, L, hidden]; rope (cos, sin) [B, L, 1, rope]; past (k [B, Lp, heads, nope + rope],
        v [B, Lp, heads, v]) -> (out [B, L, hidden], cache or None)."""
        k, m, tp = self.k, self.m, self.tp
        b, s = plan.batch, plan.q_len
        pad = getattr(plan, "sp_pad", 0)
        if tp is not None and tp.sequence_parallel:  # every rank's tokens [B * L + pad, hidden] -> [B, L, hidden]
            full = tp.comm.all_gather(x.reshape([1, -1])).reshape([-1, x.shape[-1]])
            x = full[: b * s].reshape([b, s, -1])
        h = self.heads
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape([b, s, h, self.qk_dim])  # [B, L, h, nope + rope]
        q_nope, q_rope = paddle.split(q, [m.nope, m.rope], axis=-1)
        latent, k_rope = paddle.split(self.kv_a_proj_with_mqa(x), [m.kv_lora_rank, m.rope], axis=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).reshape([b, s, h, m.nope + m.v])
        k_nope, val = paddle.split(kv, [m.nope, m.v], axis=-1)  # [B, L, h, nope], [B, L, h, v]
        k_rope = k_rope.reshape([b, s, 1, m.rope])  # one rope key for every head
        if tp is not None:  # replicated, used by this rank's heads only: the ranks' partial gradients are summed
            k_rope = tp.comm.identity(k_rope)
        if rope is not None:
            q_rope, k_rope = self._rope(q_rope, rope), self._rope(k_rope, rope)
        q = paddle.concat([q_nope, q_rope], axis=-1)  # [B, L, h, nope + rope]
        key = paddle.concat([k_nope, k_rope.expand([b, s, h, m.rope])], axis=-1)  # [B, L, h, nope + rope]
        if past is not None:
            key = paddle.concat([past[0], key], axis=1)  # [B, Lp + L, h, nope + rope]
            val = paddle.concat([past[1], val], axis=1)  # [B, Lp + L, h, v]
        cache = (key, val) if use_cache else None
        width = max(self.qk_dim, m.v)  # one head width for the kernels: zero channels change no score, no output
        out = attend(
            _pad_to(q, width), _pad_to(key, width), _pad_to(val, width), plan, k.scale, self.window, k.attn_softcap
        )  # [B, L, h * width]
        if width != m.v:
            out = out.reshape([b, s, h, width])[..., : m.v].reshape([b, s, h * m.v])
        if tp is not None and tp.sequence_parallel:  # the row-parallel o_proj reduce-scatters the tokens (axis 0)
            out = out.reshape([b * s, -1])
            if pad:
                out = paddle.concat([out, paddle.zeros([pad, out.shape[-1]], dtype=out.dtype)], axis=0)
        return self.o_proj(out), cache


def _pad_to(x, width: int):
    """x [..., D] zero-padded on the last axis to [..., width] (as it is when D == width)."""
    if x.shape[-1] == width:
        return x
    return paddle.concat([x, paddle.zeros(x.shape[:-1] + [width - x.shape[-1]], dtype=x.dtype)], axis=-1)
