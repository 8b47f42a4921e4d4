"""Our model classes made known to PaddleNLP's Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForCausalLM``, and Qwen2's tokenizers for the Qwen3 configs).

The classes are this package's (``decoder/``, ``qwen3/``); the mechanics, which touch PaddleNLP's private
Auto-class tables, are ``integrations/decoder.py`` and ``integrations/qwen3.py``, which are given the classes
here.  Call where a tool builds or loads a model by ``model_type`` / ``architectures``; both are idempotent.
"""

from __future__ import annotations

from typing import List

from .family_table import FAMILIES

__all__ = ["decoder_model_types", "register_decoder", "register_qwen3"]


def decoder_model_types() -> List[str]:
    """The model_types the toolkit builds with our decoder (family table rows with ``decoder=True``)."""
    return [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None]


def register_qwen3() -> None:
    """Qwen3-MoE in PaddleNLP's layout (``qwen3/moe.py``) and Qwen2's tokenizers for the Qwen3 configs."""
    from ..integrations.qwen3 import register_qwen3 as register
    from .qwen3 import moe
    from .qwen3.configuration import Qwen3Config

    register(Qwen3Config, moe.Qwen3MoeConfig, moe)


def register_decoder() -> None:
    """Every decoder row's ``model_type`` / ``architectures`` resolved to our decoder's classes."""
    from ..integrations.decoder import register_decoder as register
    from .decoder.modeling import class_prefix, classes_for

    register(decoder_model_types(), classes_for, class_prefix)
