"""Our one causal decoder: every architecture row of the family table on one set of Paddle classes.

``rows``           ``Arch`` (one row's knobs) and ``resolve`` (row + config.json -> ``Knobs``), paddle-free
``rope``           RoPE frequencies and scalings (numpy)
``attention``      masks (padding, dense, FlashMask start rows), windows, soft-capping, GQA
``layers``         norms, rotary, the MLP factory (``build_mlp``; MoE blocks register there), attention
``configuration``  ``DecoderConfig`` and the per-model_type config classes
``modeling``       ``DecoderModel`` / ``DecoderForCausalLM`` and the per-model_type classes (``classes_for``)

Importing this package does not import paddle; see docs/adding-a-model.md for adding a row.
"""

import importlib

__all__ = ["DecoderConfig", "DecoderModel", "DecoderForCausalLM", "classes_for", "config_class_for"]
_WHERE = {
    "DecoderConfig": ".configuration",
    "config_class_for": ".configuration",
    "DecoderModel": ".modeling",
    "DecoderForCausalLM": ".modeling",
    "classes_for": ".modeling",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
