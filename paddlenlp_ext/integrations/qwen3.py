"""Qwen3-MoE in PaddleNLP's layout (``paddlenlp_ext.models.qwen3``) made known to PaddleNLP 3.0.0b4's Auto classes.

Dense qwen3 trains on our decoder (``integrations/decoder.py`` registers it); ``models/qwen3``'s dense classes
stay as the base of its Qwen3-MoE, which this module registers, with Qwen2's tokenizers for both configs.

PaddleNLP has no public way to add a model family to ``AutoModelForCausalLM``;
its ``_get_model_class_from_config`` finds the class by matching the config's
``architectures[0]`` against the keys of ``auto.modeling.MAPPING_NAMES``
(``"Qwen2" -> "qwen2"``), then looks the task class up in the Auto class's
``_name_mapping`` and imports ``paddlenlp.transformers.<module>.modeling``.
:func:`register_qwen3` therefore

* registers ``Qwen3MoeConfig`` for ``model_type: "qwen3_moe"`` (``AutoConfig.register``, public), and Qwen2's
  tokenizers for it and for ``Qwen3Config`` (``AutoTokenizer.register``, public);
* adds ``"Qwen3Moe" -> "qwen3_moe"`` to ``MAPPING_NAMES`` and the ``Qwen3MoeModel`` /
  ``Qwen3MoeForCausalLM`` entries to ``AutoModel`` / ``AutoModelForCausalLM``'s ``_name_mapping``;
* makes ``paddlenlp.transformers.qwen3_moe`` / ``.modeling`` / ``.configuration`` resolve to
  ``models/qwen3/moe.py`` (``sys.modules``), which is where the Auto classes import the class from.

All additions are new keys: no PaddleNLP behaviour for another family changes,
so this is a registration done once (idempotent), not a patch in a context.

``RELIED_ON`` also lists the Qwen2 pieces ``models/qwen3/modeling.py`` builds on
(constructors and forwards whose call shapes the subclasses depend on).
"""

from __future__ import annotations

import sys

from paddlenlp.transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
from paddlenlp.transformers.auto import modeling as auto_modeling

from .versions import check_versions

check_versions()

__all__ = ["register_qwen3", "is_registered", "RELIED_ON"]

RELIED_ON = [
    ("paddlenlp.transformers.auto.modeling", "MAPPING_NAMES", None),
    ("paddlenlp.transformers.AutoModelForCausalLM", "_name_mapping", None),
    ("paddlenlp.transformers.AutoModel", "_name_mapping", None),
    ("paddlenlp.transformers.AutoModelForCausalLM", "_get_model_class_from_config",
     ("pretrained_model_name_or_path", "config_file_path", "config")),
    ("paddlenlp.transformers.AutoConfig", "register", ("model_type", "config", "exist_ok")),
    ("paddlenlp.transformers.AutoTokenizer", "register",
     ("config_class", "slow_tokenizer_class", "fast_tokenizer_class", "exist_ok")),
    # the Qwen2 pieces the Qwen3 subclasses call or inherit
    ("paddlenlp.transformers.qwen2.modeling", "scaled_dot_product_attention",
     ("query_states", "config", "key_states", "value_states", "attention_mask", "output_attentions",
      "attn_mask_startend_row_indices", "training", "sequence_parallel", "skip_recompute")),
    ("paddlenlp.transformers.qwen2.modeling", "apply_rotary_pos_emb", ("q", "k", "cos", "sin", "position_ids")),
    ("paddlenlp.transformers.qwen2.modeling", "repeat_kv", ("hidden_states", "n_rep")),
    ("paddlenlp.transformers.qwen2.modeling.Qwen2RotaryEmbedding", "__init__",
     ("self", "dim", "max_position_embeddings", "base")),
    ("paddlenlp.transformers.qwen2.modeling.Qwen2DecoderLayer", "forward",
     ("self", "hidden_states", "position_ids", "attention_mask", "output_attentions", "past_key_value", "use_cache",
      "attn_mask_startend_row_indices", "kwargs")),
    ("paddlenlp.transformers.qwen2.modeling.Qwen2Attention", "forward",
     ("self", "hidden_states", "position_ids", "past_key_value", "attention_mask", "output_attentions", "use_cache",
      "attn_mask_startend_row_indices", "kwargs")),
    ("paddlenlp.transformers.qwen2.modeling.Qwen2MLP", "__init__", ("self", "config", "is_shared", "skip_recompute_ops")),
    ("paddlenlp.transformers.qwen2.modeling.Qwen2LMHead", "__init__",
     ("self", "config", "embedding_weights", "transpose_y")),
    ("paddlenlp.transformers.qwen2.modeling.Qwen2Model", "forward",
     ("self", "input_ids", "position_ids", "attention_mask", "inputs_embeds", "use_cache", "past_key_values",
      "output_attentions", "output_hidden_states", "return_dict", "attn_mask_startend_row_indices")),
    ("paddlenlp.transformers.qwen2.modeling.Qwen2ForCausalLM", "forward",
     ("self", "input_ids", "position_ids", "attention_mask", "inputs_embeds", "labels", "use_cache",
      "past_key_values", "output_attentions", "output_hidden_states", "return_dict",
      "attn_mask_startend_row_indices")),
    ("paddlenlp.transformers.refined_recompute", "get_skip_recompute_ops", ("config", "layer_idx")),
]  # fmt: skip

#: sys.modules aliases the Auto classes import from (each names models/qwen3/moe.py)
_MODULES = (
    "paddlenlp.transformers.qwen3_moe",
    "paddlenlp.transformers.qwen3_moe.modeling",
    "paddlenlp.transformers.qwen3_moe.configuration",
)
#: MAPPING_NAMES key (architecture prefix) -> model_type / module name; dense qwen3 trains on our decoder
#: (integrations/decoder.py registers it), so only Qwen3-MoE's PaddleNLP layout resolves to models/qwen3
_FAMILIES = {"Qwen3Moe": "qwen3_moe"}


def is_registered() -> bool:
    return auto_modeling.MAPPING_NAMES.get("Qwen3Moe") == "qwen3_moe"


def register_qwen3(config_cls, moe_config_cls, moe_module) -> None:
    """Make ``model_type: "qwen3"`` / ``architectures: ["Qwen3ForCausalLM"]`` resolve to our classes in
    ``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM`` (``from_pretrained`` / ``from_config``) and
    ``AutoTokenizer`` (Qwen2's tokenizers).  Idempotent.  The classes are the caller's
    (``models.registration.register_qwen3`` passes ``Qwen3Config``, ``Qwen3MoeConfig`` and
    ``models/qwen3/moe.py``)."""
    if is_registered():
        return
    from paddlenlp.transformers import Qwen2Tokenizer, Qwen2TokenizerFast

    for alias in _MODULES:
        sys.modules.setdefault(alias, moe_module)
    AutoConfig.register("qwen3_moe", moe_config_cls, exist_ok=True)
    for cls in (moe_config_cls, config_cls):
        AutoTokenizer.register(
            cls, slow_tokenizer_class=Qwen2Tokenizer, fast_tokenizer_class=Qwen2TokenizerFast, exist_ok=True
        )
    for prefix, module in _FAMILIES.items():
        for auto_cls, task in ((AutoModel, "Model"), (AutoModelForCausalLM, "ForCausalLM")):
            auto_cls._name_mapping[f"{prefix}Model_Import_Class"] = prefix + task
            auto_cls._name_mapping[prefix + task] = module
    auto_modeling.MAPPING_NAMES["Qwen3Moe"] = "qwen3_moe"  # last: is_registered() means all of the above is done
