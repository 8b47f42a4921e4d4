"""The decoder's building blocks: norms, rotary embedding, the MLP factory and the attention block.

Every block reads its knobs (``rows.Knobs``) and nothing else; Linear weights are Paddle's
``[in, out]``; names are transformers' (``q_proj``, ``qkv_proj``, ``gate_up_proj``, ...).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import paddle
import paddle.nn.functional as F
from paddle import nn
from paddle.autograd import PyLayer

from ...kernels.rms_norm import rms_norm
from .attention import MaskPlan, attend
from .rope import inv_freq
from .rows import Knobs

__all__ = ["Norm", "Rotary", "DenseMLP", "Attention", "build_mlp", "register_mlp", "MLP_BUILDERS", "build_attention"]


class Norm(nn.Layer):
    """RMSNorm (``w * x / rms(x)``; Gemma's form ``x / rms(x) * (1 + w)``, weights initialised to 0)
    or LayerNorm (with bias) over the last axis, computed in float32.

    Under tensor parallelism (``tp``): ``split`` -- the input is this rank's columns of a column-parallel
    projection and the norm runs over the whole projection (OLMo 2's q/k norm): the weight is this rank's part and
    the sum of squares is all-reduced (forward and backward) before the rms; otherwise the weight is replicated
    but its input differs per rank (this rank's heads, or its tokens under sequence parallelism), so its partial
    gradient is summed over the ranks through ``identity``."""

    def __init__(self, dim: int, eps: float, kind: str = "rms", plus_one: bool = False, tp=None, split: bool = False):
        super().__init__()
        self.kind, self.plus_one, self.eps, self.dim = kind, plus_one, eps, dim
        self.tp, self.full_dim = tp, dim
        if split:
            if kind != "rms":
                raise ValueError("a LayerNorm over a tensor-parallel projection is not implemented")
            from ...parallel.layers import mark_split
            from ...parallel.shard import COLUMN, ShardSpec

            spec = ShardSpec(COLUMN, tp.rank, tp.degree, 1, dim)
            dim = self.dim = dim // tp.degree
        init = nn.initializer.Constant(0.0 if plus_one else 1.0)
        self.weight = self.create_parameter([dim], default_initializer=init)
        self.bias = self.create_parameter([dim], is_bias=True) if kind == "layer" else None
        self.split = split
        if split:
            mark_split(self.weight, spec, 0, [self.full_dim])

    def _shared(self, p):
        if self.tp is None or self.split or p is None or p.stop_gradient:
            return p
        return self.tp.comm.identity(p)  # replicated, fed this rank's heads / tokens: sum its partial gradients

    def forward(self, x, lean: bool = False):
        """``lean`` (the caller is not under recompute): a plain fp32 RMSNorm is one autograd node with a
        hand-written backward (``kernels.rms_norm``: ``x * x`` instead of ``pow``, nothing broadcast in the
        backward; within 1e-6 of the autograd form below, which Paddle's non-reentrant recompute needs)."""
        if lean and self.tp is None and self.kind == "rms" and not self.plus_one and x.dtype == paddle.float32:
            return rms_norm(x, self.weight, self.eps)
        weight, bias = self._shared(self.weight), self._shared(self.bias)
        if self.kind == "layer":
            return F.layer_norm(x, [self.dim], weight=weight, bias=bias, epsilon=self.eps)
        x32 = x.astype("float32")
        if self.split:  # the mean over the whole projection: every rank's sum of squares
            comm = self.tp.comm
            ms = comm.all_reduce(comm.identity(x32.pow(2).sum(-1, keepdim=True))) / float(self.full_dim)
        else:
            ms = (x32 * x32).mean(-1, keepdim=True)  # x * x, as kernels.rms_norm: exact, and faster than pow(2)
        y = x32 * paddle.rsqrt(ms + self.eps)  # [..., dim]
        if self.plus_one:  # Gemma: (1 + w) in float32, then cast
            return (y * (1.0 + weight.astype("float32"))).astype(x.dtype)
        return weight * y.astype(x.dtype)


def norm_of(k: Knobs, dim: int, tp=None, split: bool = False) -> Norm:
    return Norm(dim, k.eps, k.arch.norm, k.arch.norm_plus_one, tp, split)


class Rotary:
    """cos/sin tables for one (theta, rope_scaling); not a Layer: nothing to save, nothing lazy."""

    def __init__(self, k: Knobs, theta: float, scaling: Optional[dict]):
        self.k, self.theta, self.scaling = k, theta, scaling
        self._freqs: Dict[bool, tuple] = {}

    def tables(self, position_ids, dtype):
        """(cos, sin) [B, L, 1, rotary_dim] for position_ids [B, L]."""
        k = self.k
        long = False
        if self.scaling and self.scaling.get("rope_type") == "longrope":
            long = int(position_ids.max()) + 1 > (k.original_max_positions or k.max_positions)
        if long not in self._freqs:
            freq, att = inv_freq(
                k.rotary_dim,
                self.theta,
                self.scaling,
                k.max_positions,
                k.original_max_positions,
                seq_len=(k.original_max_positions or k.max_positions) + 1 if long else 0,
            )
            self._freqs[long] = (freq, att)
        freq, att = self._freqs[long]
        angles = position_ids.astype("float32").unsqueeze(-1) * paddle.to_tensor(freq)  # [B, L, R / 2]
        if k.arch.rope_interleaved:
            emb = paddle.stack([angles, angles], axis=-1).flatten(-2)  # [B, L, R]: f0 f0 f1 f1 ...
        else:
            emb = paddle.concat([angles, angles], axis=-1)  # [B, L, R]: f0 f1 ... f0 f1 ...
        cos, sin = emb.cos() * att, emb.sin() * att
        return cos.unsqueeze(2).astype(dtype), sin.unsqueeze(2).astype(dtype)


def _rotate(x, interleaved: bool):
    if interleaved:  # (x0, x1) -> (-x1, x0) for every pair
        return paddle.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).flatten(-2)
    half = x.shape[-1] // 2
    return paddle.concat([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x, cos, sin, interleaved: bool, lean: bool = False):
    """x [B, L, H, D] rotated on its first rotary_dim channels (the rest passes: partial rotary).
    ``lean``: when x takes a gradient, keep no copy of x for the backward (:class:`_Rotary`)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        if lean and not x.stop_gradient and cos.stop_gradient and sin.stop_gradient:
            return _Rotary.apply(x, cos, sin, interleaved)
        return x * cos + _rotate(x, interleaved) * sin
    rot, rest = x[..., :r], x[..., r:]
    return paddle.concat([rot * cos + _rotate(rot, interleaved) * sin, rest], axis=-1)


def _signed_sin(sin):
    """sin [B, L, 1, D] with its first half negated: ``rotate_half(x) * sin == roll(x, D/2) * _signed_sin(sin)``
    element for element (``(-a) * b == a * (-b)`` exactly), one roll instead of two slices, a negation and a
    concat whose backward zero-fills two full tensors; ``[[[[1., 2., 3., 4.]]]]`` -> ``[[[[-1., -2., 3., 4.]]]]``."""
    half = sin.shape[-1] // 2
    return paddle.concat([-sin[..., :half], sin[..., half:]], axis=-1)


class _Rotary(PyLayer):
    """x * cos + rotate(x) * sin whose backward keeps only the (shared) cos/sin tables: autograd would keep
    x and rotate(x), two [B, L, H, D] per query and key and layer, until the backward.  The rotation's
    transpose is -rotate, so dx = g * cos - rotate(g * sin): bitwise what autograd sums (the negation and
    the zero halves of the slices' gradients are exact).  The tables are expanded over the heads before
    multiplying (the same values; Paddle's CPU multiply is many times slower when an operand broadcasts), and
    the half rotation is one roll (:func:`_signed_sin`); the interleaved one keeps :func:`_rotate`."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        shape = x.shape
        ctx.interleaved = interleaved
        if interleaved:
            ctx.tables = (cos, sin)
            return x * cos.expand(shape) + _rotate(x, True) * sin.expand(shape)  # [B, L, H, D]
        half = shape[-1] // 2
        signed = _signed_sin(sin)  # [B, L, 1, D]
        ctx.tables = (cos, signed)
        return x * cos.expand(shape) + paddle.roll(x, shifts=half, axis=-1) * signed.expand(shape)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.tables
        shape = g.shape
        if ctx.interleaved:
            return g * cos.expand(shape) - _rotate(g * sin.expand(shape), True), None, None
        # -rotate_half(g * sin) == roll(g * signed, -D/2): [B, L, H, D]; the tables take no gradient
        return g * cos.expand(shape) + paddle.roll(g * sin.expand(shape), shifts=-(shape[-1] // 2), axis=-1), None, None


_ACT: Dict[str, Callable] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": lambda x: F.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate=True),
    "gelu_new": lambda x: F.gelu(x, approximate=True),
    "gelu_fast": lambda x: F.gelu(x, approximate=True),
}


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias_attr=None if bias else False)


class DenseMLP(nn.Layer):
    """``down(act(gate(x)) * up(x))``: SwiGLU (silu) or GeGLU (gelu); gate/up fused in ``gate_up_proj``
    ([gate | up] columns) for Phi-3 and GLM-4.  Tensor parallel (``tp``): gate/up column-parallel (the fused one
    per segment: a rank holds [gate_i | up_i]), down row-parallel."""

    def __init__(self, k: Knobs, layer_idx: int, tp=None):
        super().__init__()
        self.fused, self.act = k.arch.fused_gate_up, _ACT[k.act]
        # SwiGLU as Paddle's one fused op (one node forward and backward instead of silu, multiply and theirs)
        self.swiglu = k.act in ("silu", "swish")
        column = _linear if tp is None else tp.column
        if self.fused:
            seg = {} if tp is None else {"segments": (k.intermediate, k.intermediate)}
            self.gate_up_proj = column(k.hidden, 2 * k.intermediate, k.mlp_bias, **seg)
        else:
            self.gate_proj = column(k.hidden, k.intermediate, k.mlp_bias)
            self.up_proj = column(k.hidden, k.intermediate, k.mlp_bias)
        self.down_proj = (_linear if tp is None else tp.row)(k.intermediate, k.hidden, k.mlp_bias)

    def forward(self, x):  # x [B, L, hidden]
        if self.fused:
            gate, up = paddle.chunk(self.gate_up_proj(x), 2, axis=-1)  # [B, L, inter (/ N)] each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.swiglu(gate, up) if self.swiglu else self.act(gate) * up)  # [B, L, hidden]


#: Arch.mlp kind -> builder(knobs, layer_idx) -> Layer mapping [B, L, hidden] to [B, L, hidden].
#: An MoE block registers its kind here (``register_mlp``); the decoder layer calls ``build_mlp`` only.
MLP_BUILDERS: Dict[str, Callable[[Knobs, int], nn.Layer]] = {"dense": DenseMLP}


def register_mlp(kind: str, builder: Callable[[Knobs, int], nn.Layer]) -> None:
    MLP_BUILDERS[kind] = builder


def _moe_or_dense(k: Knobs, layer_idx: int, tp=None) -> nn.Layer:
    """Arch.mlp == "moe": the MoE block (its forward returns ``(hidden, router_logits)``) on the layers the
    config makes sparse (``decoder_sparse_step``, ``mlp_only_layers``, ernie's start/end/interval), else the
    dense MLP of ``intermediate_size`` (as transformers' ``*DecoderLayer`` chooses)."""
    from .moe import MoEBlock
    from .moe_spec import is_moe_layer

    # tensor parallel: router replicated, every expert split like the dense MLP (moe.py, moe_experts.py)
    return MoEBlock.from_config(k.cfg, tp=tp) if is_moe_layer(k.cfg, layer_idx) else DenseMLP(k, layer_idx, tp)


MLP_BUILDERS["moe"] = _moe_or_dense


def build_mlp(k: Knobs, layer_idx: int, tp=None) -> nn.Layer:
    if k.arch.mlp not in MLP_BUILDERS:
        raise ValueError(f"no MLP builder for kind {k.arch.mlp!r} (known: {sorted(MLP_BUILDERS)})")
    if tp is None:
        return MLP_BUILDERS[k.arch.mlp](k, layer_idx)
    return MLP_BUILDERS[k.arch.mlp](k, layer_idx, tp)


class Attention(nn.Layer):
    """Self-attention with the row's projections, biases, q/k norms, RoPE, window and soft-cap.

    Tensor parallel (``tp``, N ranks): each rank computes heads/N query heads and kv_heads/N key/value heads
    (q/k/v column-parallel, the fused qkv_proj per segment: [q_i | k_i | v_i]; o row-parallel); query head h
    still reads kv head h // (heads / kv_heads) because both are cut into the same N contiguous groups."""

    def __init__(self, k: Knobs, layer_idx: int, tp=None):
        super().__init__()
        self.k, self.idx, self.tp = k, layer_idx, tp
        n = 1 if tp is None else tp.degree
        if k.heads % n or k.kv_heads % n:
            raise ValueError(
                f"num_attention_heads={k.heads} and num_key_value_heads={k.kv_heads} must both be "
                f"multiples of tensor_parallel_degree={n}"
            )
        self.heads, self.kv_heads = k.heads // n, k.kv_heads // n  # this rank's
        q_out, kv_out = k.heads * k.head_dim, k.kv_heads * k.head_dim
        column = _linear if tp is None else tp.column
        if k.arch.fused_qkv:
            seg = {} if tp is None else {"segments": (q_out, kv_out, kv_out)}
            self.qkv_proj = column(k.hidden, q_out + 2 * kv_out, k.qkv_bias, **seg)
        else:
            self.q_proj = column(k.hidden, q_out, k.qkv_bias)
            self.k_proj = column(k.hidden, kv_out, k.qkv_bias)
            self.v_proj = column(k.hidden, kv_out, k.qkv_bias)
        self.o_proj = (_linear if tp is None else tp.row)(q_out, k.hidden, k.o_bias)
        if k.arch.qk_norm == "head":
            self.q_norm, self.k_norm = norm_of(k, k.head_dim, tp), norm_of(k, k.head_dim, tp)
        elif k.arch.qk_norm == "proj":
            self.q_norm, self.k_norm = (
                norm_of(k, q_out, tp, split=tp is not None),
                norm_of(k, kv_out, tp, split=tp is not None),
            )
        self.window = k.windows[layer_idx]
        # gpt-oss: one sink logit per head in the softmax (attention.attend)
        self.sinks = (
            self.create_parameter([self.heads], default_initializer=nn.initializer.Constant(0.0))
            if k.arch.attn_sinks
            else None
        )
        if self.sinks is not None and tp is not None:  # one per head: this rank's heads' sinks
            from ...parallel.layers import mark_split
            from ...parallel.shard import COLUMN, ShardSpec

            mark_split(self.sinks, ShardSpec(COLUMN, tp.rank, tp.degree, 1, k.heads), 0, [k.heads])

    def forward(self, x, rope, plan: MaskPlan, past=None, use_cache: bool = False):
        """x [B, L, hidden] (sequence parallel: this rank's [B * L / N, hidden] tokens); rope (cos, sin) or None
        (NoPE layer); past (k, v) [B, Lp, Hkv, D] each."""
        k = self.k
        b, s = plan.batch, plan.q_len
        if k.arch.fused_qkv:
            q_out, kv_out = self.heads * k.head_dim, self.kv_heads * k.head_dim
            q, key, val = paddle.split(self.qkv_proj(x), [q_out, kv_out, kv_out], axis=-1)
        else:
            q, key, val = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        pad = getattr(plan, "sp_pad", 0)
        if pad:  # sequence parallel: the projections gathered the zero rows that pad the tokens; drop them
            q, key, val = q[: b * s], key[: b * s], val[: b * s]
        if k.arch.qk_norm == "proj":  # OLMo 2: over the whole projection, before the head split
            q, key = self.q_norm(q), self.k_norm(key)
        q = q.reshape([b, s, self.heads, k.head_dim])  # [B, L, H, D]
        key = key.reshape([b, s, self.kv_heads, k.head_dim])  # [B, L, Hkv, D]
        val = val.reshape([b, s, self.kv_heads, k.head_dim])  # [B, L, Hkv, D]
        if k.arch.qk_norm == "head":
            q, key = self.q_norm(q, not plan.autograd_only), self.k_norm(key, not plan.autograd_only)
        if rope is not None:
            cos, sin = rope
            q = apply_rotary(q, cos, sin, k.arch.rope_interleaved, lean=not plan.autograd_only)
            key = apply_rotary(key, cos, sin, k.arch.rope_interleaved, lean=not plan.autograd_only)
        if past is not None:
            key = paddle.concat([past[0], key], axis=1)  # [B, Lp + L, Hkv, D]
            val = paddle.concat([past[1], val], axis=1)
        drop = float(k.cfg.get("attention_dropout") or 0.0) if self.training else 0.0  # qwen2/qwen3's dropout key
        out = attend(q, key, val, plan, k.scale, self.window, k.attn_softcap, self.sinks, drop)  # [B, L, H * D]
        if self.tp is not None and self.tp.sequence_parallel:
            out = out.reshape([b * s, -1])  # the row-parallel o_proj reduce-scatters the tokens (axis 0)
            if pad:
                out = paddle.concat([out, paddle.zeros([pad, out.shape[-1]], dtype=out.dtype)], axis=0)
        return self.o_proj(out), ((key, val) if use_cache else None)


def build_attention(k: Knobs, layer_idx: int, tp=None) -> nn.Layer:
    """The attention block of a layer: :class:`Attention`, or DeepSeek's latent attention (``Arch.attn == "mla"``,
    ``decoder/mla.py``); both map (x, rope, plan, past, use_cache) to (out, cache).  ``tp``: tensor parallel
    (latent attention: its heads split, its latent path replicated, ``decoder/mla.py``)."""
    if k.arch.attn == "mla":
        from .mla import LatentAttention

        return LatentAttention(k, layer_idx, tp)
    if k.arch.attn != "default":
        raise ValueError(f"no attention kind {k.arch.attn!r} (known: default, mla)")
    return Attention(k, layer_idx, tp)


def rotaries(k: Knobs):
    """One :class:`Rotary` per distinct (theta, scaling), and each layer's index into them (None: NoPE)."""
    tables, index = [], []
    for on, (theta, scaling) in zip(k.rope_on, k.rope):
        if not on:
            index.append(None)
            continue
        for i, r in enumerate(tables):
            if r.theta == theta and r.scaling == scaling:
                index.append(i)
                break
        else:
            tables.append(Rotary(k, theta, scaling))
            index.append(len(tables) - 1)
    return tables, index
