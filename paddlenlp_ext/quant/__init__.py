"""Quantized frozen base linears for QLoRA (weight_only_int8 / weight_only_int4 / nf4 / fp4).

* :mod:`.formats`  -- the format table (one ``QuantFormat`` per algo), code books, shape checks (no paddle).
* :mod:`.codec`    -- numpy quantize / dequantize, double quantization, error bounds (no paddle import).
* :mod:`.encode`   -- the vectorized numpy encoders behind ``quantize`` (no paddle import).
* :mod:`.decode`   -- the fast numpy decoder a CPU forward uses (no paddle import).
* :mod:`.dispatch` -- which layout and kernel path a layer uses, as pure functions (no paddle import).
* :mod:`.probe`    -- what this machine offers (CUDA arch, PaddleSlim's ops) (paddle).
* :mod:`.dequant`  -- the paddle-side decoders and the matmul PyLayer that frees the weight (paddle).
* :mod:`.linear`   -- :class:`QuantizedLinear` (paddle).
* :mod:`.parallel_linear` -- :class:`QuantizedParallelLinear`, the QLoRA base that quantizes each rank's
  weight shard of a tensor-parallel linear (paddle).

Which layers of a model are quantized (the family's decoder linears) is the model's business:
``models.quantize`` (:func:`quantize_model`, :func:`select_targets`, :func:`amp_excluded_layers`).

The numpy API (``SUPPORTED_ALGOS``, ``FORMATS``, ``NF4_CODE``, ``FP4_CODE``,
``quantize``, ``dequantize``, ...) is importable without importing paddle; the
paddle-side name ``QuantizedLinear`` loads lazily on first access.
"""

from __future__ import annotations

from ..lazy import lazy_exports
from . import codec, formats
from .codec import *  # noqa: F401,F403  (re-export: the numpy API is defined once, in the modules' __all__)
from .formats import *  # noqa: F401,F403

# paddle-side names -> the module that defines them (imported on first access)
_LAZY = {
    "QuantizedLinear": "linear",
}

__all__ = [*formats.__all__, *codec.__all__, *_LAZY]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)  # the paddle-side API, imported on first use
