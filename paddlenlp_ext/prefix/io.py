"""Prefix directories in PaddleNLP's format, the trainer's save/resume hook, and run wiring.

A prefix directory (what PaddleNLP's ``PrefixModelForCausalLM.save_pretrained``
writes, and what ``prefix_path`` / a checkpoint holds):

    prefix_config.json           PrefixConfig fields (json, indent 2, sorted keys)
    prefix_model_state.pdparams  paddle.save of the encoder's state dict, PaddleNLP's
                                 ``nn.Sequential`` keys: "0.weight" [P, E] (embedding), and with
                                 prefix_projection "1.weight" [H_kv*D, M], "1.bias" [M],
                                 "3.weight" [M, 2*L*H_kv*D], "3.bias" [2*L*H_kv*D]
    pre_caches.npy               float [L, 2, H_kv, P, D]: every layer's prefix key (0) / value (1),
                                 for inference (not read back; recomputed from the weights)

Loading checks the config against the model and the tensors' keys and shapes
against the config, and names whatever does not fit.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import numpy as np
import paddle

from .config import (
    PAST_KEY_VALUES_NAME,
    PREFIX_WEIGHTS_NAME,
    ModelFacts,
    PrefixConfig,
    PrefixConfigError,
    prefix_config_for_model,
)
from .model import PrefixModel

#: our parameter name -> PaddleNLP's state key (index in its nn.Sequential(embedding, linear, tanh, linear, dropout))
STATE_KEYS = {
    "embedding.weight": "0.weight",
    "proj_in.weight": "1.weight",
    "proj_in.bias": "1.bias",
    "proj_out.weight": "3.weight",
    "proj_out.bias": "3.bias",
}


def prefix_state_dict(pm: PrefixModel) -> Dict[str, paddle.Tensor]:
    """The encoder's parameters under PaddleNLP's keys."""
    return {STATE_KEYS[name]: p for name, p in pm.prefix_encoder.state_dict().items()}


def save_prefix(pm: PrefixModel, directory: str) -> Dict[str, str]:
    """Write the three files of a prefix directory; returns {file kind: path}."""
    os.makedirs(directory, exist_ok=True)
    cfg = pm.prefix_config
    cfg.tensor_parallel_degree = ModelFacts.of(pm.config).tensor_parallel_degree  # as PaddleNLP writes it
    weights = os.path.join(directory, PREFIX_WEIGHTS_NAME)
    paddle.save(prefix_state_dict(pm), weights)
    cache = os.path.join(directory, PAST_KEY_VALUES_NAME)
    kv = pm.prefix_cache()  # [L, 2, H_kv, P, D]
    np.save(cache, (kv.astype("float32") if kv.dtype == paddle.bfloat16 else kv).numpy())  # numpy has no bf16
    return {"config": cfg.save(directory), "weights": weights, "past_key_values": cache}


def read_prefix_state(directory: str) -> Dict[str, np.ndarray]:
    path = os.path.join(directory, PREFIX_WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise PrefixConfigError(f"{directory!r} has no {PREFIX_WEIGHTS_NAME}")
    state = paddle.load(path, return_numpy=True)
    if not isinstance(state, dict):
        raise PrefixConfigError(f"{path}: expected a state dict, got {type(state).__name__}")
    return {k: np.asarray(v) for k, v in state.items()}


def load_prefix_weights(pm: PrefixModel, directory: str) -> None:
    """Set ``pm``'s encoder from ``directory``; its config must describe the same prefix."""
    saved = PrefixConfig.load(directory).validate()
    mine = pm.prefix_config
    for key in ("num_prefix_tokens", "num_hidden_layers", "hidden_size", "prefix_projection"):
        if getattr(saved, key) != getattr(mine, key):
            raise PrefixConfigError(
                f"{directory}: the saved prefix has {key}={getattr(saved, key)!r}, this model's "
                f"prefix {getattr(mine, key)!r}"
            )
    if saved.num_kv_heads != mine.num_kv_heads or (
        mine.prefix_projection and saved.prefix_projection_hidden_size != mine.prefix_projection_hidden_size
    ):
        raise PrefixConfigError(
            f"{directory}: the saved prefix's head count / projection size differ from this model's prefix"
        )
    state = read_prefix_state(directory)
    own = prefix_state_dict(pm)
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise PrefixConfigError(f"{directory}/{PREFIX_WEIGHTS_NAME}: missing keys {missing}, unexpected keys {extra}")
    for key, param in own.items():
        if list(state[key].shape) != list(param.shape):
            raise PrefixConfigError(
                f"{directory}/{PREFIX_WEIGHTS_NAME}: {key} has shape {list(state[key].shape)}, "
                f"expected {list(param.shape)}"
            )
    for key, param in own.items():
        param.set_value(paddle.to_tensor(state[key]).astype(param.dtype))


def load_prefix_model(model, directory: str, dtype: Optional[str] = None) -> PrefixModel:
    """Wrap ``model`` with the prefix saved in ``directory`` (its own config applies)."""
    cfg = PrefixConfig.load(directory).validate()
    if dtype is not None:
        cfg.dtype = dtype
    pm = PrefixModel(model, cfg)
    load_prefix_weights(pm, directory)
    return pm


class PrefixCheckpointIO:
    """FinetuneTrainer's ``weights_io``: a checkpoint / output directory holds the prefix only."""

    def save(self, model: PrefixModel, output_dir: str) -> None:
        save_prefix(model, output_dir)

    def load(self, model: PrefixModel, checkpoint_dir: str) -> None:
        load_prefix_weights(model, checkpoint_dir)


def attach_prefix(model, m, dtype: str):
    """training/run.py: (PrefixModel around ``model``, trainer weights_io, summary dict).

    ``m`` is the run's ModelArgument: a new prefix from its keys, or (``prefix_path``)
    the saved prefix, whose own settings apply."""
    if m.prefix_path:
        pm = load_prefix_model(model, m.prefix_path, dtype)
    else:
        cfg = prefix_config_for_model(
            ModelFacts.of(model.config),
            m.num_prefix_tokens,
            m.prefix_projection,
            m.prefix_projection_hidden_size,
            m.prefix_dropout,
            dtype,
        )
        pm = PrefixModel(model, cfg)
    c = pm.prefix_config
    info = {
        "num_prefix_tokens": c.num_prefix_tokens,
        "kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "prefix_projection": c.prefix_projection,
        "prefix_projection_hidden_size": c.prefix_projection_hidden_size,
        "prefix_dropout": c.prefix_dropout,
        "prefix_path": m.prefix_path,
    }
    return pm, PrefixCheckpointIO(), info
