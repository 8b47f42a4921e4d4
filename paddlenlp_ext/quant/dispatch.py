"""Which storage layout and which kernel a ``QuantizedLinear`` uses: pure decisions.

Owns the names of the storage backends and forward paths, and the three
decisions over capability flags (no paddle import, so every combination can be
tested on a CPU-only machine; ``linear.py`` probes the real flags):

* :func:`plan_build` -- at ``from_linear``: portable layout or Paddle's fused
  weight-only layout, and the ``arch`` / weight dtype handed to ``weight_quantize``;
* :func:`plan_kernel` -- at ``forward``: the path and the keyword arguments
  handed to the kernel (``weight_only_linear``, ``weight_dequantize`` or
  PaddleSlim's ``dequant_blockwise``);
* :func:`plan_dequant` -- for ``dequantize_weight`` (no input tensor involved).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from .formats import INT_ALGOS, KERNEL_DEQUANT_BLOCKWISE, KERNEL_WEIGHT_ONLY, QuantFormat

PATH_PORTABLE = "portable_dequant_matmul"
PATH_PADDLESLIM = "paddleslim_dequant_blockwise_matmul"
PATH_WEIGHT_ONLY = "paddle_weight_only_linear"
PATH_WEIGHT_DEQUANT = "paddle_weight_dequantize_matmul"

BACKEND_PORTABLE = "portable"
BACKEND_WEIGHT_ONLY = "paddle_weight_only"
BACKENDS = ("auto", BACKEND_PORTABLE, BACKEND_WEIGHT_ONLY)

# SM versions accepted by paddle.nn.quant.weight_quantize / weight_only_linear (Paddle 3.3)
WEIGHT_ONLY_ARCHS = (70, 75, 80, 86, 89, 90, 92, 100)
LOW_PRECISION = ("float16", "bfloat16")
# per-output-channel scales: weight_only_linear's group_size for "no groups"
_PER_CHANNEL = -1

Plan = Tuple[str, Dict[str, Any]]


@dataclass(frozen=True)
class KernelCaps:
    """What this Paddle build and machine offer to the weight-only kernels."""

    #: ``paddle.nn.quant`` has ``weight_quantize`` and ``weight_only_linear``
    weight_only_ops: bool
    #: SM version of the current GPU (``80`` for A100); None: no CUDA build or no visible GPU
    arch: Optional[int]


@dataclass(frozen=True)
class BuildPlan:
    """How :meth:`QuantizedLinear.from_linear` stores the weight."""

    backend: str
    #: weight-only layout: the ``arch`` given to ``weight_quantize`` (and later to the kernel)
    arch: Optional[int] = None
    #: weight-only layout: dtype the weight is cast to before ``weight_quantize`` (the scale dtype)
    quantize_dtype: Optional[str] = None
    #: ``backend="auto"`` took the portable layout for a weight on a GPU although the format has a fused
    #: kernel: why (logged by the layer); '' otherwise
    reason: str = ""


def weight_only_supported(caps: KernelCaps) -> Tuple[bool, str]:
    """Whether Paddle's fused weight-only int8/int4 GPU kernels can be used (and why not)."""
    if not caps.weight_only_ops:
        return False, "paddle.nn.quant.weight_quantize/weight_only_linear not available in this Paddle"
    if caps.arch is None:
        return False, "Paddle is not compiled with CUDA or no GPU is visible"
    if caps.arch not in WEIGHT_ONLY_ARCHS:
        return False, f"GPU arch SM{caps.arch} is not supported by weight_only_linear ({WEIGHT_ONLY_ARCHS})"
    return True, ""


def weight_only_shape_problem(fmt: QuantFormat, in_features: int, out_features: int) -> str:
    """Why Paddle's weight-only kernels cannot take a ``[in, out]`` weight of ``fmt`` ('' if they can).

    The shape checks of Paddle 3.3's infer-meta functions:

    * ``weight_quantize`` (x ``[in, out]``): ``in % 64 == 0`` and ``out % 16 == 0``
      ("The first dimension of input must be divisible by 64", "The second
      dimension of input must be divisible by 16"); its row interleaving works
      on 64-row tiles (the CPU reference kernel even crashes on other sizes);
    * ``weight_only_linear`` (the stored weight, int8 ``[out, in]``, int4
      ``[out / 2, in]``): both dimensions ``% 16 == 0`` -- so int4 needs
      ``out % 32 == 0``, which ``weight_quantize`` alone would not catch.
    """
    out_mult = 16 * 8 // fmt.bits  # int8: 16, int4: 32 (two output channels per stored row)
    if in_features % 64 == 0 and out_features % out_mult == 0:
        return ""
    return (
        f"Paddle's weight-only kernels need in_features % 64 == 0 and out_features % {out_mult} == 0 for "
        f"{fmt.name} (weight_quantize: in % 64, out % 16; weight_only_linear: the stored "
        f"[out * {fmt.bits} / 8, in] weight % 16 in both dimensions), got a Linear layer of shape "
        f"[in_features={in_features}, out_features={out_features}]"
    )


def weight_only_shape_ok(fmt: QuantFormat, in_features: int, out_features: int) -> bool:
    """:func:`weight_only_shape_problem` is empty."""
    return not weight_only_shape_problem(fmt, in_features, out_features)


def plan_build(
    fmt: QuantFormat,
    backend: str,
    in_features: int,
    out_features: int,
    weight_dtype: str,
    weight_on_gpu: bool,
    caps: KernelCaps,
) -> BuildPlan:
    """Storage layout for a ``[in_features, out_features]`` weight of ``weight_dtype``.

    ``backend="auto"`` takes the weight-only layout only when everything fits
    (int8/int4, weight on a supported GPU, kernel-friendly shape);
    ``"paddle_weight_only"`` raises (``ValueError`` / ``RuntimeError``) when it cannot.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    ok, why = weight_only_supported(caps)
    fused = fmt.gpu_kernel == KERNEL_WEIGHT_ONLY
    shape_why = weight_only_shape_problem(fmt, in_features, out_features) if fused else ""
    if backend == "auto":
        if not (fused and weight_on_gpu):
            return BuildPlan(BACKEND_PORTABLE)
        if not ok or shape_why:  # a fused format on a GPU that cannot use the kernel: say why
            return BuildPlan(
                BACKEND_PORTABLE,
                reason=f"{fmt.name}: portable layout instead of '{BACKEND_WEIGHT_ONLY}': {why or shape_why}",
            )
        backend = BACKEND_WEIGHT_ONLY
    elif backend == BACKEND_WEIGHT_ONLY:
        if not fused:
            raise ValueError(f"backend {BACKEND_WEIGHT_ONLY!r} only supports {INT_ALGOS}, got {fmt.name!r}")
        if shape_why:
            raise ValueError(f"backend {BACKEND_WEIGHT_ONLY!r}: {shape_why}; use backend='portable'")
        if not ok:
            raise RuntimeError(f"backend {BACKEND_WEIGHT_ONLY!r} unavailable: {why}")
    if backend == BACKEND_PORTABLE:
        return BuildPlan(BACKEND_PORTABLE)
    # weight_quantize needs fp16/bf16; an fp32 weight goes through bf16 where the GPU has it (SM80+)
    low = weight_dtype if weight_dtype in LOW_PRECISION else ("bfloat16" if caps.arch >= 80 else "float16")
    return BuildPlan(BACKEND_WEIGHT_ONLY, arch=caps.arch, quantize_dtype=low)


def plan_dequant(fmt: QuantFormat, backend: str, arch: Optional[int]) -> Plan:
    """Path + kernel arguments that rebuild the float weight of a layer stored with ``backend``.

    The weight-only layout is decoded by ``weight_dequantize(algo=...)`` or, where
    that kernel is missing, by ``weight_only_linear(I, weight_dtype=, arch=, group_size=)``.
    """
    if backend == BACKEND_WEIGHT_ONLY:
        return PATH_WEIGHT_DEQUANT, {
            "algo": fmt.name, "weight_dtype": fmt.kernel_weight_dtype, "arch": arch, "group_size": _PER_CHANNEL,
        }  # fmt: skip
    return PATH_PORTABLE, {}


def plan_kernel(
    fmt: QuantFormat,
    backend: str,
    *,
    x_on_gpu: bool,
    x_dtype: Optional[str],
    arch: Optional[int],
    block_size: Optional[int],
    paddleslim: Callable[[], bool],
    in_features: Optional[int] = None,
) -> Plan:
    """The forward path for an input ``x`` and the keyword arguments for its kernel.

    Args:
        fmt, backend, arch, block_size: the layer's format, storage backend,
            ``weight_quantize`` arch and nf4/fp4 block size.
        x_on_gpu: the input lives on a GPU.
        x_dtype: the input's dtype name; None for "not known yet" (the plan
            ``quantize_model`` reports), which assumes the fp16/bf16 activations
            the fused kernel is for.
        paddleslim: whether PaddleSlim's ``dequant_blockwise`` op is importable;
            called only when the answer matters (it may try an import).
        in_features: the layer's input size.  PaddleSlim's kernel decodes flat
            blocks, which are our per-channel blocks only when ``block_size``
            divides ``in_features``; other shapes take the portable path
            (None: not known, assumed to divide).

    Returns ``(path, kwargs)``: ``weight_only_linear(x, w, bias, weight_scale, **kwargs)``,
    ``dequant_blockwise(w, kwargs["code"], scales, kwargs["blocksize"], kwargs["quant_type"])``,
    the :func:`plan_dequant` arguments, or ``{}`` for the portable path.
    """
    if backend == BACKEND_WEIGHT_ONLY:
        if not x_on_gpu:
            raise RuntimeError(
                "this QuantizedLinear holds Paddle's GPU weight-only layout (backend='paddle_weight_only') and "
                "needs a GPU input; rebuild it with backend='portable' to run on CPU"
            )
        if x_dtype is None or x_dtype in LOW_PRECISION:
            return PATH_WEIGHT_ONLY, {"weight_dtype": fmt.kernel_weight_dtype, "arch": arch, "group_size": _PER_CHANNEL}
        return plan_dequant(fmt, backend, arch)  # the fused kernel has no fp32 variant
    flat = in_features is None or (block_size is not None and in_features % block_size == 0)
    if fmt.gpu_kernel == KERNEL_DEQUANT_BLOCKWISE and x_on_gpu and flat and paddleslim():
        # as PaddleSlim's own nf4/fp4 callers do: no code tensor, the format is named by quant_type
        return PATH_PADDLESLIM, {"code": None, "blocksize": block_size, "quant_type": fmt.name}
    return PATH_PORTABLE, {}
