"""LoRA (Hu et al., 2021, arXiv:2106.09685) with the rsLoRA scaling
(Kalajdzievski, 2023, arXiv:2312.03732) and LoRA+ learning rates
(Hayou et al., 2024, arXiv:2402.12354).

Row-vector (Paddle) orientation, W: [in, out]::

    h = base(x) + dropout(x) @ lora_A @ lora_B * scaling
    lora_A: [in, r]  ~ U(-1/sqrt(in), 1/sqrt(in))   (kaiming-uniform, a=sqrt(5))
    lora_B: [r, out] = 0                             (so h == base(x) at init)
    scaling = alpha / r          (LoRA)
            = alpha / sqrt(r)    (rsLoRA)

LoRA+: lora_B is created with a per-parameter learning-rate multiplier
``lora_plus_scale`` (``param.optimize_attr["learning_rate"]``, exactly what
``paddle.ParamAttr(learning_rate=...)`` sets).  Paddle optimizers multiply the
(scheduled) global learning rate by it, so B learns at ``lr * lora_plus_scale``
and A at ``lr``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import paddle
import paddle.nn as nn

from .base import AdapterLayer, to_numpy_f32
from .config import AdapterConfig


class LoRALinear(AdapterLayer):
    method = "lora"
    state_suffixes = ("lora_A", "lora_B")

    def __init__(self, base_layer: nn.Layer, config: AdapterConfig, *, init_weights: bool = True, shared: Any = None):
        super().__init__(base_layer, config, init_weights=init_weights, shared=shared)
        r = config.r
        self.r = r
        self.scaling = config.scaling
        self.lora_A = self._create_lora_A()
        self.lora_B = self.create_parameter(
            shape=[r, self.out_features],
            dtype=self._param_dtype,
            attr=paddle.ParamAttr(
                initializer=nn.initializer.Constant(0.0), learning_rate=float(config.lora_plus_scale)
            ),
            is_bias=False,
        )

    def _new_lora_A(self, in_features: int) -> paddle.Tensor:
        """A fresh ``[in_features, r]`` A drawn as LoRA initialises it (one draw of the global generator)."""
        bound = 1.0 / math.sqrt(in_features)
        return self.create_parameter(
            shape=[in_features, self.r],
            dtype=self._param_dtype,
            attr=paddle.ParamAttr(initializer=nn.initializer.Uniform(-bound, bound), learning_rate=1.0),
            is_bias=False,
        )

    def _create_lora_A(self) -> paddle.Tensor:
        """``lora_A`` (the row-parallel subclass draws the full A and keeps its rows)."""
        return self._new_lora_A(self.in_features)

    def _adapter_forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # scaled at rank r ([.., r], not [.., out]): the same product, out/r times fewer scale ops forward and back
        return paddle.matmul(paddle.matmul(x, self.lora_A) * self.scaling, self.lora_B)

    def delta_weight(self) -> paddle.Tensor:
        a = self.lora_A.astype(paddle.float32)
        b = self.lora_B.astype(paddle.float32)
        return paddle.matmul(a, b) * self.scaling

    @classmethod
    def numpy_delta(
        cls, config: AdapterConfig, tensors: Mapping[str, Any], in_features: int, out_features: int
    ) -> np.ndarray:
        a = to_numpy_f32(tensors["lora_A"])
        b = to_numpy_f32(tensors["lora_B"])
        _check_shape("lora_A", a, (in_features, config.r))
        _check_shape("lora_B", b, (config.r, out_features))
        return (a @ b) * np.float32(config.scaling)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", scaling={self.scaling:g}, lora_plus_scale={self.config.lora_plus_scale:g}"


def _check_shape(name: str, arr: np.ndarray, shape) -> None:
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {list(arr.shape)}, expected {list(shape)}")
