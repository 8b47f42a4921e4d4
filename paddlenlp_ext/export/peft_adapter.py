"""An adapter saved by run_finetune.py (or PaddleNLP) -> PEFT's adapter files.

``export_peft_adapter(adapter_dir, out_dir)`` writes ``adapter_config.json`` +
``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained`` loads onto
the base model in transformers layout (``export_hf_model`` of the original base).
Names: ``base_model.model.<transformers module>.<PEFT tensor>``, e.g.
``llama.layers.0.self_attn.q_proj`` + ``lora_A`` [in, r] ->
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` [r, in].

Per type (delta in transformers' [out, in] orientation):

* LoRA / LoRA+ / rsLoRA: ``lora_A.weight = A.T``, ``lora_B.weight = B.T``; ``use_rslora`` carries
  the scaling rule (LoRA+ only changed the learning rates).
* PiSSA: written as the plain LoRA on the ORIGINAL base that it is after training
  (PEFT's ``path_initial_model_for_weight_conversion``): rank 2r with
  ``A' = [A | A0]``, ``B' = [B ; -B0]``, so ``s' A'B' = s (AB - A0 B0)``; alpha is
  rescaled so that ``s' = s`` (2*alpha, or sqrt(2)*alpha with rsLoRA).
* VeRA: ``vera_lambda_d`` = d, ``vera_lambda_b`` = b, and the shared projections
  (regenerated from our seed) saved as ``base_model.vera_A`` [r, max_in] /
  ``base_model.vera_B`` [max_out, r] with ``save_projection=True`` (PEFT's own PRNG
  would draw different ones).
* LoKr: ``lokr_w1`` / ``lokr_w1_a/b`` / ``lokr_w2`` / ``lokr_w2_a/b`` as they are (both
  sides store Kronecker factors as [out_i, in_i] and split dimensions by the same rule);
  a module whose tensor set differs from the one PEFT would build is refused.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

import numpy as np

from ..adapters.methods import load_object
from ..merge.common import Log
from ..merge.formats import AdapterBundle
from ..merge.writer import make_temp_dir, publish, write_json
from ..models.hf_layout import HF_FAMILIES, hf_name, read_json_dict
from .hf_config import ExportError

PEFT_PREFIX = "base_model.model."


def _f32(name: str, arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind != "f":
        raise ExportError(f"adapter tensor {name!r} has dtype {arr.dtype}; expected floating point")
    return np.ascontiguousarray(arr, dtype=np.float32)


@dataclass(frozen=True)
class PeftMapping:
    """How one adapter method maps onto a PEFT type; a method's row names one (``peft_export``,
    ``adapters.methods``).  ``tensors(module, {suffix: array}, cfg)`` -> ``{PEFT tensor suffix: array}``;
    ``config(cfg)`` -> the PEFT config keys of that type; ``shared(cfg)`` -> model-level tensors."""

    peft_type: str
    tensors: Callable[[str, Dict[str, np.ndarray], Any], Dict[str, np.ndarray]]
    config: Callable[[Any], Dict[str, Any]]
    shared: Callable[[Any], Dict[str, np.ndarray]] = lambda cfg: {}


def _mapping(cfg) -> PeftMapping:
    row = cfg.row
    if row.peft_export is None:
        raise ExportError(f"adapter method {cfg.method!r} has no PEFT equivalent here")
    return load_object(row.peft_export)


def peft_tensors(bundle: AdapterBundle, model_type: str) -> Dict[str, np.ndarray]:
    """PEFT's state dict (name -> float32 array) for the adapter in ``bundle``.

    Example (LoRA, llama): module ``llama.layers.0.mlp.up_proj`` with ``lora_A`` [64, 4] and
    ``lora_B`` [4, 176] gives ``base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`` [4, 64]
    and ``....lora_B.weight`` [176, 4].
    """
    cfg = bundle.config
    mapping = _mapping(cfg)
    out: Dict[str, np.ndarray] = {}
    for mod, t in sorted(bundle.modules.items()):
        hf_mod = hf_name(mod + ".weight", model_type)[0][: -len(".weight")]
        t = {k: _f32(f"{mod}.{k}", v) for k, v in t.items()}
        for suffix, v in mapping.tensors(mod, t, cfg).items():
            out[PEFT_PREFIX + hf_mod + "." + suffix] = v
    out.update(mapping.shared(cfg))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _lora_tensors(mod: str, t: Dict[str, np.ndarray], cfg) -> Dict[str, np.ndarray]:
    if not cfg.pissa:
        return {"lora_A.weight": t["lora_A"].T, "lora_B.weight": t["lora_B"].T}
    # PiSSA -> LoRA of rank 2r on the original base
    a = np.concatenate([t["lora_A"], t["pissa_A0"]], axis=1)  # [in, 2r]
    b = np.concatenate([t["lora_B"], -t["pissa_B0"]], axis=0)  # [2r, out]
    return {"lora_A.weight": a.T, "lora_B.weight": b.T}


def _lora_config(cfg) -> Dict[str, Any]:
    r, alpha = cfg.r, float(cfg.alpha)
    if cfg.pissa:  # rank doubles; alpha keeps the scaling: alpha/r (or alpha/sqrt(r) with rsLoRA)
        r, alpha = 2 * r, alpha * (math.sqrt(2.0) if cfg.rslora else 2.0)
    return {
        "r": r,
        "lora_alpha": alpha,
        "use_rslora": bool(cfg.rslora),
        "lora_dropout": cfg.dropout,
        "init_lora_weights": True,
        "use_dora": False,
    }


def _vera_shared(cfg) -> Dict[str, np.ndarray]:
    from ..adapters.vera import vera_projections

    a, b = vera_projections(cfg.vera_seed, cfg.r, cfg.vera_max_in, cfg.vera_max_out)
    return {"base_model.vera_A": np.array(a), "base_model.vera_B": np.array(b)}


def _lokr_tensors(mod: str, t: Dict[str, np.ndarray], cfg) -> Dict[str, np.ndarray]:
    """PEFT builds ``lokr_w1`` (or ``_a/_b`` when decompose_both and r < max(out_m, in_m)/2) and
    ``lokr_w2`` (or ``_a/_b`` when r < max(out_n, in_n)/2): our saved set must be that one."""
    w1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
    w2 = t["lokr_w2"].shape if "lokr_w2" in t else (t["lokr_w2_a"].shape[0], t["lokr_w2_b"].shape[1])
    want = {"lokr_w1_a", "lokr_w1_b"} if cfg.lokr_decompose_both and cfg.r < max(w1) / 2 else {"lokr_w1"}
    want |= {"lokr_w2_a", "lokr_w2_b"} if cfg.r < max(w2) / 2 else {"lokr_w2"}
    if set(t) != want:
        raise ExportError(
            f"LoKr module {mod}: saved tensors {sorted(t)}, but PEFT's LoKr builds {sorted(want)} "
            "for these shapes; this adapter cannot be expressed as a PEFT LoKr"
        )
    return dict(t)  # both sides store the Kronecker factors as [out_i, in_i]


#: LoRA / rsLoRA / LoRA+ (PiSSA as the rank-2r LoRA it is on the original base)
LORA = PeftMapping("LORA", _lora_tensors, _lora_config)
VERA = PeftMapping(
    "VERA",
    lambda mod, t, cfg: {"vera_lambda_d": t["vera_d"], "vera_lambda_b": t["vera_b"]},
    lambda cfg: {
        "r": cfg.r,
        "projection_prng_key": cfg.vera_seed,
        "save_projection": True,
        "vera_dropout": cfg.dropout,
        "d_initial": cfg.vera_d_init,
        "init_weights": True,
    },
    _vera_shared,
)
LOKR = PeftMapping(
    "LOKR",
    _lokr_tensors,
    lambda cfg: {
        "r": cfg.r,
        "alpha": float(cfg.alpha),
        "decompose_both": cfg.lokr_decompose_both,
        "decompose_factor": cfg.lokr_factor,
        "rank_dropout": 0.0,
        "module_dropout": 0.0,
        "use_effective_conv2d": False,
        "init_weights": True,
    },
)


def peft_config(bundle: AdapterBundle, model_type: str, base_model_name_or_path: Any = None) -> Dict[str, Any]:
    """PEFT's adapter_config.json for the adapter in ``bundle`` (target_modules: the exact module names)."""
    cfg = bundle.config
    mapping = _mapping(cfg)
    targets = sorted(hf_name(m + ".weight", model_type)[0][: -len(".weight")] for m in bundle.modules)
    common = {
        "target_modules": targets,
        "base_model_name_or_path": base_model_name_or_path,
        "task_type": "CAUSAL_LM",
        "inference_mode": True,
        "modules_to_save": None,
        "bias": "none",
        "fan_in_fan_out": False,
    }
    return {**common, "peft_type": mapping.peft_type, **mapping.config(cfg)}


def export_peft_adapter(
    adapter_dir: str,
    out_dir: str,
    *,
    model_type: str = None,
    overwrite: bool = False,
    base_model_name_or_path: str = None,
    log: Log = print,
) -> Dict[str, Any]:
    """Write the adapter in ``adapter_dir`` in PEFT's format to ``out_dir``; returns the PEFT config.

    ``model_type``: the base's family (default: the adapter config's, else the config.json next to
    the adapter).  ``base_model_name_or_path``: recorded in adapter_config.json (PEFT loads that
    base by name when asked; give the transformers-layout export of the original base).
    """
    from safetensors.numpy import save_file

    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ExportError(f"output directory {out_dir} exists and is not empty; pass --overwrite to replace it")
    bundle = AdapterBundle.open(adapter_dir)
    mt = (
        model_type
        or bundle.config.model_type
        or read_json_dict(os.path.join(adapter_dir, "config.json"), ExportError).get("model_type")
    )
    if mt not in HF_FAMILIES:
        raise ExportError(
            f"adapter for model_type {mt!r}: the PEFT export covers the transformers-layout families "
            f"{sorted(HF_FAMILIES)} (pass model_type when the adapter does not record it)"
        )
    notes: List[str] = []
    if bundle.config.quantization:
        notes.append(
            f"trained on a {bundle.config.quantization.get('weight_quantize_algo')}-quantized base (QLoRA): "
            "PEFT applies it to whatever base it is given; load the base quantized the same way to match "
            "training, or in full precision as the merge does"
        )
    tensors = peft_tensors(bundle, mt)
    config = peft_config(bundle, mt, base_model_name_or_path)
    tmp = make_temp_dir(out_dir)
    try:
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        write_json(os.path.join(tmp, "adapter_config.json"), config)
        publish(tmp, out_dir)
    except BaseException:  # Ctrl-C included: never leave a half-written temp dir behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    desc = bundle.config.layer_type + ("+rslora" if bundle.config.rslora else "")
    log(
        f"[export] {adapter_dir} ({desc}, {len(bundle.modules)} modules) -> {out_dir}: PEFT {config['peft_type']}, "
        f"r={config['r']}, {len(tensors)} tensors" + "".join(f"; note: {n}" for n in notes)
    )
    return config
