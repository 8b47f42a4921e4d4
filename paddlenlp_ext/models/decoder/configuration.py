"""``DecoderConfig``: PaddleNLP's ``PretrainedConfig`` holding a transformers config.json as it is.

The config keeps every key of config.json (4.55 spelling) as an attribute; the decoder reads them
through the row of its ``model_type`` (``family_table.row(model_type).arch``) and
:func:`.rows.resolve`, so there is no per-architecture config code.  One subclass per model_type
(``Gemma2Config``, ...) fixes ``model_type`` and fills the row's transformers class defaults for
keys config.json leaves out (``save_pretrained`` drops values equal to the base class's default,
e.g. Gemma's ``tie_word_embeddings: true``).
"""

from __future__ import annotations

from typing import Dict

from paddlenlp.transformers.configuration_utils import PretrainedConfig

from ..family_table import row
from .rows import Arch, Knobs, resolve

__all__ = ["DecoderConfig", "config_class_for", "arch_of"]


def arch_of(model_type: str) -> Arch:
    family = row(model_type)
    if family is None or family.arch is None:
        raise ValueError(f"model_type {model_type!r} has no decoder row in the family table (models/family_table.py)")
    return family.arch


class DecoderConfig(PretrainedConfig):
    model_type = "decoder"

    def __init__(self, **kwargs):
        if type(self).model_type != "decoder":
            arch = arch_of(type(self).model_type)
            kwargs.setdefault("tie_word_embeddings", arch.tie_default)
            for key, value in arch.defaults:
                kwargs.setdefault(key, value)
        super().__init__(**kwargs)

    def knobs(self) -> Knobs:
        """The row of this model_type resolved against this config (``rows.Knobs``)."""
        return resolve(arch_of(self.model_type), self.to_dict())


_CONFIGS: Dict[str, type] = {}


def config_class_for(model_type: str) -> type:
    """``Gemma2Config`` etc.: DecoderConfig with ``model_type`` set (created once)."""
    if model_type not in _CONFIGS:
        from .modeling import class_prefix

        _CONFIGS[model_type] = type(
            f"{class_prefix(model_type)}Config", (DecoderConfig,), {"model_type": model_type, "__module__": __name__}
        )
    return _CONFIGS[model_type]
