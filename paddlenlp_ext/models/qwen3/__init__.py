"""Qwen3 (dense) as our own Paddle model family, built on PaddleNLP's Qwen2 classes (docs/qwen3.md).

``configuration``  ``Qwen3Config``: Qwen2Config + ``head_dim``, ``attention_bias`` (model_type "qwen3")
``modeling``       ``Qwen3ForCausalLM`` / ``Qwen3Model``: per-head q/k RMSNorm, explicit head_dim

PaddleNLP's Auto classes learn the family from
:func:`paddlenlp_ext.integrations.qwen3.register_qwen3` (called where our
tools load models); the tokenizer is Qwen2's.
"""

from .configuration import Qwen3Config
from .modeling import Qwen3ForCausalLM, Qwen3Model, Qwen3PretrainedModel

__all__ = ["Qwen3Config", "Qwen3ForCausalLM", "Qwen3Model", "Qwen3PretrainedModel"]
