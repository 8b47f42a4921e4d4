"""What this machine and Paddle build offer to ``QuantizedLinear``: probes (paddle).

Owns the real capability flags (:func:`probe_caps`: CUDA arch, Paddle's
weight-only ops), the lookup of PaddleSlim's compiled op module
(:func:`paddleslim_ops`), and the small tensor helpers shared by the layer
(dtype names, device test, one log line per forward path).  The decisions
over these flags live in :mod:`.dispatch` (pure) so they can be tested
without a GPU.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Optional

import paddle

from .dispatch import KernelCaps

logger = logging.getLogger("paddlenlp_ext.quant.linear")  # the name the forward-path log lines always had

_PADDLESLIM_MODULES = ("paddleslim_ops", "custom_setup_ops")
_LOGGED_PATHS: set = set()
_PADDLESLIM_OPS: Any = None
_PADDLESLIM_CHECKED = False


def _dtype_name(dtype) -> str:
    """'paddle.float32' / VarType.FP32 / 'float32' -> 'float32'."""
    s = str(dtype).lower().replace("paddle.", "").replace("vartype.", "").replace("datatype.", "")
    return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}.get(s, s)


# ------------------------------------------------------------------- probes
def find_paddleslim_ops():
    """Import PaddleSlim's compiled op module exposing ``dequant_blockwise``; ``None`` if there is none.

    PaddleNLP imports it as ``paddleslim_ops`` (built by PaddleSlim's
    ``csrc/setup_cuda.py``); older PaddleSlim trees named it ``custom_setup_ops``.
    A module that is installed but does not load (a broken or mismatched CUDA
    build) is skipped with a warning, so the portable path still runs.
    """
    for name in _PADDLESLIM_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the module exists but one of its own imports is missing
                logger.warning("PaddleSlim op module %s is installed but cannot be imported: %s", name, e)
            continue
        except (ImportError, OSError) as e:  # a compiled extension whose .so fails to load
            logger.warning("PaddleSlim op module %s is installed but cannot be loaded: %s", name, e)
            continue
        except RuntimeError as e:
            # Paddle's custom-op stub loads the .so through Paddle's dynload, which reports a
            # library that fails to dlopen as RuntimeError "(PreconditionNotMet) ..."
            if "PreconditionNotMet" not in str(e):
                raise
            logger.warning("PaddleSlim op module %s is installed but its library does not load: %s", name, e)
            continue
        if hasattr(mod, "dequant_blockwise"):
            return mod
    return None


def paddleslim_ops():
    """:func:`find_paddleslim_ops`, looked up once per process."""
    global _PADDLESLIM_OPS, _PADDLESLIM_CHECKED
    if not _PADDLESLIM_CHECKED:
        _PADDLESLIM_CHECKED = True
        _PADDLESLIM_OPS = find_paddleslim_ops()
    return _PADDLESLIM_OPS


def _paddleslim_available() -> bool:
    return paddleslim_ops() is not None


def _cuda_arch() -> Optional[int]:
    """SM version of the current GPU (``80`` for A100); None without a CUDA build or a visible GPU."""
    # get_device_capability raises on a CPU build (ValueError) and without a visible device,
    # so ask first instead of guessing from an exception
    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return None
    major, minor = paddle.device.cuda.get_device_capability()
    return int(major * 10 + minor)


def probe_caps() -> KernelCaps:
    """The real :class:`~.dispatch.KernelCaps` of this Paddle build and machine."""
    quant = getattr(paddle.nn, "quant", None)
    ops = quant is not None and all(hasattr(quant, n) for n in ("weight_quantize", "weight_only_linear"))
    return KernelCaps(weight_only_ops=ops, arch=_cuda_arch())


def _on_gpu(t: paddle.Tensor) -> bool:
    return bool(t.place.is_gpu_place())


def log_once(message: str) -> None:
    """Log a warning once per process and message (e.g. why a layer does not use a fused GPU kernel)."""
    if message not in _LOGGED_PATHS:
        _LOGGED_PATHS.add(message)
        logger.warning("QuantizedLinear: %s", message)


def _log_path_once(path: str, algo: str) -> None:
    key = (path, algo)
    if key not in _LOGGED_PATHS:
        _LOGGED_PATHS.add(key)
        logger.info("QuantizedLinear(%s): forward path = %s", algo, path)
