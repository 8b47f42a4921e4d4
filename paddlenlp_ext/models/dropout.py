"""Per-model-family facts that config validation needs before any model loads.

Paddle-free: read by ``config.parse`` (checks) and ``training.run`` (applying).

Dropout: PaddleNLP's run_finetune copies ``hidden_dropout_prob`` and
``attention_probs_dropout_prob`` (default 0.1) onto every model config, but
PaddleNLP's Llama reads neither and Qwen2 reads only its own
``attention_dropout``, in the non-flash attention path.  So a dropout key
applies only where the family has a field that the model really reads;
anywhere else setting it is a config error instead of a silent no-op.
"""

import json
import os
from typing import Dict, Optional

from .family_table import FAMILIES

#: model_type -> {our config key: model config attribute that the model reads} (the family table's
#: ``dropout``; a family whose fields are not verified has none, so setting a dropout key is refused)
DROPOUT_FIELDS: Dict[str, Dict[str, str]] = {k: dict(f.dropout) for k, f in FAMILIES.items()}
#: dropout fields that PaddleNLP's fused/flash attention path ignores
FLASH_IGNORES = {"attention_dropout"}

DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob")


def read_model_type(model_dir: str) -> Optional[str]:
    """``model_type`` from ``model_dir/config.json`` (None if absent or unreadable)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def dropout_problem(model_type: Optional[str], key: str, value: Optional[float], flash: bool) -> Optional[str]:
    """Why ``key=value`` would not take effect on this family, or None if it does.

    >>> dropout_problem("llama", "hidden_dropout_prob", 0.1, flash=False)[:48]
    'llama models have no dropout that hidden_dropout'

    >>> dropout_problem("qwen2", "attention_probs_dropout_prob", 0.1, flash=False) is None
    True
    """
    if value is None or value == 0.0:
        return None  # unset, or "no dropout", which is what every family does without it
    fields = DROPOUT_FIELDS.get(model_type or "")
    if fields is None:
        return None  # unknown family: passed on as PaddleNLP does (see docs/config.md)
    target = fields.get(key)
    if target is None:
        return (
            f"{model_type} models have no dropout that {key} controls; remove the key "
            "(PaddleNLP accepts it and ignores it)"
        )
    if flash and target in FLASH_IGNORES:
        return (
            f"{key} sets {model_type}'s {target}, which PaddleNLP's flash attention path ignores; "
            "set use_flash_attention=false to train with attention dropout, or remove the key"
        )
    return None


def dropout_config_updates(model_type: Optional[str], values: Dict[str, Optional[float]]) -> Dict[str, float]:
    """Model config attributes to set for the dropout keys the user set.

    >>> dropout_config_updates("qwen2", {"attention_probs_dropout_prob": 0.1, "hidden_dropout_prob": None})
    {'attention_dropout': 0.1}
    """
    fields = DROPOUT_FIELDS.get(model_type or "")
    out = {}
    for key, value in values.items():
        if value is None:
            continue
        # unknown families get PaddleNLP's behaviour: the key is set under its own name
        target = key if fields is None else fields.get(key)
        if target is not None:
            out[target] = value
    return out
