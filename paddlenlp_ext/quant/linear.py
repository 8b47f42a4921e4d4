"""``QuantizedLinear``: a frozen, weight-quantized replacement for ``paddle.nn.Linear``.

The layer keeps ``in_features``/``out_features``, the (frozen) bias and the
quantized buffers only -- no full-precision copy of the weight.  LoRA adapters
wrap it like any base layer (they only need ``in_features``, ``out_features``
and ``forward(x)``).

Forward paths (the one that ran is stored in ``layer.last_path`` and logged
once per process and path):

``portable_dequant_matmul``
    Any device.  Dequantize with plain paddle ops (one 256-entry byte -> two
    values lookup for the 4-bit formats, times the scales), cast to ``x.dtype``
    and matmul.  Runs inside a ``PyLayer`` that dequantizes again in backward
    instead of saving the dequantized weight, so training memory stays at the
    quantized size (as bitsandbytes does).  Gradients go to ``x`` only.
``paddleslim_dequant_blockwise_matmul``
    nf4/fp4 with ``x`` on GPU and PaddleSlim's custom op module
    (``paddleslim_ops``, built from PaddleSlim ``csrc/``) importable: its
    ``dequant_blockwise`` CUDA kernel decodes the same flat blockwise layout
    (high nibble first, same code books) we store; the rest as above.
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

import logging
from typing import Any, Dict, Optional, Tuple

import numpy as np
import paddle
import paddle.nn as nn
from paddle.autograd import PyLayer

from . import formats as F

logger = logging.getLogger(__name__)

PATH_PORTABLE = "portable_dequant_matmul"
PATH_PADDLESLIM = "paddleslim_dequant_blockwise_matmul"
PATH_WEIGHT_ONLY = "paddle_weight_only_linear"
PATH_WEIGHT_DEQUANT = "paddle_weight_dequantize_matmul"

BACKEND_PORTABLE = "portable"
BACKEND_WEIGHT_ONLY = "paddle_weight_only"
BACKENDS = ("auto", BACKEND_PORTABLE, BACKEND_WEIGHT_ONLY)

# SM versions accepted by paddle.nn.quant.weight_quantize / weight_only_linear (Paddle 3.3)
_WEIGHT_ONLY_ARCHS = (70, 75, 80, 86, 89, 90, 92, 100)
_LOW_PRECISION = ("float16", "bfloat16")

_LOGGED_PATHS: set = set()
_PADDLESLIM_OPS: Any = None
_PADDLESLIM_CHECKED = False


def _dtype_name(dtype) -> str:
    """'paddle.float32' / VarType.FP32 / 'float32' -> 'float32'."""
    s = str(dtype).lower().replace("paddle.", "").replace("vartype.", "").replace("datatype.", "")
    return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}.get(s, s)


def paddleslim_ops():
    """PaddleSlim's compiled op module exposing ``dequant_blockwise``, or ``None``.

    PaddleNLP imports it as ``paddleslim_ops`` (built by PaddleSlim's
    ``csrc/setup_cuda.py``); older PaddleSlim trees named it ``custom_setup_ops``.
    """
    global _PADDLESLIM_OPS, _PADDLESLIM_CHECKED
    if not _PADDLESLIM_CHECKED:
        _PADDLESLIM_CHECKED = True
        for name in ("paddleslim_ops", "custom_setup_ops"):
            try:
                mod = __import__(name)
            except Exception:  # ImportError, or a broken CUDA build
                continue
            if hasattr(mod, "dequant_blockwise"):
                _PADDLESLIM_OPS = mod
                break
    return _PADDLESLIM_OPS


def _cuda_arch() -> Optional[int]:
    if not paddle.is_compiled_with_cuda():
        return None
    try:
        major, minor = paddle.device.cuda.get_device_capability()
        return int(major * 10 + minor)
    except Exception:
        return None


def weight_only_supported() -> Tuple[bool, str]:
    """Whether Paddle's fused weight-only int8/int4 GPU kernels can be used here (and why not)."""
    quant = getattr(paddle.nn, "quant", None)
    if quant is None or not all(hasattr(quant, n) for n in ("weight_quantize", "weight_only_linear")):
        return False, "paddle.nn.quant.weight_quantize/weight_only_linear not available in this Paddle"
    arch = _cuda_arch()
    if arch is None:
        return False, "Paddle is not compiled with CUDA or no GPU is visible"
    if arch not in _WEIGHT_ONLY_ARCHS:
        return False, f"GPU arch SM{arch} is not supported by weight_only_linear ({_WEIGHT_ONLY_ARCHS})"
    return True, ""


def weight_only_shape_ok(in_features: int, out_features: int) -> bool:
    """Shapes Paddle's weight-only kernels accept: ``weight_quantize`` rejects
    ``out_features % 16 != 0`` and its row interleaving works on 64-row tiles of
    ``in_features`` (the CPU reference kernel even hangs on other sizes)."""
    return in_features % 64 == 0 and out_features % 16 == 0


def _on_gpu(t: paddle.Tensor) -> bool:
    try:
        return bool(t.place.is_gpu_place())
    except Exception:
        return False


def _log_path_once(path: str, algo: str) -> None:
    key = (path, algo)
    if key not in _LOGGED_PATHS:
        _LOGGED_PATHS.add(key)
        logger.info("QuantizedLinear(%s): forward path = %s", algo, path)


def _build_lut(algo: str) -> np.ndarray:
    """[256, 2] float32: byte -> (value of high nibble, value of low nibble)."""
    code = F.code_book(algo)
    b = np.arange(256)
    return np.stack([code[b >> 4], code[b & 0x0F]], axis=1).astype(np.float32)


class _DequantMatmul(PyLayer):
    """y = x @ W with W re-dequantized in backward (no full-precision weight is saved).

    ``layer._dequant(path)`` returns ``(w, out_in)`` where ``w`` is ``[out, in]``
    if ``out_in`` else ``[in, out]``.  Only ``x`` receives a gradient.
    """

    @staticmethod
    def forward(ctx, x, layer, path):
        ctx.layer, ctx.path, ctx.x_dtype = layer, path, x.dtype
        w, out_in = layer._dequant(path)
        return paddle.matmul(x, w.astype(x.dtype), transpose_y=out_in)

    @staticmethod
    def backward(ctx, dy):
        w, out_in = ctx.layer._dequant(ctx.path)
        # dx = dy @ W^T ; W^T is the stored [out, in] matrix itself
        dx = paddle.matmul(dy, w.astype(dy.dtype), transpose_y=not out_in)
        return dx.astype(ctx.x_dtype)


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
        if algo not in F.SUPPORTED_ALGOS:
            raise ValueError(f"unknown weight_quantize_algo {algo!r}; supported: {list(F.SUPPORTED_ALGOS)}")
        if backend not in (BACKEND_PORTABLE, BACKEND_WEIGHT_ONLY):
            raise ValueError(f"backend must be {BACKEND_PORTABLE!r} or {BACKEND_WEIGHT_ONLY!r}, got {backend!r}")
        if backend == BACKEND_WEIGHT_ONLY and algo not in F.INT_ALGOS:
            raise ValueError(f"backend {BACKEND_WEIGHT_ONLY!r} only supports {F.INT_ALGOS}, got {algo!r}")
        F.check_shape(in_features, out_features, algo, block_size)
        if double_quant and algo not in F.BLOCK_ALGOS:
            raise ValueError(
                f"weight_double_quant is only defined for nf4/fp4, got algo={algo!r}. Set weight_double_quant=False."
            )
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.algo = algo
        self.block_size = int(block_size) if algo in F.BLOCK_ALGOS else None
        self.double_quant = bool(double_quant)
        self.double_quant_block_size = int(double_quant_block_size) if double_quant else None
        self.weight_dtype = _dtype_name(weight_dtype)
        self.compute_dtype = self.weight_dtype  # read by adapters.base.adapter_dtype
        self.backend = backend
        self.arch = arch
        self.last_path: Optional[str] = None

        out_f, in_f = self.out_features, self.in_features
        if backend == BACKEND_WEIGHT_ONLY:
            qshape = [out_f, in_f] if algo == "weight_only_int8" else [out_f // 2, in_f]
            self._add_buffer("quant_weight", np.zeros(qshape, np.int8))
            self._add_buffer("quant_scale", np.zeros([out_f], np.float32))
        else:
            if algo == "weight_only_int8":
                self._add_buffer("quant_weight", np.zeros([out_f, in_f], np.int8))
            else:
                self._add_buffer("quant_weight", np.zeros([out_f, in_f // 2], np.uint8))
            if algo in F.INT_ALGOS:
                self._add_buffer("quant_scale", np.zeros([out_f], np.float32))
            else:
                nblk = in_f // self.block_size
                if self.double_quant:
                    n2 = -(-(out_f * nblk) // self.double_quant_block_size)
                    self._add_buffer("qquant_scale", np.zeros([out_f, nblk], np.int8))
                    self._add_buffer("double_quant_scale", np.zeros([n2], np.float32))
                    self._add_buffer("quant_scale_offset", np.zeros([], np.float32))
                else:
                    self._add_buffer("quant_scale", np.zeros([out_f, nblk], np.float32))
            if algo != "weight_only_int8":
                # decoding table: not saved (persistable=False), but moved with the layer
                self.register_buffer("_lut", paddle.to_tensor(_build_lut(algo)), persistable=False)

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

    @classmethod
    def from_structure(
        cls, structure: Dict[str, Any], bias: Optional[paddle.Tensor] = None, weight_dtype: str = "float32", place=None
    ) -> "QuantizedLinear":
        """Build from a :func:`formats.quantize` result (portable layout)."""
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
        for name in ("quant_weight", "quant_scale", "qquant_scale", "double_quant_scale", "quant_scale_offset"):
            if name in structure:
                layer._add_buffer(name, np.asarray(structure[name]), place=place)
        if place is not None and hasattr(layer, "_lut"):
            layer.register_buffer("_lut", paddle.to_tensor(_build_lut(layer.algo), place=place), persistable=False)
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
        """Quantize ``linear.weight`` ([in, out]) and return the replacement layer.

        ``backend``: ``"auto"`` (Paddle's fused weight-only GPU layout for
        int8/int4 when the weight is on a supported GPU, else portable),
        ``"portable"`` or ``"paddle_weight_only"``.  The new layer shares
        ``linear.bias`` (set to ``stop_gradient=True``) and keeps no reference
        to ``linear.weight``.
        """
        if algo not in F.SUPPORTED_ALGOS:
            raise ValueError(f"unknown weight_quantize_algo {algo!r}; supported: {list(F.SUPPORTED_ALGOS)}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        weight = linear.weight
        if len(weight.shape) != 2:
            raise ValueError(f"expected a 2-D Linear weight, got shape {list(weight.shape)}")
        in_f, out_f = int(weight.shape[0]), int(weight.shape[1])
        F.check_shape(in_f, out_f, algo, block_size)
        wdtype = _dtype_name(weight.dtype)
        place = weight.place

        ok, why = weight_only_supported()
        shape_ok = weight_only_shape_ok(in_f, out_f)
        if backend == "auto":
            use = algo in F.INT_ALGOS and _on_gpu(weight) and ok and shape_ok
            backend = BACKEND_WEIGHT_ONLY if use else BACKEND_PORTABLE
        elif backend == BACKEND_WEIGHT_ONLY:
            if algo not in F.INT_ALGOS:
                raise ValueError(f"backend {BACKEND_WEIGHT_ONLY!r} only supports {F.INT_ALGOS}, got {algo!r}")
            if not shape_ok:
                raise ValueError(
                    f"backend {BACKEND_WEIGHT_ONLY!r} needs in_features % 64 == 0 and out_features % 16 == 0, "
                    f"got a Linear layer of shape [in_features={in_f}, out_features={out_f}]; use backend='portable'"
                )
            if not ok:
                raise RuntimeError(f"backend {BACKEND_WEIGHT_ONLY!r} unavailable: {why}")

        if backend == BACKEND_WEIGHT_ONLY:
            arch = _cuda_arch()
            kdtype = wdtype if wdtype in _LOW_PRECISION else ("bfloat16" if arch >= 80 else "float16")
            with paddle.no_grad():
                qw, scale = paddle.nn.quant.weight_quantize(weight.astype(kdtype), algo=algo, arch=arch)
            layer = cls(in_f, out_f, algo, bias_attr=linear.bias, weight_dtype=wdtype, backend=backend, arch=arch)
            qw.stop_gradient = True
            scale.stop_gradient = True
            layer.register_buffer("quant_weight", qw, persistable=True)
            layer.register_buffer("quant_scale", scale, persistable=True)
            return layer

        structure = F.quantize(weight, algo, block_size, double_quant, double_quant_block_size)
        return cls.from_structure(structure, bias=linear.bias, weight_dtype=wdtype, place=place)

    # ------------------------------------------------------------ dequantize
    def _block_scales(self) -> paddle.Tensor:
        """f32 scales used for decoding ([out] or [out, in // bs]), double quant undone."""
        if not self.double_quant:
            return self.quant_scale.astype("float32")
        q = self.qquant_scale.astype("float32").reshape([-1])
        n = q.shape[0]
        blk = self.double_quant_block_size
        pad = (-n) % blk
        if pad:
            q = paddle.concat([q, paddle.zeros([pad], dtype="float32")])
        s = (q.reshape([-1, blk]) * self.double_quant_scale.astype("float32").unsqueeze(1)).reshape([-1])[:n]
        return (s + self.quant_scale_offset.astype("float32")).reshape(self.qquant_scale.shape)

    def _dequant(self, path: str) -> Tuple[paddle.Tensor, bool]:
        """Dequantized weight for ``path``: ``(w, out_in)``; ``w`` is [out, in] if ``out_in`` else [in, out]."""
        out_f, in_f = self.out_features, self.in_features
        with paddle.no_grad(), paddle.amp.auto_cast(enable=False):
            if path == PATH_WEIGHT_DEQUANT:
                return self._weight_only_dequant(), False
            if path == PATH_PADDLESLIM:
                ops = paddleslim_ops()
                w = ops.dequant_blockwise(
                    self.quant_weight, None, self._block_scales().reshape([-1]), self.block_size, self.algo
                )
                return w.reshape([out_f, in_f]), True
            if self.algo == "weight_only_int8":
                return self.quant_weight.astype("float32") * self.quant_scale.astype("float32").unsqueeze(1), True
            idx = self.quant_weight.astype("int32").reshape([-1])
            vals = paddle.gather(self._lut, idx, axis=0).reshape([out_f, in_f])  # two values per byte
            scales = self._block_scales()
            if self.algo == "weight_only_int4":
                return vals * scales.unsqueeze(1), True
            nblk = in_f // self.block_size
            w = vals.reshape([out_f, nblk, self.block_size]) * scales.unsqueeze(2)
            return w.reshape([out_f, in_f]), True

    def _weight_only_dequant(self) -> paddle.Tensor:
        """[in, out] weight from Paddle's weight-only GPU layout."""
        quant = paddle.nn.quant
        try:
            w = quant.weight_dequantize(self.quant_weight, self.quant_scale, algo=self.algo)
            if list(w.shape) == [self.in_features, self.out_features]:
                return w
        except Exception:  # kernel not registered for this device / version
            pass
        # exact fallback: I @ W through the fused kernel
        kdtype = _dtype_name(self.quant_scale.dtype)
        if kdtype not in _LOW_PRECISION:
            kdtype = "float16"
        eye = paddle.eye(self.in_features, dtype="float32").astype(kdtype)
        return quant.weight_only_linear(
            eye,
            self.quant_weight,
            weight_scale=self.quant_scale.astype(kdtype),
            weight_dtype="int8" if self.algo == "weight_only_int8" else "int4",
            arch=self.arch,
        )

    def dequantize_weight(self, dtype: Optional[str] = None) -> paddle.Tensor:
        """The dequantized weight ``[in_features, out_features]`` (original dtype unless ``dtype``)."""
        path = PATH_WEIGHT_DEQUANT if self.backend == BACKEND_WEIGHT_ONLY else PATH_PORTABLE
        w, out_in = self._dequant(path)
        if out_in:
            w = w.transpose([1, 0])
        w = w.astype(_dtype_name(dtype) if dtype is not None else self.weight_dtype)
        w.stop_gradient = True
        return w

    def to_structure(self) -> Dict[str, Any]:
        """The portable-format dict (numpy) of this layer, as :func:`formats.quantize` returns."""
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
        for name in ("quant_weight", "quant_scale", "qquant_scale", "double_quant_scale", "quant_scale_offset"):
            t = self._buffers.get(name)
            if t is not None:
                s[name] = t.numpy()
        return s

    # ----------------------------------------------------------------- sizes
    def quantized_nbytes(self) -> int:
        """Bytes of the persistable quantized buffers (codes + scales; bias not counted)."""
        total = 0
        for name in ("quant_weight", "quant_scale", "qquant_scale", "double_quant_scale", "quant_scale_offset"):
            t = self._buffers.get(name)
            if t is not None:
                total += int(np.prod(t.shape)) * t.element_size()
        return total

    @property
    def num_weight_params(self) -> int:
        return self.in_features * self.out_features

    # --------------------------------------------------------------- forward
    def _select_path(self, x: paddle.Tensor) -> str:
        if self.backend == BACKEND_WEIGHT_ONLY:
            if not _on_gpu(x):
                raise RuntimeError(
                    "this QuantizedLinear holds Paddle's GPU weight-only layout (backend='paddle_weight_only') and "
                    "needs a GPU input; rebuild it with backend='portable' to run on CPU"
                )
            return PATH_WEIGHT_ONLY if _dtype_name(x.dtype) in _LOW_PRECISION else PATH_WEIGHT_DEQUANT
        if self.algo in F.BLOCK_ALGOS and _on_gpu(x) and paddleslim_ops() is not None:
            return PATH_PADDLESLIM
        return PATH_PORTABLE

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        path = self._select_path(x)
        if path == PATH_WEIGHT_ONLY:
            xd = x.dtype
            bias = self.bias.astype(xd) if self.bias is not None else None
            with paddle.amp.auto_cast(enable=False):
                out = paddle.nn.quant.weight_only_linear(
                    x,
                    self.quant_weight,
                    bias=bias,
                    weight_scale=self.quant_scale.astype(xd),
                    weight_dtype="int8" if self.algo == "weight_only_int8" else "int4",
                    arch=self.arch,
                )
        else:
            out = _DequantMatmul.apply(x, self, path)
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
