"""VeRA: Vector-based Random Matrix Adaptation (Kopiczko, Blankevoort & Asano,
2024, arXiv:2310.11454).

Paper (column-vector) form: ``h = W0 x + diag(b) B diag(d) A x`` with ONE pair
of frozen random matrices ``A: [r, max_in]``, ``B: [max_out, r]`` shared by all
adapted layers (each layer uses the top-left slice ``A[:, :in]``,
``B[:out, :]``) and two trained vectors per layer, ``d: [r]`` (init
``vera_d_init``, 0.1) and ``b: [out]`` (init 0, so the output is unchanged at
init).  Trainable parameters per layer: ``r + out_features``.

Paddle (row-vector) orientation, W: [in, out]::

    h = base(x) + (((dropout(x) @ A[:, :in].T) * d) @ B[:out, :].T) * b
    delta_weight = (A[:, :in].T * d[None, :]) @ B[:out, :].T * b[None, :]   # [in, out]

The projections come from ``vera_projections(seed, r, max_in, max_out)``
(numpy ``default_rng``; identical on every machine/device) and are never
saved: the adapter file holds only d and b, and ``adapter_config.json`` holds
``vera_seed``, ``r``, ``vera_max_in``, ``vera_max_out`` to regenerate them.
Init scale (kaiming-uniform with a=sqrt(5), i.e. bound 1/sqrt(fan_in)):
``A ~ U(-1/sqrt(max_in), 1/sqrt(max_in))``, ``B ~ U(-1/sqrt(r), 1/sqrt(r))``,
A drawn first, then B, in float64 and cast to float32.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import paddle
import paddle.nn as nn

from .base import AdapterLayer, base_in_out, to_numpy_f32
from .config import AdapterConfig
from .lora import _check_shape


@functools.lru_cache(maxsize=8)
def _projections_cached(seed: int, r: int, max_in: int, max_out: int) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    bound_a = 1.0 / np.sqrt(max_in)
    bound_b = 1.0 / np.sqrt(r)
    a = rng.uniform(-bound_a, bound_a, size=(r, max_in)).astype(np.float32)
    b = rng.uniform(-bound_b, bound_b, size=(max_out, r)).astype(np.float32)
    a.setflags(write=False)
    b.setflags(write=False)
    return a, b


def vera_projections(seed: int, r: int, max_in: int, max_out: int) -> Tuple[np.ndarray, np.ndarray]:
    """The frozen shared VeRA matrices ``(A [r, max_in], B [max_out, r])`` as
    read-only float32 numpy arrays, deterministic in (seed, r, max_in, max_out)."""
    for name, v in (("r", r), ("max_in", max_in), ("max_out", max_out)):
        if int(v) <= 0:
            raise ValueError(f"vera_projections: {name} must be > 0, got {v}")
    return _projections_cached(int(seed), int(r), int(max_in), int(max_out))


class VeRAShared:
    """The one shared pair of frozen projections for a model (plain object, not
    a Layer: it is not registered per layer, never saved, never trained)."""

    def __init__(self, seed: int, r: int, max_in: int, max_out: int):
        self.seed, self.r, self.max_in, self.max_out = int(seed), int(r), int(max_in), int(max_out)
        a, b = vera_projections(seed, r, max_in, max_out)
        self.A = paddle.to_tensor(a)  # [r, max_in], fp32, stop_gradient=True
        self.B = paddle.to_tensor(b)  # [max_out, r]
        self._slices: Dict[tuple, Tuple[paddle.Tensor, paddle.Tensor]] = {}  # (in, out, dtype, rows, cols)

    def slices(self, in_features: int, out_features: int, dtype, in_rows: Optional[Tuple[int, int]] = None,
               out_cols: Optional[Tuple[int, int]] = None) -> Tuple[paddle.Tensor, paddle.Tensor]:  # fmt: skip
        """Row-vector factors ``(A[:, :in].T [in, r], B[:out, :].T [r, out])``,
        cached per (shape, dtype) so equal-shaped layers share them too.

        Tensor parallel: ``in_rows=(lo, hi)`` keeps rows ``lo:hi`` of the first factor
        (row-parallel shard), ``out_cols=(lo, hi)`` columns ``lo:hi`` of the second
        (column-parallel shard); ``in_features`` / ``out_features`` stay the full layer's."""
        key = (int(in_features), int(out_features), str(dtype), in_rows, out_cols)
        got = self._slices.get(key)
        if got is None:
            if in_features > self.max_in or out_features > self.max_out:
                raise ValueError(
                    f"layer [{in_features}, {out_features}] exceeds the VeRA projections' max dims "
                    f"[{self.max_in}, {self.max_out}]"
                )
            at = self.A[:, :in_features].T  # [in, r]
            bt = self.B[:out_features, :].T  # [r, out]
            if in_rows is not None:
                at = at[in_rows[0] : in_rows[1]]  # [in / N, r]
            if out_cols is not None:
                bt = bt[:, out_cols[0] : out_cols[1]]  # [r, out / N]
            at, bt = at.astype(dtype), bt.astype(dtype)
            at.stop_gradient = True
            bt.stop_gradient = True
            got = self._slices[key] = (at, bt)
        return got


class VeRALinear(AdapterLayer):
    method = "vera"
    state_suffixes = ("vera_d", "vera_b")

    def __init__(self, base_layer: nn.Layer, config: AdapterConfig, *, init_weights: bool = True, shared: Any = None):
        super().__init__(base_layer, config, init_weights=init_weights, shared=shared)
        if not isinstance(shared, VeRAShared):
            shared = VeRALinear.build_shared(config, [base_layer])
        if shared.r != config.r:
            raise ValueError(f"VeRA shared projections have rank {shared.r}, config.r is {config.r}")
        self.r = config.r
        self.vera_shared = shared  # plain attribute: the same object in every layer
        self.vera_d = self.create_parameter(
            shape=[self.r],
            dtype=self._param_dtype,
            attr=paddle.ParamAttr(initializer=nn.initializer.Constant(float(config.vera_d_init))),
            is_bias=False,
        )
        self.vera_b = self.create_parameter(
            shape=[self.out_features],
            dtype=self._param_dtype,
            attr=paddle.ParamAttr(initializer=nn.initializer.Constant(0.0)),
            is_bias=False,
        )
        self._factors(self._param_dtype)  # validates dims

    @classmethod
    def build_shared(cls, config: AdapterConfig, base_layers: Sequence[nn.Layer]) -> VeRAShared:
        """Create the model's shared projections.  Fills ``config.vera_max_in`` /
        ``vera_max_out`` (largest in/out features of the adapted layers) when
        they are None; otherwise checks every layer fits."""
        dims = [base_in_out(layer) for layer in base_layers]
        need_in = max(d[0] for d in dims)
        need_out = max(d[1] for d in dims)
        if config.vera_max_in is None:
            config.vera_max_in = need_in
        if config.vera_max_out is None:
            config.vera_max_out = need_out
        if need_in > config.vera_max_in or need_out > config.vera_max_out:
            raise ValueError(
                f"VeRA config has vera_max_in={config.vera_max_in}, vera_max_out={config.vera_max_out} but the "
                f"model needs at least [{need_in}, {need_out}]"
            )
        return VeRAShared(config.vera_seed, config.r, config.vera_max_in, config.vera_max_out)

    def _factors(self, dtype) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """``(at [in, r], bt [r, out])`` of this layer (the tensor-parallel subclass: its shard's)."""
        return self.vera_shared.slices(self.in_features, self.out_features, dtype)

    def _adapter_forward(self, x: paddle.Tensor) -> paddle.Tensor:
        at, bt = self._factors(self._param_dtype)
        return paddle.matmul(paddle.matmul(x, at) * self.vera_d, bt) * self.vera_b

    def delta_weight(self) -> paddle.Tensor:
        at, bt = self._factors(paddle.float32)
        d = self.vera_d.astype(paddle.float32)
        b = self.vera_b.astype(paddle.float32)
        return paddle.matmul(at * d.unsqueeze(0), bt) * b.unsqueeze(0)

    @classmethod
    def numpy_delta(
        cls, config: AdapterConfig, tensors: Mapping[str, Any], in_features: int, out_features: int
    ) -> np.ndarray:
        if config.vera_max_in is None or config.vera_max_out is None:
            raise ValueError("VeRA config lacks vera_max_in/vera_max_out; cannot regenerate the projections")
        if in_features > config.vera_max_in or out_features > config.vera_max_out:
            raise ValueError(
                f"module [{in_features}, {out_features}] exceeds vera_max_in/out "
                f"[{config.vera_max_in}, {config.vera_max_out}]"
            )
        a, b = vera_projections(config.vera_seed, config.r, config.vera_max_in, config.vera_max_out)
        d = to_numpy_f32(tensors["vera_d"])
        bv = to_numpy_f32(tensors["vera_b"])
        _check_shape("vera_d", d, (config.r,))
        _check_shape("vera_b", bv, (out_features,))
        at = a[:, :in_features].T  # [in, r]
        bt = b[:out_features, :].T  # [r, out]
        return ((at * d[None, :]) @ bt) * bv[None, :]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", vera_seed={self.vera_shared.seed}"
