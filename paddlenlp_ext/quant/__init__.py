"""Quantized frozen base linears for QLoRA (weight_only_int8 / weight_only_int4 / nf4 / fp4).

* :mod:`.formats` -- numpy quantize/dequantize, code books (no paddle import).
* :mod:`.linear`  -- :class:`QuantizedLinear` (paddle).
* :func:`quantize_model` -- replace the decoder ``nn.Linear`` layers of a model.

``SUPPORTED_ALGOS``, ``NF4_CODE``, ``FP4_CODE``, ``quantize`` and
``dequantize`` are importable without importing paddle; the paddle-side names
(``QuantizedLinear``, ``quantize_model``, ``quantized_state_bytes``) load
lazily on first access.
"""

from __future__ import annotations

from .formats import (  # noqa: F401
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DOUBLE_QUANT_BLOCK_SIZE,
    FP4_CODE,
    NF4_CODE,
    SUPPORTED_ALGOS,
    dequantize,
    quantize,
    structure_nbytes,
)

__all__ = [
    "SUPPORTED_ALGOS",
    "NF4_CODE",
    "FP4_CODE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DOUBLE_QUANT_BLOCK_SIZE",
    "DEFAULT_TARGET_MODULES",
    "quantize",
    "dequantize",
    "structure_nbytes",
    "QuantizedLinear",
    "quantize_model",
    "quantized_state_bytes",
]

# Default targets: every Linear inside a numbered block list (``llama.layers.0.mlp.up_proj``,
# ``gpt.decoder.layers.3...``, ``transformer.h.11...``), i.e. the decoder layers.
# Embeddings and lm_head are never replaced (they are not inside a numbered block,
# and names containing ``lm_head``/``embed`` are skipped even when a pattern matches).
DEFAULT_TARGET_MODULES = (r".*\.\d+\..*",)

_LAZY = {"QuantizedLinear", "quantize_model", "quantized_state_bytes"}


def __getattr__(name):  # PEP 562 lazy import of the paddle-side API
    if name in _LAZY:
        from . import _model, linear

        return {
            "QuantizedLinear": linear.QuantizedLinear,
            "quantize_model": _model.quantize_model,
            "quantized_state_bytes": _model.quantized_state_bytes,
        }[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
