"""LoKr: the weight update of a Linear is a Kronecker product (Edalati et al.,
2022, *KronA*, arXiv:2212.10650; LyCORIS "LoKr"), with PaddleNLP 3.0.0b4's
``lokr`` semantics (``paddlenlp/peft/lokr``): same factorization, parameter
names, parameter shapes, init and scaling, so its checkpoints map 1:1.

Owns ``LoKrLinear``.  ``factorization`` (how a dimension splits into two factors) and
``lokr_shapes`` (the tensors one adapted layer holds, used by the layer, by the offline
merge's shape check, by ``compute_delta`` and by the planner) live with LoKr's row in the
paddle-free ``adapters.methods`` and are re-exported here.

Factors, for a Linear with ``in`` inputs and ``out`` outputs::

    in  = in_m  * in_n      (in_m,  in_n)  = factorization(in,  lokr_factor)
    out = out_m * out_n     (out_m, out_n) = factorization(out, lokr_factor)
    W1: [out_m, in_m]   lokr_w1,  or lokr_w1_a [out_m, r] @ lokr_w1_b [r, in_m]
    W2: [out_n, in_n]   lokr_w2,  or lokr_w2_a [out_n, r] @ lokr_w2_b [r, in_n]
    s  = lokr_alpha / lokr_dim  (lokr_alpha 0 = unset = lokr_dim, so s = 1)

    delta [out, in]  = s * kron(W1, W2)          (the papers' column-vector form)
    delta_weight     = s * kron(W1, W2).T        [in, out], Paddle's orientation

The factor tensors keep PaddleNLP's (and LyCORIS') out-first orientation; only
the assembled delta is transposed onto the ``[in, out]`` base weight.

W2 is low rank (``W2 = lokr_w2_a @ lokr_w2_b``, rank ``r = lokr_dim``) only when
``r < max(out_n, in_n) / 2``, otherwise it is a full ``lokr_w2`` (a rank-r
product would not save anything).  W1 is decomposed only with
``lokr_decompose_both`` and the same test on ``(out_m, in_m)``.  So the set of
tensors depends on the layer's shape: see ``lokr_shapes``.

Init (PaddleNLP's): W1 (``lokr_w1``, or ``lokr_w1_a`` when decomposed) is 0, so
the delta is 0 at init; every other factor is kaiming-uniform with a = sqrt(5)
over Paddle's fan_in = ``shape[0]``, i.e. ``U(-1/sqrt(shape[0]), 1/sqrt(shape[0]))``.

Forward never materialises the ``[in, out]`` delta: with ``x`` reshaped to
``X [N, in_m, in_n]`` (row-major, input index ``b * in_n + d``),
``kron(W1, W2) @ vec(X) = vec(W1 @ X @ W2.T)``, so the branch is two small
batched matmuls (three with a low-rank W2) costing ``N * (in * out_n + in_m * out)``
multiply-adds, and no ``[in, out]`` tensor.  ``delta_weight`` (merge) builds the
full ``kron``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Tuple

import numpy as np
import paddle
import paddle.nn as nn

from .base import AdapterLayer, to_numpy_f32
from .config import AdapterConfig
from .lora import _check_shape
from .methods import factorization, lokr_shapes  # noqa: F401  (paddle-free, the table rows use them; API here)


def lokr_scaling(config: AdapterConfig) -> float:
    """``lokr_alpha / lokr_dim`` (``AdapterConfig`` already turned alpha 0 into r)."""
    return float(config.alpha) / config.r


#: suffixes whose init is 0 (the delta is 0 at init); all others are kaiming-uniform
_ZERO_INIT = ("lokr_w1", "lokr_w1_a")


class LoKrLinear(AdapterLayer):
    method = "lokr"
    #: every suffix a LoKr layer may hold; one layer holds a shape-dependent subset
    #: (``self.state_suffixes``, set in ``__init__``; ``expected_suffixes`` for saved files)
    state_suffixes = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")

    def __init__(self, base_layer: nn.Layer, config: AdapterConfig, *, init_weights: bool = True, shared: Any = None):
        super().__init__(base_layer, config, init_weights=init_weights, shared=shared)
        self.r = config.r
        self.scaling = lokr_scaling(config)
        self.in_m, self.in_n = factorization(self.in_features, config.lokr_factor)
        self.out_m, self.out_n = factorization(self.out_features, config.lokr_factor)
        shapes = lokr_shapes(config, self.in_features, self.out_features)
        self.state_suffixes = tuple(shapes)  # instance attribute: this layer's subset
        for suffix, shape in shapes.items():
            if suffix in _ZERO_INIT:
                init = nn.initializer.Constant(0.0)
            else:  # kaiming-uniform, a = sqrt(5), fan_in = shape[0] (Paddle's convention for 2-D)
                bound = 1.0 / math.sqrt(shape[0])
                init = nn.initializer.Uniform(-bound, bound)
            setattr(
                self,
                suffix,
                self.create_parameter(
                    shape=list(shape), dtype=self._param_dtype, attr=paddle.ParamAttr(initializer=init), is_bias=False
                ),
            )

    @classmethod
    def expected_suffixes(cls, config: AdapterConfig, in_features: int, out_features: int) -> Tuple[str, ...]:
        return tuple(lokr_shapes(config, in_features, out_features))

    # ---------------------------------------------------------------- math
    def _w1(self, dtype=None) -> paddle.Tensor:
        """W1 [out_m, in_m]."""
        if "lokr_w1" in self.state_suffixes:
            w = self.lokr_w1
        else:
            w = paddle.matmul(self.lokr_w1_a, self.lokr_w1_b)  # [out_m, r] @ [r, in_m]
        return w if dtype is None else w.astype(dtype)

    def _w2(self, dtype=None) -> paddle.Tensor:
        """W2 [out_n, in_n]."""
        if "lokr_w2" in self.state_suffixes:
            w = self.lokr_w2
        else:
            w = paddle.matmul(self.lokr_w2_a, self.lokr_w2_b)  # [out_n, r] @ [r, in_n]
        return w if dtype is None else w.astype(dtype)

    def _adapter_forward(self, x: paddle.Tensor) -> paddle.Tensor:
        lead = list(x.shape[:-1])
        xr = x.reshape([-1, self.in_m, self.in_n])  # [N, in_m, in_n]; x index = b * in_n + d
        # X @ W2.T: [N, in_m, in_n] -> [N, in_m, out_n] (through rank r when W2 is low rank)
        if "lokr_w2" in self.state_suffixes:
            t = paddle.matmul(xr, self.lokr_w2, transpose_y=True)
        else:
            t = paddle.matmul(paddle.matmul(xr, self.lokr_w2_b, transpose_y=True), self.lokr_w2_a, transpose_y=True)
        # W1 @ (X @ W2.T): [out_m, in_m] @ [N, in_m, out_n] -> [N, out_m, out_n]; out index = a * out_n + c
        y = paddle.matmul(self._w1(), t)
        return y.reshape(lead + [self.out_features]) * self.scaling

    def delta_weight(self) -> paddle.Tensor:
        # kron: [out_m * out_n, in_m * in_n] = [out, in]; .T onto Paddle's [in, out]
        k = paddle.kron(self._w1(paddle.float32), self._w2(paddle.float32))
        return k.T * self.scaling

    @classmethod
    def numpy_delta(
        cls, config: AdapterConfig, tensors: Mapping[str, Any], in_features: int, out_features: int
    ) -> np.ndarray:
        shapes = lokr_shapes(config, in_features, out_features)
        t: Dict[str, np.ndarray] = {}
        for suffix, shape in shapes.items():
            if suffix not in tensors:
                raise ValueError(
                    f"LoKr tensors for a [{in_features}, {out_features}] module need {list(shapes)}, "
                    f"got {sorted(tensors)}"
                )
            t[suffix] = to_numpy_f32(tensors[suffix])
            _check_shape(suffix, t[suffix], shape)
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]  # [out_m, in_m]
        w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]  # [out_n, in_n]
        return np.kron(w1, w2).T * np.float32(lokr_scaling(config))  # [in, out]

    def extra_repr(self) -> str:
        return (
            super().extra_repr() + f", scaling={self.scaling:g}, in=({self.in_m}x{self.in_n}), "
            f"out=({self.out_m}x{self.out_n}), tensors={list(self.state_suffixes)}"
        )
