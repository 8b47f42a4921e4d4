"""Reward model directories (output and checkpoints): save, resume, and read back for scoring.

A reward directory holds, besides the tokenizer and training args the trainer writes:

    full fine-tuning   model.safetensors (+ config.json): the causal LM WITHOUT the score head, so
                       the directory still loads as an ordinary causal LM (predictor, merge, export)
    adapters           adapter_config.json + adapter_model.safetensors + the base's config.json
    always             score_head.safetensors   {"score_head.weight": float32 [hidden_size, 1]}
                       reward_config.json       what scoring needs to reproduce training's inputs:
                       {"kind": "reward_model", "hidden_size", "adapter": bool,
                        "base_model_name_or_path" (the model the adapter was trained on),
                        "chat_template" (bool: the tokenizer's template was used),
                        "chat_template_file" (a chat_template key's file, or null),
                        "max_seq_len", "max_prompt_len"}
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import numpy as np
import paddle

from .. import adapters as adapter_api
from .head import SCORE_HEAD_ATTR

SCORE_HEAD_FILE = "score_head.safetensors"
SCORE_HEAD_KEY = "score_head.weight"
REWARD_CONFIG_NAME = "reward_config.json"
REWARD_KIND = "reward_model"


def is_reward_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, REWARD_CONFIG_NAME))


def read_reward_config(path: str) -> Dict[str, Any]:
    """``reward_config.json`` of a reward directory; ValueError naming the file if absent or not one."""
    file = os.path.join(path, REWARD_CONFIG_NAME)
    if not os.path.isfile(file):
        raise ValueError(
            f"{path} is not a reward model directory: no {REWARD_CONFIG_NAME} (write one by training "
            "with llm/run_reward.py)"
        )
    with open(file, encoding="utf-8") as f:
        info = json.load(f)
    if not isinstance(info, dict) or info.get("kind") != REWARD_KIND:
        raise ValueError(f'{file}: not a reward model config (needs "kind": "{REWARD_KIND}")')
    return info


def write_reward_config(path: str, info: Dict[str, Any]) -> str:
    file = os.path.join(path, REWARD_CONFIG_NAME)
    with open(file, "w", encoding="utf-8") as f:
        json.dump({"kind": REWARD_KIND, **info}, f, indent=2, sort_keys=True)
        f.write("\n")
    return file


def save_score_head(model, path: str) -> str:
    from safetensors.numpy import save_file

    w = getattr(model, SCORE_HEAD_ATTR).weight  # [H, 1]
    file = os.path.join(path, SCORE_HEAD_FILE)
    save_file({SCORE_HEAD_KEY: np.ascontiguousarray(w.astype("float32").numpy())}, file, metadata={"format": "np"})
    return file


def load_score_head(model, path: str) -> None:
    """Set ``model.score_head`` from ``path/score_head.safetensors`` (shape checked)."""
    from safetensors.numpy import load_file

    file = os.path.join(path, SCORE_HEAD_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path}: no {SCORE_HEAD_FILE}; a reward directory keeps its score head there")
    tensors = load_file(file)
    if SCORE_HEAD_KEY not in tensors:
        raise ValueError(f"{file}: no tensor {SCORE_HEAD_KEY!r} (has {sorted(tensors)})")
    head = getattr(model, SCORE_HEAD_ATTR)
    w = tensors[SCORE_HEAD_KEY]
    if list(w.shape) != list(head.weight.shape):
        raise ValueError(
            f"{file}: {SCORE_HEAD_KEY} has shape {list(w.shape)}, the model's score head "
            f"{list(head.weight.shape)} (hidden_size {head.weight.shape[0]}): a different base model?"
        )
    head.weight.set_value(paddle.to_tensor(w).astype(head.weight.dtype))


def save_full_weights(model, path: str) -> None:
    """``save_pretrained`` of the causal LM without the score head (saved on its own)."""
    head = getattr(model, SCORE_HEAD_ATTR)
    delattr(model, SCORE_HEAD_ATTR)  # nn.Layer.__delattr__ removes the sublayer; the parameter object lives on
    try:
        model.save_pretrained(path, safe_serialization=True, max_shard_size="4GB")
    finally:
        setattr(model, SCORE_HEAD_ATTR, head)


def load_full_weights(model, path: str) -> None:
    """Every weight of the causal LM from ``path``'s model safetensors (strict: a missing one is an error)."""
    from safetensors import safe_open

    from ..training.trainer import safetensors_files

    own = {k: v for k, v in model.state_dict().items() if not k.startswith(SCORE_HEAD_ATTR + ".")}
    found = set()
    for file in safetensors_files(path):
        with safe_open(file, "np") as f:
            for name in f.keys():
                if name in own:
                    own[name].set_value(paddle.to_tensor(f.get_tensor(name)).astype(own[name].dtype))
                    found.add(name)
    missing = sorted(set(own) - found)
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} model weight(s), e.g. {missing[:3]}")


class RewardCheckpointIO:
    """FinetuneTrainer's ``weights_io`` for reward models: the output directory and every checkpoint
    hold the weights (full or adapter), the score head and ``reward_config.json``."""

    def __init__(self, adapter_config: Optional[Any], info: Dict[str, Any]):
        self.adapter_config = adapter_config
        self.info = dict(info, adapter=adapter_config is not None)

    def save(self, model, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        if self.adapter_config is not None:
            adapter_api.save_adapter(model, self.adapter_config, output_dir)
            model.config.save_pretrained(output_dir)  # the base's config travels with the adapter
        else:
            save_full_weights(model, output_dir)
        save_score_head(model, output_dir)
        write_reward_config(output_dir, self.info)

    def load(self, model, checkpoint_dir: str) -> None:
        if self.adapter_config is not None:
            adapter_api.load_adapter_weights(model, checkpoint_dir)
        else:
            load_full_weights(model, checkpoint_dir)
        load_score_head(model, checkpoint_dir)


def carry_reward_files(adapter_dir: str, dst: str) -> list:
    """Merging a reward adapter (``llm/merge_lora_params.py``): copy its score head into the merged
    directory and write its ``reward_config.json`` as a full model's, so the merged directory scores as the
    adapter did.  Returns the names written ([] for an ordinary adapter)."""
    import shutil

    if not is_reward_dir(adapter_dir):
        return []
    info = read_reward_config(adapter_dir)
    info.pop("kind", None)
    info.update(adapter=False, merged_from=os.path.abspath(adapter_dir))
    shutil.copy2(os.path.join(adapter_dir, SCORE_HEAD_FILE), os.path.join(dst, SCORE_HEAD_FILE))
    write_reward_config(dst, info)
    return [SCORE_HEAD_FILE, REWARD_CONFIG_NAME]
