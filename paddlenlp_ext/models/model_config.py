"""The one place a model directory's ``config.json`` becomes a PaddleNLP config object.

PaddleNLP 3.0.0b4's ``AutoConfig`` reads transformers 4.x's spelling only: a config saved by
transformers 5.x (``rope_parameters``, ``dtype``, ``layer_types``) would build its model with
RoPE base 10000 and no scaling, silently.  :func:`load_model_config` reads the file through
:func:`.hf_config_read.canonical_config` first, refuses what cannot be read exactly
(:class:`ModelConfigError`, naming the key), and sets the canonical values on the config
PaddleNLP built, so every model, the trainer's saves and the merge see one spelling.
"""

from __future__ import annotations

import os
from typing import Any, Dict

from .hf_config_read import canonical_config, read_problems
from .hf_layout import read_config_json

#: the settings the canonical spelling fixes (what PaddleNLP's models read); rope_parameters is dropped
CANONICAL_KEYS = (
    "rope_theta",
    "rope_scaling",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
)


class ModelConfigError(ValueError):
    """A config.json whose settings cannot be read exactly; the message names the file and key."""


def canonical_model_config(model_dir: str) -> Dict[str, Any]:
    """``model_dir/config.json`` in transformers 4.55's spelling; ModelConfigError naming the key otherwise."""
    raw = read_config_json(model_dir)
    problems = read_problems(raw)
    if problems:
        raise ModelConfigError(f"{os.path.join(model_dir, 'config.json')}: " + "; ".join(problems))
    return canonical_config(raw)[0]


def load_model_config(model_dir: str, **kwargs: Any):
    """``AutoConfig.from_pretrained(model_dir, **kwargs)`` with the RoPE / sliding-window settings of
    config.json read as the transformers version that wrote it (either spelling)."""
    from paddlenlp.transformers import AutoConfig

    canon = canonical_model_config(model_dir)
    config = AutoConfig.from_pretrained(model_dir, **kwargs)
    # ... and the 4.x keys 5.x keeps elsewhere (partial_rotary_factor inside rope_parameters; Gemma 3's local theta
    # as rope_parameters.sliding_attention): absent from the file, so PaddleNLP's config has its class default
    raw = read_config_json(model_dir)
    # ... and a 4.x key 5.x saves as null under its new name (qwen3_moe's num_experts: hf_config_read.RENAMED_5X)
    lifted = [k for k in canon if (k not in raw or (raw[k] is None and canon[k] is not None)) and k != "torch_dtype"]
    for key in (*CANONICAL_KEYS, *lifted):
        if key in canon:
            setattr(config, key, canon[key])
    if hasattr(config, "rope_parameters"):  # one spelling on the object (and in what save_pretrained writes)
        delattr(config, "rope_parameters")
    return config
