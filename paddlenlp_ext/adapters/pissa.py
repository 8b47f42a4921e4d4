"""PiSSA: Principal Singular values and Singular vectors Adaptation
(Meng, Wang & Zhang, 2024, arXiv:2404.02948).

Paddle orientation (W: [in, out], y = x @ W), which is also the paper's
``Y = X W`` orientation.  With the thin SVD ``W = U diag(S) Vh``::

    lora_A = U[:, :r] * sqrt(S[:r] / s)          [in, r]
    lora_B = sqrt(S[:r] / s)[:, None] * Vh[:r]   [r, out]
    =>  s * lora_A @ lora_B = U_r diag(S_r) Vh_r  (the top-r part of W)
    W_res  = W - s * lora_A @ lora_B              (replaces the base weight)

so the layer output is unchanged at initialisation.  ``s`` is the usual LoRA
scaling (alpha/r or alpha/sqrt(r)); dividing S by s keeps ``s * A @ B`` equal to
the principal part for any alpha (PaddleNLP instead forces s = 1).

The initial factors are kept as frozen buffers ``pissa_A0`` / ``pissa_B0`` and
saved with the adapter, so that against the ORIGINAL base weight::

    merged = W_orig - s * A0 @ B0 + s * A @ B

Loading a PiSSA adapter onto an original base recomputes the residual from
A0/B0 (no SVD at load time).

SVD: ``pissa_niter = 0`` -> exact (LAPACK, fp32); ``pissa_niter = q > 0`` ->
randomized SVD (Halko, Martinsson & Tropp, 2011, Alg. 4.4: Gaussian sketch with
oversampling, q re-orthonormalised power iterations).
"""

from __future__ import annotations

from typing import Any, Mapping, Tuple

import numpy as np
import paddle
import paddle.nn as nn

from .base import AdapterError, float_base_weight, is_quantized, to_numpy_f32
from .config import AdapterConfig
from .lora import LoRALinear, _check_shape


def exact_svd(w: np.ndarray, r: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-r singular triplets (U_r [m,r], S_r [r], Vh_r [r,n]) of ``w``."""
    u, s, vh = np.linalg.svd(np.asarray(w, dtype=np.float32), full_matrices=False)
    return u[:, :r], s[:r], vh[:r]


def randomized_svd(
    w: np.ndarray, r: int, niter: int, oversample: int = 10, seed: int = 0
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Approximate top-r singular triplets by randomized subspace iteration
    (Halko et al. 2011, Alg. 4.3/4.4) with ``niter`` power iterations."""
    w = np.asarray(w, dtype=np.float32)
    m, n = w.shape
    k = min(r + oversample, m, n)
    rng = np.random.default_rng(seed)
    omega = rng.standard_normal((n, k)).astype(np.float32)
    q, _ = np.linalg.qr(w @ omega)
    for _ in range(niter):
        z, _ = np.linalg.qr(w.T @ q)
        q, _ = np.linalg.qr(w @ z)
    small = q.T @ w  # [k, n]
    ub, s, vh = np.linalg.svd(small, full_matrices=False)
    u = q @ ub
    return u[:, :r], s[:r], vh[:r]


def pissa_factors(w: np.ndarray, r: int, scaling: float, niter: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(A [in, r], B [r, out]) with ``scaling * A @ B`` = top-r part of ``w``."""
    if niter > 0:
        u, s, vh = randomized_svd(w, r, niter)
    else:
        u, s, vh = exact_svd(w, r)
    sq = np.sqrt(np.maximum(s, 0.0) / np.float32(scaling)).astype(np.float32)
    return (u * sq[None, :]).astype(np.float32), (sq[:, None] * vh).astype(np.float32)


class PiSSALinear(LoRALinear):
    method = "pissa"
    state_suffixes = ("lora_A", "lora_B", "pissa_A0", "pissa_B0")

    def __init__(self, base_layer: nn.Layer, config: AdapterConfig, *, init_weights: bool = True, shared: Any = None):
        if is_quantized(base_layer):
            raise AdapterError(
                f"PiSSA cannot wrap the quantized layer {type(base_layer).__name__}: it must replace the base weight "
                "by the residual W - s*A0@B0, which would require re-quantization (QPiSSA is not implemented)"
            )
        super().__init__(base_layer, config, init_weights=init_weights, shared=shared)
        r = config.r
        if r > min(self.in_features, self.out_features):
            raise ValueError(
                f"PiSSA rank r={r} exceeds min(in_features, out_features)="
                f"{min(self.in_features, self.out_features)} of this layer"
            )
        # Frozen reference factors; the base weight always holds W_orig - s*A0@B0.
        self.register_buffer(
            "pissa_A0", paddle.zeros([self.in_features, r], dtype=self._param_dtype), persistable=False
        )
        self.register_buffer(
            "pissa_B0", paddle.zeros([r, self.out_features], dtype=self._param_dtype), persistable=False
        )
        if init_weights:
            self.pissa_init()

    @paddle.no_grad()
    def pissa_init(self) -> None:
        """SVD of the current (original) base weight -> A = A0, B = B0, residual base."""
        w = float_base_weight(self.base_layer, "PiSSA initialisation")
        w_orig = to_numpy_f32(w) + self.scaling * (to_numpy_f32(self.pissa_A0) @ to_numpy_f32(self.pissa_B0))
        a, b = pissa_factors(w_orig, self.r, self.scaling, self.config.pissa_niter)
        a_t = paddle.to_tensor(a).astype(self._param_dtype)
        b_t = paddle.to_tensor(b).astype(self._param_dtype)
        self.lora_A.set_value(a_t)
        self.lora_B.set_value(b_t)
        self._set_reference(a_t, b_t)

    @paddle.no_grad()
    def _set_reference(self, a0: paddle.Tensor, b0: paddle.Tensor) -> None:
        """Replace (A0, B0) and move the base weight from W_orig - s*A0_old@B0_old
        to W_orig - s*A0_new@B0_new."""
        w = float_base_weight(self.base_layer, "PiSSA residual")
        f32 = paddle.float32
        old = paddle.matmul(self.pissa_A0.astype(f32), self.pissa_B0.astype(f32))
        new = paddle.matmul(a0.astype(f32), b0.astype(f32))
        w_new = w.astype(f32) + (old - new) * self.scaling
        w.set_value(w_new.astype(w.dtype))
        self.pissa_A0.set_value(a0.astype(self._param_dtype))
        self.pissa_B0.set_value(b0.astype(self._param_dtype))

    @paddle.no_grad()
    def load_adapter_state_dict(self, d: Mapping[str, Any]) -> None:
        if self.merged:
            raise AdapterError("load_adapter_state_dict() on a merged layer; call unmerge() first")
        d = self._check_state(d)
        to_t = lambda k: paddle.to_tensor(to_numpy_f32(d[k])).astype(self._param_dtype)  # noqa: E731
        self.lora_A.set_value(to_t("lora_A"))
        self.lora_B.set_value(to_t("lora_B"))
        self._set_reference(to_t("pissa_A0"), to_t("pissa_B0"))

    def delta_weight(self) -> paddle.Tensor:
        """``s * A @ B``: what merge() adds to the CURRENT (residual) base weight.
        Relative to the original weight the delta is ``s * (A @ B - A0 @ B0)`` (``numpy_delta``)."""
        return super().delta_weight()

    @classmethod
    def numpy_delta(
        cls, config: AdapterConfig, tensors: Mapping[str, Any], in_features: int, out_features: int
    ) -> np.ndarray:
        a, b = to_numpy_f32(tensors["lora_A"]), to_numpy_f32(tensors["lora_B"])
        a0, b0 = to_numpy_f32(tensors["pissa_A0"]), to_numpy_f32(tensors["pissa_B0"])
        for name, arr, shape in (
            ("lora_A", a, (in_features, config.r)),
            ("lora_B", b, (config.r, out_features)),
            ("pissa_A0", a0, (in_features, config.r)),
            ("pissa_B0", b0, (config.r, out_features)),
        ):
            _check_shape(name, arr, shape)
        return ((a @ b) - (a0 @ b0)) * np.float32(config.scaling)
