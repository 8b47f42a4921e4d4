"""The adapter side of a merge: reading a saved adapter and checking it fits the base.

Owns: ``AdapterBundle`` (``adapter_config.json`` + ``adapter_model.safetensors``
read into ``{module: {suffix: array}}``; PaddleNLP's ``lora_config.json`` dirs via
``adapters.paddlenlp_format``), the tensor shapes each adapter type
implies for an ``[in, out]`` base weight, ``check_adapter_against_base`` and
``check_model_type`` (adapter config.json / adapter_config.json vs base config.json).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..adapters.config import CONFIG_NAME as ADAPTER_CONFIG_NAME
from ..adapters.config import WEIGHTS_NAME as ADAPTER_WEIGHTS_NAME
from ..adapters.config import AdapterConfig
from .common import MODEL_CONFIG_NAME, Log, MergeError
from .dtypes import FLOAT_TAGS
from .reader import Checkpoint, TensorEntry


@dataclass
class AdapterBundle:
    directory: str
    config: AdapterConfig
    modules: Dict[str, Dict[str, np.ndarray]]  # module -> {suffix: array}
    nbytes: int

    @classmethod
    def open(cls, directory: str) -> "AdapterBundle":
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        if not os.path.isdir(directory):
            raise MergeError(f"adapter directory {directory} does not exist")
        from ..adapters.paddlenlp_format import is_paddlenlp_adapter, read_paddlenlp_bundle

        if is_paddlenlp_adapter(directory):  # PaddleNLP's lora_config.json + lora_model_state.pdparams
            try:
                return cls(directory, *read_paddlenlp_bundle(directory))
            except (ValueError, OSError) as e:
                raise MergeError(str(e)) from None
        missing = [
            n for n in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME) if not os.path.isfile(os.path.join(directory, n))
        ]
        if missing:
            raise MergeError(f"adapter directory {directory} lacks {missing}")
        try:
            config = AdapterConfig.load(directory)
        except ValueError as e:
            raise MergeError(f"{os.path.join(directory, ADAPTER_CONFIG_NAME)}: {e}") from None
        try:
            tensors = load_file(os.path.join(directory, ADAPTER_WEIGHTS_NAME))
        # SafetensorError: corrupt or truncated file; OSError: unreadable; TypeError: numpy has no
        # dtype for the file's BF16 / F8 tensors (save_adapter writes float32, other tools may not)
        except (SafetensorError, OSError, TypeError) as e:
            raise MergeError(f"cannot read {os.path.join(directory, ADAPTER_WEIGHTS_NAME)}: {e}") from None
        if not tensors:
            raise MergeError(f"{os.path.join(directory, ADAPTER_WEIGHTS_NAME)} holds no tensors")
        modules: Dict[str, Dict[str, np.ndarray]] = {}
        for k, v in tensors.items():
            if "." not in k:
                raise MergeError(f"adapter tensor key {k!r} is not of the form '<module>.<suffix>'")
            mod, suffix = k.rsplit(".", 1)
            modules.setdefault(mod, {})[suffix] = v
        return cls(directory, config, modules, sum(int(v.nbytes) for v in tensors.values()))


def _expected_adapter_shapes(cfg: AdapterConfig, in_f: int, out_f: int) -> Dict[str, Tuple[int, ...]]:
    """{suffix: shape} the adapter tensors of one module must have for an [in_f, out_f] base weight
    (the method's row, ``adapters.methods``; LoKr's set of tensors depends on the shape)."""
    return dict(cfg.row.saved_shapes(cfg, in_f, out_f))


def check_adapter_against_base(bundle: AdapterBundle, ckpt: Checkpoint) -> Dict[str, TensorEntry]:
    """{module: base weight entry} after checking every module exists, is a 2-D float
    weight and every adapter tensor has the shape the base weight implies.
    Raises MergeError listing all problems."""
    from ..adapters.api import layer_class

    cfg = bundle.config
    if not cfg.row.supports.merge:  # the method's row (adapters.methods)
        raise MergeError(
            f"{cfg.row.title} adapters cannot be merged: {cfg.row.refusals.get('merge', 'no dense delta')}"
        )
    suffixes = set(layer_class(cfg).state_suffixes)
    by_name = {e.name: e for e in ckpt.entries}
    targets: Dict[str, TensorEntry] = {}
    missing, problems = [], []
    for mod in sorted(bundle.modules):
        got = bundle.modules[mod]
        key = f"{mod}.weight"
        ent = by_name.get(key)
        if ent is None:
            missing.append(key)
            continue
        need = suffixes  # the set may depend on the module's [in, out] shape (LoKr)
        if len(ent.shape) == 2:
            need = set(_expected_adapter_shapes(cfg, *ent.shape))
        if set(got) != need:
            problems.append(f"{mod}: adapter tensors {sorted(got)}, a {cfg.layer_type} adapter needs {sorted(need)}")
            continue
        if len(ent.shape) != 2:
            problems.append(f"{key}: base tensor has shape {list(ent.shape)}, expected a 2-D [in, out] Linear weight")
            continue
        if ent.dtype not in FLOAT_TAGS:
            problems.append(f"{key}: base tensor has dtype {ent.dtype}, not a floating-point weight")
            continue
        in_f, out_f = ent.shape
        for suffix, want in _expected_adapter_shapes(cfg, in_f, out_f).items():
            have = tuple(int(s) for s in got[suffix].shape)
            if have != want:
                problems.append(
                    f"{mod}.{suffix}: shape {list(have)} does not fit the base weight {key} of shape "
                    f"{list(ent.shape)} (expected {list(want)})"
                )
        if cfg.layer_type == "vera" and (
            cfg.vera_max_in is None or cfg.vera_max_out is None or in_f > cfg.vera_max_in or out_f > cfg.vera_max_out
        ):
            problems.append(
                f"{mod}: base weight {list(ent.shape)} exceeds vera_max_in/out "
                f"[{cfg.vera_max_in}, {cfg.vera_max_out}] of the adapter config"
            )
        targets[mod] = ent
    if missing:
        sample = [e.name for e in ckpt.entries[:6]]
        raise MergeError(
            f"{len(missing)} adapter module(s) have no weight in the base checkpoint {ckpt.directory}: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}. Base tensors look like {sample}. "
            "Is this adapter for a different model?"
        )
    if problems:
        raise MergeError(
            f"adapter {bundle.directory} does not match the base checkpoint {ckpt.directory} "
            f"({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:20])
            + ("\n  ..." if len(problems) > 20 else "")
        )
    return targets


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise MergeError(f"{path} is not valid JSON: {e}") from None


def check_model_type(base_dir: str, adapter_dir: str, cfg: AdapterConfig, log: Log) -> Dict[str, Any]:
    """The base config.json, after checking the adapter was trained on the same kind of model."""
    base_cfg = _read_json(os.path.join(base_dir, MODEL_CONFIG_NAME))
    if base_cfg is None:
        raise MergeError(f"{base_dir} has no {MODEL_CONFIG_NAME}; the merged model needs the base model's config")
    base_type = base_cfg.get("model_type")
    ad_cfg = _read_json(os.path.join(adapter_dir, MODEL_CONFIG_NAME))
    seen = []
    if ad_cfg is not None and ad_cfg.get("model_type") is not None:
        seen.append((os.path.join(adapter_dir, MODEL_CONFIG_NAME), ad_cfg.get("model_type")))
    if cfg.model_type:
        seen.append((os.path.join(adapter_dir, ADAPTER_CONFIG_NAME), cfg.model_type))
    for where, t in seen:
        if base_type is not None and t != base_type:
            raise MergeError(
                f"model_type mismatch: the adapter was trained on a {t!r} model ({where}) but the base model is "
                f"{base_type!r} ({os.path.join(base_dir, MODEL_CONFIG_NAME)})"
            )
    from ..models.family_table import FAMILIES, feature_problem
    from ..models.hf_config_read import read_problems

    why = feature_problem(base_type, "merge") if base_type in FAMILIES else None
    if why:  # the family table's word (docs/models.md), as training's config checks read it
        raise MergeError(why)
    problems = read_problems(base_cfg)  # e.g. a RoPE the merged model would not compute (either transformers spelling)
    if problems:
        raise MergeError(f"{os.path.join(base_dir, MODEL_CONFIG_NAME)}: " + "; ".join(problems))
    if not seen:
        log(f"[merge] note: {adapter_dir} has no config.json; model_type not cross-checked")
    if ad_cfg is not None:
        diffs = [
            k
            for k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")
            if k in ad_cfg and k in base_cfg and ad_cfg[k] != base_cfg[k]
        ]
        if diffs:
            raise MergeError(
                "the adapter's config.json and the base config.json disagree on "
                + ", ".join(f"{k} ({ad_cfg[k]} vs {base_cfg[k]})" for k in diffs)
            )
    return base_cfg
