"""Qwen3 (dense) as our own Paddle model family, built on PaddleNLP's Qwen2 classes (docs/qwen3.md).

``configuration``  ``Qwen3Config``: Qwen2Config + ``head_dim``, ``attention_bias`` (model_type "qwen3")
``modeling``       ``Qwen3ForCausalLM`` / ``Qwen3Model``: per-head q/k RMSNorm, explicit head_dim
``moe``            Qwen3-MoE: top-k routed experts in place of the MLP (``Qwen3MoeForCausalLM``)
``support``        the settings it refuses, read without paddle (``unsupported_settings``)

Importing this package does not import paddle; the classes load on first access.

PaddleNLP's Auto classes learn the family from
:func:`paddlenlp_ext.models.registration.register_qwen3` (called where our
tools load models); the tokenizer is Qwen2's.
"""

import importlib

__all__ = [
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "Qwen3Model",
    "Qwen3PretrainedModel",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeModel",
]
_WHERE = {
    "Qwen3Config": ".configuration",
    "Qwen3ForCausalLM": ".modeling",
    "Qwen3Model": ".modeling",
    "Qwen3PretrainedModel": ".modeling",
    "Qwen3MoeConfig": ".moe",
    "Qwen3MoeForCausalLM": ".moe",
    "Qwen3MoeModel": ".moe",
}


def __getattr__(name):
    if name in _WHERE:  # lazily: config validation may import .support without paddle
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
