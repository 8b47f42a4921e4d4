"""Config checks of the adapter keys: one method at a time, method-specific keys without their method,
aliases that differ, a saved adapter (``lora_path``) whose settings the config contradicts, and adapters with
quantized base weights.  No paddle; the builder the run uses (``adapters.config``) validates each method's own
keys, so what passes here is what runs."""

import dataclasses
from typing import Any, Dict, List

from ..adapters.methods import method
from ..adapters.config import ADAPTER_METHOD_KEYS, AdapterConfigError, adapter_config_from_args
from ..adapters.paddlenlp_format import adapter_config_file, saved_adapter_settings
from .schema import ModelArgument


def adapter_problems(m: ModelArgument, t: Dict[str, Any], methods: List[str], where: str) -> List[str]:
    """Problems of the adapter keys of ``m`` (``t``: the training keys; ``methods``: the adapter method keys
    set true).  E.g. ``lora: false, rslora: true`` -> ``["cfg.json: rslora=true needs lora=true"]``."""
    p = []
    if len(methods) > 1:
        p.append(f"{where}: only one adapter method at a time; got {' and '.join(methods)} both true")
    for key in ("rslora", "pissa"):
        if getattr(m, key) and not m.lora:
            p.append(f"{where}: {key}=true needs lora=true")
    if m.target_modules is not None and m.lora_target_modules is not None and m.target_modules != m.lora_target_modules:
        p.append(f"{where}: target_modules and lora_target_modules are aliases but differ; set only one")
    if m.lora_plus_scale != 1.0 and not m.lora:
        p.append(f"{where}: lora_plus_scale={m.lora_plus_scale} needs lora=true")
    if m.lora_alpha != -1 and m.lora_alpha <= 0:
        p.append(f"{where}: lora_alpha must be > 0 (or -1 for 2 x lora_rank); got {m.lora_alpha}")
    if m.lora_path and not methods:
        p.append(f"{where}: lora_path is set but no adapter method ({', '.join(ADAPTER_METHOD_KEYS)}) is true")
    if m.lokr_path and m.lora_path != m.lokr_path:  # _apply_aliases copied lokr_path unless lora_path was set
        p.append(f"{where}: lokr_path and lora_path are aliases but differ; set only one")
    if m.lokr_path and not m.lokr:
        p.append(f"{where}: lokr_path needs lokr=true")
    if m.lora_path and adapter_config_file(m.lora_path) is None:
        p.append(
            f"{where}: lora_path {m.lora_path!r} has no adapter_config.json (nor PaddleNLP's lora_config.json; "
            "is it an adapter directory?)"
        )
    elif m.lora_path and len(methods) == 1:
        p += adapter_mismatches(m, where)
    if len(methods) == 1 and not m.lora_path:
        try:  # the same builder the run uses: what validates here is what runs
            adapter_config_from_args(dataclasses.asdict(m))
        except AdapterConfigError as e:
            p.append(f"{where}: {e}")
    if m.weight_quantize_algo and not methods and t.get("do_train", False):
        p.append(
            f"{where}: weight_quantize_algo freezes the base weights; training needs an adapter "
            f"method ({' or '.join(k + '=true' for k in ADAPTER_METHOD_KEYS)}) "
            "(evaluation alone, do_train=false, works without adapters)"
        )
    if m.weight_double_quant and m.weight_quantize_algo in ("weight_only_int8", "weight_only_int4"):
        p.append(f"{where}: weight_double_quant applies to nf4/fp4 block scales, not to {m.weight_quantize_algo}")
    if m.weight_quantize_algo and m.pissa:
        p.append(f"{where}: pissa rewrites the base weights and cannot be used with weight_quantize_algo")
    return p


def adapter_mismatches(m: ModelArgument, where: str) -> List[str]:
    """A saved adapter (lora_path) keeps its own method and shape; config keys
    that say otherwise would be silently overruled, so they are errors."""
    try:  # ours, or a PaddleNLP lora_config.json converted (adapters.paddlenlp_format)
        saved = saved_adapter_settings(m.lora_path)
        mine = adapter_config_from_args(dataclasses.asdict(m)).to_dict()
    except (OSError, ValueError) as e:  # ValueError covers JSON and AdapterConfigError
        return [f"{where}: cannot check lora_path against the config: {e}"]
    row = method(mine["method"])  # the row names the flat key of each saved setting (adapters.methods)
    keys = {"method": row.mismatch_label or row.key}
    for field, key in row.flat_keys.items():
        # an unset alpha (lora_alpha -1, lokr_alpha 0) follows the saved adapter
        if field != "alpha" or getattr(m, key) not in (-1, *row.unset_alpha):
            keys[field] = key
    return [
        f"{where}: {name} says {mine[k]!r} but the adapter in lora_path was trained with {saved.get(k)!r}; "
        "make them match (the saved adapter's settings are the ones that apply)"
        for k, name in keys.items()
        if k in saved and saved[k] != mine[k]
    ]
