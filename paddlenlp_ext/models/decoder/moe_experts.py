"""The layers of an MoE block: routers, per-expert SwiGLU MLPs, gpt-oss' fused experts.

Parameter names follow transformers' so adapters and quantization that wrap ``nn.Linear`` by name reach
every expert (``experts.3.gate_proj``), and so a checkpoint maps name for name.  Paddle's ``nn.Linear``
stores its weight ``[in, out]``: a transformers ``[out, in]`` Linear weight is transposed on load
(the router's too: ``gate.weight`` / ``router.weight`` is ``[H, E]`` here).  gpt-oss' experts are
3-D parameters in transformers (``gate_up_proj`` ``[E, H, 2I]``, already ``[in, out]`` per expert) and
stay so here: no per-expert Linear exists for an adapter to wrap, as in transformers.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from .moe_spec import MoEConfigError, MoESpec

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate=True)}


def activation(name: str):
    """The activation function of a transformers ``hidden_act`` name."""
    if name not in _ACTIVATIONS:
        raise MoEConfigError(f"hidden_act={name!r} is not supported by the MoE experts; use one of "
                             f"{sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class SwiGLUExpert(nn.Layer):
    """``down(act(gate(x)) * up(x))`` with transformers' Linear names (``gate_proj/up_proj/down_proj``,
    mixtral's ``w1/w3/w2``); also the shared expert(s)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False,
                 names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = tuple(names)
        b = None if bias else False
        for name, (i, o) in zip(self.names, ((hidden_size, intermediate_size), (hidden_size, intermediate_size),
                                             (intermediate_size, hidden_size))):
            setattr(self, name, nn.Linear(i, o, bias_attr=b))
        self.act = activation(act)
        # silu(g) * u in one kernel: its backward keeps g and u only, not silu(g) too (one [t, I] less per
        # expert and layer until the backward; the values agree with silu(g) * u within float rounding)
        self.fused_swiglu = act in ("silu", "swish")

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        if self.fused_swiglu:
            return down(F.swiglu(gate(x), up(x)))  # [t, H] -> [t, I] -> [t, H]
        return down(self.act(gate(x)) * up(x))  # [t, H] -> [t, I] -> [t, H]


class Router(nn.Linear):
    """The gate: ``nn.Linear(H, E)`` (weight ``[H, E]``), plus deepseek's ``e_score_correction_bias`` buffer
    ([E], a buffer as in transformers: saved with the weights, never trained by the optimizer)."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False, correction_bias: bool = False,
                 fp32: bool = False):
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

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float = 1.702,
                 limit: float = 7.0):
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        init = nn.initializer.Normal(std=0.02)
        self.gate_up_proj = self.create_parameter([e, h, 2 * i], default_initializer=init)
        self.gate_up_proj_bias = self.create_parameter([e, 2 * i], is_bias=True)
        self.down_proj = self.create_parameter([e, i, h], default_initializer=init)
        self.down_proj_bias = self.create_parameter([e, h], is_bias=True)
        self.alpha, self.limit = alpha, limit

    def expert_forward(self, e: int, x):
        """Expert ``e`` on its tokens ``x`` [t, H] -> [t, H]."""
        gate_up = paddle.matmul(x, self.gate_up_proj[e]) + self.gate_up_proj_bias[e]  # [t, 2I]
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]  # [t, I] each
        gate = paddle.clip(gate, max=self.limit)
        up = paddle.clip(up, min=-self.limit, max=self.limit)
        glu = gate * F.sigmoid(gate * self.alpha)  # [t, I]
        return paddle.matmul((up + 1) * glu, self.down_proj[e]) + self.down_proj_bias[e]  # [t, H]


def build_experts(spec: MoESpec):
    """The routed experts of ``spec``: a LayerList of :class:`SwiGLUExpert` or one :class:`GptOssExperts`."""
    if spec.fused_experts:
        return GptOssExperts(spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.swiglu_alpha,
                             spec.swiglu_limit)
    return nn.LayerList([SwiGLUExpert(spec.hidden_size, spec.intermediate_size, spec.hidden_act, spec.expert_bias,
                                      spec.expert_names) for _ in range(spec.num_experts)])
