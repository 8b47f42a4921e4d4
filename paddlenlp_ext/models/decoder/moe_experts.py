"""The layers of an MoE block: routers, per-expert SwiGLU MLPs, gpt-oss' fused experts.

Parameter names follow transformers' so adapters and quantization that wrap ``nn.Linear`` by name reach
every expert (``experts.3.gate_proj``), and so a checkpoint maps name for name.  Paddle's ``nn.Linear``
stores its weight ``[in, out]``: a transformers ``[out, in]`` Linear weight is transposed on load
(the router's too: ``gate.weight`` / ``router.weight`` is ``[H, E]`` here).  gpt-oss' experts are
3-D parameters in transformers (``gate_up_proj`` ``[E, H, 2I]``, already ``[in, out]`` per expert) and
stay so here: no per-expert Linear exists for an adapter to wrap, as in transformers.

Tensor parallel (``tp``, N ranks; :class:`~paddlenlp_ext.parallel.layers.TPContext` without sequence
parallelism: the block hands every expert all of its tokens): each expert is split like the dense MLP,
gate/up column-parallel over the expert's intermediate size and down row-parallel (its all-reduce gives the
complete expert output, the down bias added once after it); gpt-oss' fused experts the same way by slicing
the intermediate axis (gate/up interleaved, so a rank's units are one contiguous block of ``gate_up_proj``'s
last axis).  The router stays replicated (``moe.py``).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from .moe_spec import MoEConfigError, MoESpec

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate=True),
}


def activation(name: str):
    """The activation function of a transformers ``hidden_act`` name."""
    if name not in _ACTIVATIONS:
        raise MoEConfigError(
            f"hidden_act={name!r} is not supported by the MoE experts; use one of {sorted(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


class SwiGLUExpert(nn.Layer):
    """``down(act(gate(x)) * up(x))`` with transformers' Linear names (``gate_proj/up_proj/down_proj``,
    mixtral's ``w1/w3/w2``); also the shared expert(s)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        bias: bool = False,
        names=("gate_proj", "up_proj", "down_proj"),
        tp=None,
    ):
        super().__init__()
        self.names = tuple(names)
        b = None if bias else False
        shapes = ((hidden_size, intermediate_size), (hidden_size, intermediate_size), (intermediate_size, hidden_size))
        for j, (name, (i, o)) in enumerate(zip(self.names, shapes)):
            if tp is None:
                setattr(self, name, nn.Linear(i, o, bias_attr=b))
            else:  # gate/up: [H, I / N] column shards; down: [I / N, H] row shard (+ all-reduce, then the bias)
                setattr(self, name, tp.column(i, o, bias) if j < 2 else tp.row(i, o, bias))
        self.act = activation(act)
        # silu(g) * u in one kernel: its backward keeps g and u only, not silu(g) too (one [t, I] less per
        # expert and layer until the backward; the values agree with silu(g) * u within float rounding)
        self.fused_swiglu = act in ("silu", "swish")

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        if self.fused_swiglu:
            return down(F.swiglu(gate(x), up(x)))  # [t, H] -> [t, I] -> [t, H]
        return down(self.act(gate(x)) * up(x))  # [t, H] -> [t, I] -> [t, H]

    def partial(self, x):
        """Tensor parallel: this rank's share of the output, ``act(x @ G_i) * (x @ U_i) @ D_i`` (column biases
        included, no communication, no down bias: the block sums the ranks' shares and adds it).
        x [t, H] -> [t, H]."""
        from ...parallel.shard import local_product

        gate, up, down = (getattr(self, n) for n in self.names)
        return local_product(down, self.act(local_product(gate, x)) * local_product(up, x))  # [t, I / N] -> [t, H]

    def down_bias(self):
        """The down projection's bias [H] (replicated under tensor parallelism) or None."""
        return getattr(self, self.names[2]).bias


class Router(nn.Linear):
    """The gate: ``nn.Linear(H, E)`` (weight ``[H, E]``), plus deepseek's ``e_score_correction_bias`` buffer
    ([E], a buffer as in transformers: saved with the weights, never trained by the optimizer)."""

    def __init__(
        self, hidden_size: int, num_experts: int, bias: bool = False, correction_bias: bool = False, fp32: bool = False
    ):
        super().__init__(hidden_size, num_experts, bias_attr=None if bias else False)
        self.fp32 = fp32
        if correction_bias:
            self.register_buffer("e_score_correction_bias", paddle.zeros([num_experts], "float32"))

    def forward(self, x):
        # x: [T, H] -> logits [T, E]; ernie and deepseek route in float32 whatever the model's dtype
        if self.fp32:
            b = None if self.bias is None else self.bias.astype("float32")
            return F.linear(x.astype("float32"), self.weight.astype("float32"), b)
        return super().forward(x)


class MoEStatics(nn.Layer):
    """ERNIE-4.5's holder of ``e_score_correction_bias`` ([1, E]; transformers' ``moe_statics``)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.register_buffer("e_score_correction_bias", paddle.zeros([1, num_experts], "float32"))


class GptOssExperts(nn.Layer):
    """gpt-oss' fused experts: ``gate_up_proj`` [E, H, 2I] (gate and up interleaved on the last axis:
    gate = ``[..., 0::2]``, up = ``[..., 1::2]``), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H],
    ``down_proj_bias`` [E, H]; the clamped SwiGLU ``(clip(up, -l, l) + 1) * g * sigmoid(alpha * g)``
    with ``g = min(gate, l)``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        alpha: float = 1.702,
        limit: float = 7.0,
        tp=None,
    ):
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.tp = tp
        n = 1 if tp is None else tp.degree
        if i % n:
            raise MoEConfigError(f"intermediate_size={i} is not a multiple of tensor_parallel_degree={n}")
        local = i // n  # this rank's intermediate units (all of them without tensor parallelism)
        init = nn.initializer.Normal(std=0.02)
        self.gate_up_proj = self.create_parameter([e, h, 2 * local], default_initializer=init)
        self.gate_up_proj_bias = self.create_parameter([e, 2 * local], is_bias=True)
        self.down_proj = self.create_parameter([e, local, h], default_initializer=init)
        self.down_proj_bias = self.create_parameter([e, h], is_bias=True)  # replicated: added after the all-reduce
        self.alpha, self.limit = alpha, limit
        if tp is not None:
            from ...parallel.layers import mark_split
            from ...parallel.shard import COLUMN, ROW, ShardSpec

            # units [r * I / N, (r + 1) * I / N) of gate and of up: interleaved, one contiguous block of 2I / N
            column = ShardSpec(COLUMN, tp.rank, n, h, 2 * i)
            mark_split(self.gate_up_proj, column, 2, [e, h, 2 * i])
            mark_split(self.gate_up_proj_bias, column, 1, [e, 2 * i])
            mark_split(self.down_proj, ShardSpec(ROW, tp.rank, n, i, h), 1, [e, i, h])

    def expert_forward(self, e: int, x, partial: bool = False):
        """Expert ``e`` on its tokens ``x`` [t, H] -> [t, H]; ``partial`` (tensor parallel): this rank's share,
        without the communication and the down bias (the block adds them once for all experts)."""
        if self.tp is not None and not partial:  # column-parallel input: the ranks' partial input gradients summed
            x = self.tp.comm.identity(x)
        gate_up = paddle.matmul(x, self.gate_up_proj[e]) + self.gate_up_proj_bias[e]  # [t, 2I (/ N)]
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]  # [t, I (/ N)] each
        gate = paddle.clip(gate, max=self.limit)
        up = paddle.clip(up, min=-self.limit, max=self.limit)
        glu = gate * F.sigmoid(gate * self.alpha)  # [t, I (/ N)]
        out = paddle.matmul((up + 1) * glu, self.down_proj[e])  # [t, H], this rank's share under tensor parallelism
        if partial:
            return out
        if self.tp is not None:
            out = self.tp.comm.all_reduce(out)
        return out + self.down_proj_bias[e]  # [t, H]


def build_experts(spec: MoESpec, tp=None):
    """The routed experts of ``spec``: a LayerList of :class:`SwiGLUExpert` or one :class:`GptOssExperts`
    (``tp``: split over the tensor-parallel ranks, see the module docstring)."""
    if spec.fused_experts:
        return GptOssExperts(
            spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.swiglu_alpha, spec.swiglu_limit, tp
        )
    return nn.LayerList(
        [
            SwiGLUExpert(
                spec.hidden_size, spec.intermediate_size, spec.hidden_act, spec.expert_bias, spec.expert_names, tp
            )
            for _ in range(spec.num_experts)
        ]
    )
