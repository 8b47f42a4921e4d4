"""Our decoder's model_types (``paddlenlp_ext.models.decoder``) made known to PaddleNLP 3.0.0b4's Auto classes
(the classes are passed in by ``models/registration.py``, which owns them).

The same mechanism as :mod:`.qwen3` (read its docstring): ``AutoConfig.register`` (public) for
each model_type's config class; the architecture prefix (``"Gemma2"`` of ``Gemma2ForCausalLM``)
added to ``auto.modeling.MAPPING_NAMES``, which PaddleNLP matches longest-first as a substring of
``architectures[0]`` (so ``Gemma2`` wins over PaddleNLP's own ``Gemma``, ``Ernie4_5`` over
``Ernie``); the ``*Model`` / ``*ForCausalLM`` names in the Auto classes' ``_name_mapping``; and
``paddlenlp.transformers.<model_type>[.modeling|.configuration]`` aliased in ``sys.modules`` to a
module holding the generated classes, which is where the Auto classes import them from.

Only the family table's rows marked ``decoder`` are registered, but for llama and qwen2
(``KEEP_PADDLENLP_CONFIG``).  Where PaddleNLP has a module of the same name already imported
(``paddlenlp.transformers.llama``, ``qwen2``, ``mistral``, ``gemma``), the ``sys.modules`` alias is not
replaced and PaddleNLP's Auto model classes keep their own class: the toolkit builds those rows through
``models.loading.decoder_class_for``, never through the Auto classes.  Idempotent.  The
tokenizer is whatever ``tokenizer.json`` says (``models/tokenizer.py``), so no tokenizer is
registered here.
"""

from __future__ import annotations

import sys
import types

from paddlenlp.transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from paddlenlp.transformers.auto import modeling as auto_modeling

from .versions import check_versions

check_versions()

__all__ = ["register_decoder", "KEEP_PADDLENLP_CONFIG", "RELIED_ON"]

RELIED_ON = [
    ("paddlenlp.transformers.auto.modeling", "MAPPING_NAMES", None),
    ("paddlenlp.transformers.AutoModelForCausalLM", "_name_mapping", None),
    ("paddlenlp.transformers.AutoModel", "_name_mapping", None),
    ("paddlenlp.transformers.AutoModelForCausalLM", "_get_model_class_from_config",
     ("pretrained_model_name_or_path", "config_file_path", "config")),
    ("paddlenlp.transformers.AutoConfig", "register", ("model_type", "config", "exist_ok")),
    ("paddlenlp.transformers.model_utils.PretrainedModel", "_init_weights", None),
    ("paddlenlp.transformers.model_utils.PretrainedModel", "_get_name_mappings", ("config",)),
]  # fmt: skip

_DONE: set = set()


#: rows whose PaddleNLP classes stay in use beside the decoder (PaddleNLP's pipeline / tensor-parallel Llama and
#: Qwen2 classes and our patches of them, built from ``AutoConfig``): ``AutoConfig`` keeps PaddleNLP's config class
#: for them, as PaddleNLP's Auto model classes keep its model class (its module is imported by that name), so a
#: PaddleNLP model built from AutoConfig stays consistent; the toolkit converts the config for the decoder
#: (``models.loading.decoder_class_for``)
KEEP_PADDLENLP_CONFIG = ("llama", "qwen2")


def register_decoder(model_types, classes_for, class_prefix) -> None:
    """Make each of ``model_types`` / its ``architectures`` resolve to our classes in ``AutoConfig``,
    ``AutoModel`` and ``AutoModelForCausalLM`` (``from_pretrained`` / ``from_config``).  Idempotent.

    The classes are the caller's (``models.registration.register_decoder`` passes the decoder's rows,
    ``models.decoder.modeling.classes_for`` -> (config, body, causal LM) classes and ``class_prefix``)."""
    for model_type in model_types:
        if model_type in _DONE or model_type in KEEP_PADDLENLP_CONFIG:
            continue
        config_cls, body_cls, lm_cls = classes_for(model_type)
        module = types.ModuleType(f"paddlenlp.transformers.{model_type}")
        for cls in (config_cls, body_cls, lm_cls):
            setattr(module, cls.__name__, cls)
        module.modeling = module.configuration = module
        for name in (module.__name__, module.__name__ + ".modeling", module.__name__ + ".configuration"):
            sys.modules.setdefault(name, module)
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        prefix = class_prefix(model_type)
        for auto_cls, cls in ((AutoModel, body_cls), (AutoModelForCausalLM, lm_cls)):
            auto_cls._name_mapping[f"{prefix}Model_Import_Class"] = cls.__name__
            auto_cls._name_mapping[cls.__name__] = model_type
        auto_modeling.MAPPING_NAMES[prefix] = model_type
        _DONE.add(model_type)
