"""``QuantizedLinear``: a frozen, weight-quantized replacement for ``paddle.nn.Linear``.

Owns the layer: its buffers, how it is built (:meth:`QuantizedLinear.from_weight`,
``from_linear``, ``from_structure``, the skeleton constructor) and which
decoder each forward path runs.  Which layout and which kernel to use is
decided by the pure functions of :mod:`.dispatch`; the machine's capabilities
come from :mod:`.probe`; the portable decoders and the matmul ``PyLayer`` that
frees the weight live in :mod:`.dequant`.

The layer keeps ``in_features``/``out_features``, the (frozen) bias and the
quantized buffers only -- no full-precision copy of the weight.  LoRA adapters
wrap it like any base layer (they only need ``in_features``, ``out_features``
and ``forward(x)``).

Forward paths (the one that ran is stored in ``layer.last_path`` and logged
once per process and path):

``portable_dequant_matmul``
    Any device.  Dequantize (CPU: the numpy decoder of :mod:`.decode`, handed
    over through DLPack; elsewhere Paddle ops), cast to ``x.dtype`` and
    matmul, inside :class:`~.dequant.DequantMatmul`: the weight is dropped
    after the forward matmul and dequantized again in backward, so training
    memory stays at the quantized size (as bitsandbytes does).  Gradients go
    to ``x`` only.
``paddleslim_dequant_blockwise_matmul``
    nf4/fp4 with ``x`` on GPU and PaddleSlim's custom op module
    (``paddleslim_ops``, built from PaddleSlim ``csrc/``) importable: its
    ``dequant_blockwise`` CUDA kernel decodes the same flat blockwise layout
    (high nibble first, same code books) we store when ``block_size`` divides
    ``in_features``; the rest as above.
``paddle_weight_only_linear``
    int8/int4 built on a GPU (``backend="paddle_weight_only"``, chosen by
    ``backend="auto"`` when the weight is on a supported GPU): the weight is
    stored in the layout of ``paddle.nn.quant.weight_quantize`` and the fused
    ``paddle.nn.quant.weight_only_linear`` kernel runs for fp16/bf16 inputs
    (it has a grad kernel for ``x``).
``paddle_weight_dequantize_matmul``
    the same layer with a float32 input: ``weight_dequantize`` + matmul.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import paddle
import paddle.nn as nn

from . import codec as C
from . import formats as F
from .dequant import DequantMatmul, block_scales, build_lut, decode_portable
from .dispatch import (  # noqa: F401  (PATH_PORTABLE: still importable from here, as before dispatch.py)
    BACKEND_PORTABLE,
    BACKEND_WEIGHT_ONLY,
    BACKENDS,
    PATH_PADDLESLIM,
    PATH_PORTABLE,
    PATH_WEIGHT_DEQUANT,
    PATH_WEIGHT_ONLY,
    KernelCaps,
    plan_build,
    plan_dequant,
    plan_kernel,
)
from .probe import (  # noqa: F401  (the probes are still importable -- and patchable -- from here)
    _PADDLESLIM_MODULES,
    _cuda_arch,
    _dtype_name,
    _log_path_once,
    _on_gpu,
    _paddleslim_available,
    find_paddleslim_ops,
    log_once,
    paddleslim_ops,
    probe_caps,
)

_LOW_PRECISION = ("float16", "bfloat16")
_PERSISTED = ("quant_weight", "quant_scale", "qquant_scale", "double_quant_scale", "quant_scale_offset")


def _place_is_gpu(place) -> bool:
    return bool(getattr(place, "is_gpu_place", lambda: False)())


def _bias_tensor(bias, out_features: int, dtype: str, place) -> Optional[paddle.Tensor]:
    """The frozen bias of a new layer: None, the given paddle tensor (shared), or a numpy ``[out]`` copied."""
    if bias is None or isinstance(bias, paddle.Tensor):
        return bias
    b = np.asarray(bias)
    if b.shape != (out_features,) or not np.issubdtype(b.dtype, np.floating):
        raise ValueError(f"bias must be a float array of shape [{out_features}], got {b.dtype} {list(b.shape)}")
    t = paddle.to_tensor(b.astype(np.float32), place=place).astype(dtype)  # bf16 has no numpy dtype: cast here
    zero = nn.initializer.Constant(0.0)
    p = paddle.create_parameter([out_features], dtype=dtype, is_bias=True, default_initializer=zero)
    p.set_value(t)
    return p


class QuantizedLinear(nn.Layer):
    """Frozen weight-quantized Linear: ``y = x @ dequant(W) + b``.

    Use :meth:`from_linear` to build one from an ``nn.Linear``.  Calling the
    constructor directly creates zero buffers of the right shapes (a skeleton
    to ``set_state_dict`` a saved quantized layer into).

    Buffers (persistable: saved in ``state_dict`` and moved with the model):
    ``quant_weight``, and ``quant_scale`` -- or, with double quantization,
    ``qquant_scale``, ``double_quant_scale``, ``quant_scale_offset``.
    See :mod:`paddlenlp_ext.quant.formats` for their layout.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        algo: str,
        block_size: int = F.DEFAULT_BLOCK_SIZE,
        double_quant: bool = False,
        double_quant_block_size: int = F.DEFAULT_DOUBLE_QUANT_BLOCK_SIZE,
        bias_attr: Any = None,
        weight_dtype: str = "float32",
        backend: str = BACKEND_PORTABLE,
        arch: Optional[int] = None,
    ):
        super().__init__()
        fmt = F.get_format(algo)
        if backend not in (BACKEND_PORTABLE, BACKEND_WEIGHT_ONLY):
            raise ValueError(f"backend must be {BACKEND_PORTABLE!r} or {BACKEND_WEIGHT_ONLY!r}, got {backend!r}")
        if backend == BACKEND_WEIGHT_ONLY and fmt.gpu_kernel != F.KERNEL_WEIGHT_ONLY:
            raise ValueError(f"backend {BACKEND_WEIGHT_ONLY!r} only supports {F.INT_ALGOS}, got {algo!r}")
        F.check_shape(in_features, out_features, algo, block_size)
        if double_quant and not fmt.blockwise:
            raise ValueError(
                f"weight_double_quant is only defined for nf4/fp4, got algo={algo!r}. Set weight_double_quant=False."
            )
        self.format = fmt
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.algo = algo
        self.block_size = int(block_size) if fmt.blockwise else None
        self.double_quant = bool(double_quant)
        self.double_quant_block_size = int(double_quant_block_size) if double_quant else None
        self.weight_dtype = _dtype_name(weight_dtype)
        self.compute_dtype = self.weight_dtype  # read by adapters.base.adapter_dtype
        self.backend = backend
        self.arch = arch
        self.last_path: Optional[str] = None

        out_f, in_f = self.out_features, self.in_features
        if backend == BACKEND_WEIGHT_ONLY:
            # weight_quantize's layout: int8 [out, in], int4 [out / 2, in] (both int8, interleaved)
            self._add_buffer("quant_weight", np.zeros([out_f * fmt.bits // 8, in_f], np.int8))
            self._add_buffer("quant_scale", np.zeros([out_f], np.float32))
        else:
            self._add_buffer("quant_weight", np.zeros([out_f, fmt.packed_in(in_f)], fmt.code_dtype))
            if not fmt.blockwise:
                self._add_buffer("quant_scale", np.zeros([out_f], np.float32))
            else:
                nblk = fmt.num_blocks(in_f, self.block_size)
                if self.double_quant:
                    n2 = -(-(out_f * nblk) // self.double_quant_block_size)
                    self._add_buffer("qquant_scale", np.zeros([out_f, nblk], np.int8))
                    self._add_buffer("double_quant_scale", np.zeros([n2], np.float32))
                    self._add_buffer("quant_scale_offset", np.zeros([], np.float32))
                else:
                    self._add_buffer("quant_scale", np.zeros([out_f, nblk], np.float32))
            if fmt.code is not None:
                # decoding table: not saved (persistable=False), but moved with the layer
                self.register_buffer("_lut", paddle.to_tensor(build_lut(fmt.code)), persistable=False)

        if bias_attr is False or bias_attr is None:
            self.bias = None
        elif bias_attr is True:  # skeleton: zero bias, filled by set_state_dict
            self.bias = self.create_parameter(
                [out_f], dtype=self.weight_dtype, is_bias=True, default_initializer=nn.initializer.Constant(0.0)
            )
            self.bias.stop_gradient = True
        elif isinstance(bias_attr, paddle.Tensor):
            self.bias = bias_attr
            self.bias.stop_gradient = True
        else:
            raise ValueError("bias_attr must be None/False/True or an existing bias tensor")

    # ------------------------------------------------------------------ build
    def _add_buffer(self, name: str, value: np.ndarray, place=None) -> None:
        t = paddle.to_tensor(value, place=place) if place is not None else paddle.to_tensor(value)
        t.stop_gradient = True
        self.register_buffer(name, t, persistable=True)

    def _persisted(self) -> Dict[str, paddle.Tensor]:
        """The quantized buffers this layer holds (codes + scales), by name."""
        own = dict(self.named_buffers(include_sublayers=False))
        return {name: own[name] for name in _PERSISTED if own.get(name) is not None}

    @classmethod
    def from_structure(
        cls, structure: Dict[str, Any], bias: Optional[paddle.Tensor] = None, weight_dtype: str = "float32", place=None
    ) -> "QuantizedLinear":
        """Build from a :func:`.codec.quantize` result (portable layout)."""
        layer = cls(
            structure["in_features"],
            structure["out_features"],
            structure["algo"],
            block_size=structure["block_size"] or F.DEFAULT_BLOCK_SIZE,
            double_quant=structure["double_quant"],
            double_quant_block_size=structure["double_quant_block_size"] or F.DEFAULT_DOUBLE_QUANT_BLOCK_SIZE,
            bias_attr=bias,
            weight_dtype=weight_dtype,
            backend=BACKEND_PORTABLE,
        )
        for name in _PERSISTED:
            if name in structure:
                layer._add_buffer(name, np.asarray(structure[name]), place=place)
        if place is not None and layer.format.code is not None:
            lut = paddle.to_tensor(build_lut(layer.format.code), place=place)  # with the codes on their device
            layer.register_buffer("_lut", lut, persistable=False)
        return layer

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        algo: str,
        block_size: int = F.DEFAULT_BLOCK_SIZE,
        double_quant: bool = False,
        double_quant_block_size: int = F.DEFAULT_DOUBLE_QUANT_BLOCK_SIZE,
        backend: str = "auto",
    ) -> "QuantizedLinear":
        """Quantize ``linear.weight`` ([in, out]) and return the replacement layer (see :meth:`from_weight`).

        The new layer shares ``linear.bias`` (set to ``stop_gradient=True``) and
        keeps no reference to ``linear.weight``.
        """
        return cls.from_weight(
            linear.weight, linear.bias, algo, block_size, double_quant, double_quant_block_size, backend=backend
        )

    @classmethod
    def from_weight(
        cls,
        weight,
        bias,
        algo: str,
        block_size: int = F.DEFAULT_BLOCK_SIZE,
        double_quant: bool = False,
        double_quant_block_size: int = F.DEFAULT_DOUBLE_QUANT_BLOCK_SIZE,
        backend: str = "auto",
        *,
        weight_dtype: Optional[str] = None,
        place=None,
    ) -> "QuantizedLinear":
        """Build the layer straight from a weight ``[in_features, out_features]`` (no ``nn.Linear`` needed).

        Args:
            weight: numpy float array (fp32, fp16, or bf16 widened to fp32) or a
                paddle tensor, in Paddle's ``nn.Linear`` layout ``[in, out]``.
                Only read: the layer keeps no reference to it and no float copy.
            bias: None, a numpy array ``[out]`` (copied into a frozen bias
                parameter of ``weight_dtype``) or a paddle tensor (shared, set
                to ``stop_gradient=True``).
            algo, block_size, double_quant, double_quant_block_size: the format
                (see :func:`.codec.quantize`).
            backend: ``"auto"`` (Paddle's fused weight-only GPU layout for
                int8/int4 when the weight is on a supported GPU, else portable),
                ``"portable"`` or ``"paddle_weight_only"`` (see :func:`.dispatch.plan_build`).
            weight_dtype: the model's dtype for this layer (bias dtype, dtype of
                :meth:`dequantize_weight`); default: a paddle weight's dtype, or
                ``"float16"`` for a numpy fp16 array, else ``"float32"``.  Pass
                ``"bfloat16"`` with a bf16 weight widened to fp32.
            place: device of the buffers; default: a paddle weight's place,
                else the current device.  A GPU place lets ``"auto"`` pick the
                weight-only layout for a numpy weight.

        The codes are bit-identical whichever way the same weight values come in
        (numpy fp32, a paddle fp32 tensor, or ``from_linear``).
        """
        fmt = F.get_format(algo)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        is_tensor = isinstance(weight, paddle.Tensor)
        if not is_tensor:
            weight = np.asarray(weight)
        if len(weight.shape) != 2:
            raise ValueError(f"expected a 2-D Linear weight [in, out], got shape {list(weight.shape)}")
        in_f, out_f = int(weight.shape[0]), int(weight.shape[1])
        F.check_shape(in_f, out_f, algo, block_size)
        if is_tensor:
            wdtype = _dtype_name(weight_dtype or weight.dtype)
            place = weight.place if place is None else place
        else:
            if not np.issubdtype(weight.dtype, np.floating):
                raise ValueError(f"from_weight expects a floating point weight, got dtype {weight.dtype}")
            wdtype = _dtype_name(weight_dtype or ("float16" if weight.dtype == np.float16 else "float32"))
        on_gpu = _on_gpu(weight) if is_tensor else (place is not None and _place_is_gpu(place))
        plan = plan_build(fmt, backend, in_f, out_f, wdtype, on_gpu, probe_caps())
        if plan.reason:
            log_once(plan.reason)
        bias_t = _bias_tensor(bias, out_f, wdtype, place)

        if plan.backend == BACKEND_WEIGHT_ONLY:
            with paddle.no_grad():
                w = weight if is_tensor else paddle.to_tensor(weight, place=place)  # transient, on the GPU
                qw, scale = paddle.nn.quant.weight_quantize(
                    w.astype(plan.quantize_dtype), algo=algo, arch=plan.arch
                )  # qw int8 [out, in] or [out / 2, in]; scale [out] in quantize_dtype
                del w
            layer = cls(in_f, out_f, algo, bias_attr=bias_t, weight_dtype=wdtype, backend=plan.backend,
                        arch=plan.arch)  # fmt: skip
            qw.stop_gradient = True
            scale.stop_gradient = True
            layer.register_buffer("quant_weight", qw, persistable=True)
            layer.register_buffer("quant_scale", scale, persistable=True)
            return layer

        structure = C.quantize(weight, algo, block_size, double_quant, double_quant_block_size)
        return cls.from_structure(structure, bias=bias_t, weight_dtype=wdtype, place=place)

    # ------------------------------------------------------------ dequantize
    def _block_scales(self) -> paddle.Tensor:
        """f32 scales used for decoding ([out] or [out, ceil(in / bs)]), double quant undone."""
        return block_scales(self)

    def _dequant(self, path: str, kwargs: Optional[Dict[str, Any]] = None) -> Tuple[paddle.Tensor, bool]:
        """Dequantized weight for ``path``: ``(w, out_in)``; ``w`` is [out, in] if ``out_in`` else [in, out].

        ``kwargs``: the kernel arguments of the plan (:func:`.dispatch.plan_kernel`).
        """
        with paddle.no_grad(), paddle.amp.auto_cast(enable=False):
            if path == PATH_WEIGHT_DEQUANT:
                return self._weight_only_dequant(kwargs), False
            if path == PATH_PADDLESLIM:
                w = paddleslim_ops().dequant_blockwise(
                    self.quant_weight,
                    kwargs["code"],
                    self._block_scales().reshape([-1]),
                    kwargs["blocksize"],
                    kwargs["quant_type"],
                )  # [2 * numel(quant_weight), 1] float32
                return w.reshape([self.out_features, self.in_features]), True
            return decode_portable(self), True

    def _weight_only_dequant(self, kwargs: Dict[str, Any]) -> paddle.Tensor:
        """[in, out] weight from Paddle's weight-only GPU layout (``kwargs`` from :func:`.dispatch.plan_dequant`)."""
        quant = paddle.nn.quant
        try:
            w = quant.weight_dequantize(self.quant_weight, self.quant_scale, algo=kwargs["algo"])
            if list(w.shape) == [self.in_features, self.out_features]:
                return w
        except RuntimeError as e:
            # Paddle reports a kernel missing for this device/build as RuntimeError
            # "(NotFound) The kernel `weight_dequantize` is not registered."; anything else is a real error
            if "is not registered" not in str(e):
                raise
        # exact fallback: I @ W through the fused kernel
        kdtype = _dtype_name(self.quant_scale.dtype)
        if kdtype not in _LOW_PRECISION:
            kdtype = "float16"
        eye = paddle.eye(self.in_features, dtype="float32").astype(kdtype)  # [in, in]
        return quant.weight_only_linear(
            eye,
            self.quant_weight,
            weight_scale=self.quant_scale.astype(kdtype),
            weight_dtype=kwargs["weight_dtype"],
            arch=kwargs["arch"],
            group_size=kwargs["group_size"],
        )  # [in, out]

    def dequantize_weight(self, dtype: Optional[str] = None) -> paddle.Tensor:
        """The dequantized weight ``[in_features, out_features]`` (original dtype unless ``dtype``)."""
        w, out_in = self._dequant(*plan_dequant(self.format, self.backend, self.arch))
        if out_in:
            w = w.transpose([1, 0])
        w = w.astype(_dtype_name(dtype) if dtype is not None else self.weight_dtype)
        w.stop_gradient = True
        return w

    def to_structure(self) -> Dict[str, Any]:
        """The portable-format dict (numpy) of this layer, as :func:`.codec.quantize` returns."""
        if self.backend != BACKEND_PORTABLE:
            raise ValueError(f"to_structure needs the portable layout; this layer uses {self.backend!r}")
        s: Dict[str, Any] = {
            "algo": self.algo,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "block_size": self.block_size,
            "double_quant": self.double_quant,
            "double_quant_block_size": self.double_quant_block_size,
            "layout": "out_in",
        }
        s.update({name: t.numpy() for name, t in self._persisted().items()})
        return s

    # ----------------------------------------------------------------- sizes
    def quantized_nbytes(self) -> int:
        """Bytes of the persistable quantized buffers (codes + scales; bias not counted)."""
        return sum(int(np.prod(t.shape)) * t.element_size() for t in self._persisted().values())

    @property
    def num_weight_params(self) -> int:
        return self.in_features * self.out_features

    # --------------------------------------------------------------- forward
    def plan(self, x_on_gpu: bool, x_dtype: Optional[str]) -> Tuple[str, Dict[str, Any]]:
        """``(path, kernel kwargs)`` the forward takes for such an input (see :func:`.dispatch.plan_kernel`)."""
        return plan_kernel(
            self.format, self.backend, x_on_gpu=x_on_gpu, x_dtype=x_dtype, arch=self.arch,
            block_size=self.block_size, paddleslim=_paddleslim_available, in_features=self.in_features,
        )  # fmt: skip

    def planned_path(self) -> str:
        """The path an input on the weight's device will take (``quantize_model``'s ``stats["path"]``);
        the input dtype is not known yet, so the fused kernel's fp16/bf16 is assumed."""
        return self.plan(_on_gpu(self.quant_weight), None)[0]

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        path, kwargs = self.plan(_on_gpu(x), _dtype_name(x.dtype))
        if path == PATH_WEIGHT_ONLY:
            xd = x.dtype
            bias = self.bias.astype(xd) if self.bias is not None else None
            with paddle.amp.auto_cast(enable=False):
                out = paddle.nn.quant.weight_only_linear(
                    x, self.quant_weight, bias=bias, weight_scale=self.quant_scale.astype(xd), **kwargs
                )  # [..., in] -> [..., out]
        else:
            out = DequantMatmul.apply(x, self, path, kwargs)
            if self.bias is not None:
                out = out + self.bias.astype(out.dtype)
        self.last_path = path
        _log_path_once(path, self.algo)
        return out

    def extra_repr(self) -> str:
        bs = f", block_size={self.block_size}" if self.block_size else ""
        dq = ", double_quant=True" if self.double_quant else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, algo={self.algo}{bs}{dq}, "
            f"backend={self.backend}, bias={self.bias is not None}"
        )
