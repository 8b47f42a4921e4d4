"""Adapters saved by PaddleNLP (``paddlenlp.peft``), read as paddlenlp_ext adapters.

Owns: recognising a PaddleNLP adapter directory, the mapping of PaddleNLP's
``lora_config.json`` onto :class:`~paddlenlp_ext.adapters.config.AdapterConfig`
(refusing, with the file and key named, every saved feature that has no
faithful equivalent here), and reading PaddleNLP's weight files into this
package's ``{f"{module}.{suffix}": float32 array}`` layout.  Small hooks in
``AdapterConfig.load``, ``adapters.api.read_adapter_tensors``,
``merge.formats.AdapterBundle.open`` and ``config.parse`` call in here, so a
PaddleNLP directory works as ``lora_path`` for training and evaluation and as
``--lora_path`` of the merge.  A directory holding our ``adapter_config.json``
is always read as ours.

PaddleNLP's format (``LoRAModel.save_pretrained``, paddlenlp 3.0.0b4)::

    lora_config.json            LoRAConfig.to_dict() + "scaling"
    lora_model_state.pdparams   paddle.save of the trainable state dict (under pipeline parallel one
                                lora_model_state.ppXX.pdparams per stage, read together), or the trainer's
                                peft_model.safetensors[.index.json] / peft_model.pdparams.index.json shards
    config.json                 the base model's config (model_type, quantization_config)

Mapping (the forward and the merged weight are the same function, so a merge
or an evaluation gives PaddleNLP's numbers):

* keys are identical: ``{module}.lora_A`` ``[in, r]`` and ``{module}.lora_B``
  ``[r, out]``, row-vector Paddle orientation in both (``h = x@W + s*x@A@B``),
  ``module`` the Linear's full sublayer name in the ``*ForCausalLM`` model
  (``llama.layers.0.self_attn.q_proj``);
* ``r`` -> ``r``, ``lora_alpha`` -> ``alpha``, ``rslora`` -> ``rslora``; both
  sides scale by ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), and the
  ``scaling`` PaddleNLP wrote is checked against ours;
* ``lora_dropout`` -> ``dropout``, ``lora_plus_scale`` -> ``lora_plus_scale``,
  ``target_modules`` (regexes, ``re.fullmatch`` on full sublayer names on both
  sides) -> ``target_modules``; ``base_model_name_or_path`` is kept;
* ``config.json`` next to it gives ``model_type`` and, for QLoRA, ``quantization``;
* ignored (no effect on the saved weights or the math): ``merge_weights``,
  ``dtype``, ``head_dim``, ``use_quick_lora`` (a fused kernel for
  ``x@(W + s*A@B)``), ``lorapro`` (an optimizer), ``mixer_num``;
* tensors become float32 (bf16 / fp16 files are widened exactly);
* saved per tensor-parallel rank (``lora_model_state.tpXX[_ppYY].pdparams``,
  ``tensor_parallel_degree > 1``): joined into one complete adapter
  (:mod:`.paddlenlp_tp`).

Refused (``PaddleNLPAdapterError``, a ``ValueError``): VeRA directories,
``pissa``, ``loraga``, ``use_mora``, ``lora_use_mixer``, ``trainable_bias``,
``trainable_modules``, ``enable_lora_list``, ``do_qat``,
``lora_alpha <= 0``, unknown keys with a
non-empty value, and state keys other than ``lora_A`` / ``lora_B``;
``REFUSED_LORA_KEYS`` and ``VERA_REFUSAL`` say why.

Importing this module never imports paddle; reading a ``.pdparams`` file does
(``paddle.load``).  A LoRA state is small: it is read whole.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .config import CONFIG_NAME, AdapterConfig, AdapterConfigError

# PaddleNLP's file names (paddlenlp.utils.env)
LORA_CONFIG_NAME = "lora_config.json"
LORA_WEIGHTS_NAME = "lora_model_state.pdparams"
SAFE_PEFT_WEIGHTS_NAME = "peft_model.safetensors"
SAFE_PEFT_WEIGHTS_INDEX_NAME = "peft_model.safetensors.index.json"
PADDLE_PEFT_WEIGHTS_INDEX_NAME = "peft_model.pdparams.index.json"
VERA_CONFIG_NAME = "vera_config.json"
VERA_WEIGHTS_NAME = "vera_model_state.pdparams"
MODEL_CONFIG_NAME = "config.json"

LORA_SUFFIXES = ("lora_A", "lora_B")


class PaddleNLPAdapterError(AdapterConfigError):
    """A PaddleNLP adapter directory that cannot be read faithfully (the message names file and key)."""


#: lora_config.json key -> why a non-default value is refused.
REFUSED_LORA_KEYS: Dict[str, str] = {
    "pissa": "PaddleNLP's PiSSA replaced every target weight by the residual W - A0@B0 of an SVD taken at the first "
    "forward pass and saved only the trained A and B: neither A0/B0 nor the residual is in the directory, so "
    "the model it trained cannot be rebuilt from it (paddlenlp_ext's PiSSA saves pissa_A0/pissa_B0 for this)",
    "loraga": "LoRA-GA saves [A | A0] and [B ; -B0] concatenations and re-initialises the base weight as W - s*A0@B0 "
    "when loading; there is no LoRA-GA adapter type here",
    "use_mora": "MoRA's square high-rank matrix with its rotary compression has no equivalent here",
    "lora_use_mixer": "MoSLoRA's extra [r, r] mixer (lora_AB) between A and B has no equivalent here",
    "trainable_bias": "PaddleNLP also trained bias vectors and saved them with the adapter; paddlenlp_ext adapters "
    "carry no biases, so the trained model cannot be reproduced",
    "trainable_modules": "PaddleNLP also trained these whole modules and saved their weights with the adapter; "
    "paddlenlp_ext adapters carry only adapter tensors",
    "enable_lora_list": "per-part LoRA on fused projections (MergedLoRALinear) has no equivalent here",
    "do_qat": "quantization-aware-training scales (weight_quanter / activation_quanter) are saved with the adapter "
    "and change the forward; not supported",
}

#: keys read (mapped or checked) or ignored because they do not change the saved adapter's math
_MAPPED_LORA_KEYS = (
    "r",
    "lora_alpha",
    "rslora",
    "lora_dropout",
    "lora_plus_scale",
    "target_modules",
    "base_model_name_or_path",
    "scaling",
    "tensor_parallel_degree",
)
_IGNORED_LORA_KEYS = ("merge_weights", "dtype", "head_dim", "use_quick_lora", "lorapro", "mixer_num")

VERA_REFUSAL = (
    "PaddleNLP VeRA adapters cannot be read: PaddleNLP's VeRA keeps a separate frozen vera_A [in, r] per layer that "
    f"{VERA_WEIGHTS_NAME} does not contain (only the trainable vera_B, vera_b, vera_d are saved), and with "
    "pissa_init=true (what PaddleNLP's run_finetune.py uses) it also replaced every target weight by an SVD residual "
    "that is not saved either. paddlenlp_ext's VeRA shares one pair of seeded random projections and trains only d "
    "and b, so there is no faithful mapping. Merge it with PaddleNLP's own tools, or train VeRA here (vera=true)."
)


# ------------------------------------------------------------------ detection
def paddlenlp_adapter_kind(directory: str) -> Optional[str]:
    """``"lora"`` or ``"vera"`` for a PaddleNLP adapter directory, else None.
    A directory with our ``adapter_config.json`` is ours (None)."""
    if not directory or not os.path.isdir(directory) or os.path.isfile(os.path.join(directory, CONFIG_NAME)):
        return None
    if os.path.isfile(os.path.join(directory, LORA_CONFIG_NAME)):
        return "lora"
    if os.path.isfile(os.path.join(directory, VERA_CONFIG_NAME)):
        return "vera"
    return None


def is_paddlenlp_adapter(directory: str) -> bool:
    return paddlenlp_adapter_kind(directory) is not None


def adapter_config_file(directory: str) -> Optional[str]:
    """The adapter config file of ``directory``: our ``adapter_config.json``, else
    PaddleNLP's ``lora_config.json`` / ``vera_config.json``; None if there is none."""
    if not directory:
        return None
    for name in (CONFIG_NAME, LORA_CONFIG_NAME, VERA_CONFIG_NAME):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def saved_adapter_settings(directory: str) -> Dict[str, Any]:
    """The saved adapter's settings as ``AdapterConfig`` keys, for comparing with
    a run config: our raw ``adapter_config.json``, or a PaddleNLP config converted.
    Raises OSError / ValueError (``PaddleNLPAdapterError`` for refused features)."""
    ours = os.path.join(directory, CONFIG_NAME)
    if os.path.isfile(ours) or not is_paddlenlp_adapter(directory):
        with open(ours, encoding="utf-8") as f:
            return json.load(f)
    return load_paddlenlp_config(directory).to_dict()


# --------------------------------------------------------------------- config
def _read_json(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise PaddleNLPAdapterError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise PaddleNLPAdapterError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def _is_empty(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == "" or v == [] or v == {}


def _model_config_fields(directory: str) -> Dict[str, Any]:
    """model_type and (QLoRA) quantization from the base config.json PaddleNLP saved next to the adapter."""
    path = os.path.join(directory, MODEL_CONFIG_NAME)
    if not os.path.isfile(path):
        return {}
    d = _read_json(path)
    out: Dict[str, Any] = {"model_type": d.get("model_type")}
    q = d.get("quantization_config")
    algo = q.get("weight_quantize_algo") if isinstance(q, dict) else None
    if algo:
        from ..quant.formats import SUPPORTED_ALGOS

        if algo not in SUPPORTED_ALGOS:
            raise PaddleNLPAdapterError(
                f"{path}: quantization_config.weight_quantize_algo={algo!r}: the adapter was trained on a base "
                f"quantized with an algorithm paddlenlp_ext does not implement (supported: {list(SUPPORTED_ALGOS)})"
            )
        quant = {"weight_quantize_algo": algo}
        for key in ("weight_blocksize", "weight_double_quant", "weight_double_quant_block_size"):
            if q.get(key) is not None:
                quant[key] = q[key]
        out["quantization"] = quant
    return out


def load_paddlenlp_config(directory: str) -> AdapterConfig:
    """The :class:`AdapterConfig` equivalent to PaddleNLP's ``lora_config.json`` in
    ``directory`` (see the module docstring); raises ``PaddleNLPAdapterError``."""
    kind = paddlenlp_adapter_kind(directory)
    if kind == "vera":
        raise PaddleNLPAdapterError(f"{os.path.join(directory, VERA_CONFIG_NAME)}: {VERA_REFUSAL}")
    if kind is None:
        raise FileNotFoundError(f"no PaddleNLP {LORA_CONFIG_NAME} (and no {CONFIG_NAME}) in {directory}")
    path = os.path.join(directory, LORA_CONFIG_NAME)
    d = _read_json(path)

    def refuse(key: str, why: str):
        raise PaddleNLPAdapterError(f"{path}: {key}={d[key]!r} is not supported: {why}")

    for key, why in REFUSED_LORA_KEYS.items():
        if key in d and not _is_empty(d[key]):
            refuse(key, why)
    unknown = sorted(
        k
        for k in d
        if k not in REFUSED_LORA_KEYS
        and k not in _MAPPED_LORA_KEYS
        and k not in _IGNORED_LORA_KEYS
        and not _is_empty(d[k])
    )
    if unknown:
        refuse(
            unknown[0],
            "paddlenlp_ext does not know this key (a newer PaddleNLP feature?) and will not guess what it changes",
        )
    tp = d.get("tensor_parallel_degree", -1)
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int)):
        refuse("tensor_parallel_degree", "it must be an integer")
    alpha = d.get("lora_alpha", 8)  # PaddleNLP's defaults
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0 or math.isinf(alpha):
        # (our -1 means "2 * r"; PaddleNLP would have scaled by a negative number)
        refuse("lora_alpha", "lora_alpha must be a finite number > 0")
    targets = d.get("target_modules")
    if _is_empty(targets):
        raise PaddleNLPAdapterError(f"{path}: target_modules is {targets!r}: PaddleNLP applied LoRA to no module")
    kw = dict(
        method="lora",
        r=d.get("r", 8),
        alpha=float(alpha),
        dropout=d.get("lora_dropout", 0.0),
        rslora=bool(d.get("rslora", False)),
        lora_plus_scale=d.get("lora_plus_scale", 1.0),
        target_modules=targets,
        base_model_name_or_path=d.get("base_model_name_or_path"),
    )
    kw.update(_model_config_fields(directory))
    try:
        config = AdapterConfig(**kw)
    except AdapterConfigError as e:
        raise PaddleNLPAdapterError(f"{path}: {e}") from None
    saved = d.get("scaling")
    if saved is not None and not (
        isinstance(saved, (int, float)) and math.isclose(saved, config.scaling, rel_tol=1e-6)
    ):
        raise PaddleNLPAdapterError(
            f"{path}: scaling={saved!r} does not match lora_alpha={alpha!r}, r={config.r}, rslora={config.rslora} "
            f"(which give {config.scaling:g}); the file was edited or written by an unknown PaddleNLP version"
        )
    return config


# -------------------------------------------------------------------- tensors
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U16": np.uint16}


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """All tensors of a (small) safetensors file as float32.  Raw reader, because
    numpy has no bfloat16: ``BF16`` and PaddleNLP's ``U16`` are read as bfloat16."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise PaddleNLPAdapterError(f"{path}: not a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PaddleNLPAdapterError(f"{path}: corrupt safetensors header: {e}") from None
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        tag, (b, e) = meta["dtype"], meta["data_offsets"]
        if tag not in _ST_DTYPES:
            raise PaddleNLPAdapterError(f"{path}: tensor {key!r} has dtype {tag}, not a float adapter tensor")
        if 8 + n + e > len(raw):
            raise PaddleNLPAdapterError(f"{path}: tensor {key!r} lies outside the file (truncated?)")
        arr = np.frombuffer(
            raw, dtype=_ST_DTYPES[tag], count=(e - b) // np.dtype(_ST_DTYPES[tag]).itemsize, offset=8 + n + b
        ).reshape(meta["shape"])
        out[key] = _bf16_bits_to_f32(arr) if _ST_DTYPES[tag] is np.uint16 else np.array(arr, dtype=np.float32)
    return out


def _read_pdparams(path: str) -> Dict[str, np.ndarray]:
    import paddle

    state = paddle.load(path)
    if not isinstance(state, dict):
        raise PaddleNLPAdapterError(f"{path}: expected a state dict, got {type(state).__name__}")
    out = {}
    for key, v in state.items():
        if isinstance(v, np.ndarray):  # numpy values (merge_tensor_parallel saves): bf16 travels as uint16
            out[key] = _bf16_bits_to_f32(v) if v.dtype == np.uint16 else np.asarray(v, dtype=np.float32)
        elif hasattr(v, "astype") and hasattr(v, "numpy"):
            out[key] = np.asarray(v.astype("float32").numpy(), dtype=np.float32)
        else:
            raise PaddleNLPAdapterError(f"{path}: entry {key!r} is a {type(v).__name__}, not a tensor")
    return out


def paddlenlp_weight_files(directory: str) -> List[List[str]]:
    """The weight files PaddleNLP's ``LoRAModel.from_pretrained`` would read, in its order of preference,
    as one group per tensor-parallel rank (a single group unless it was saved per rank)."""
    for index in (SAFE_PEFT_WEIGHTS_INDEX_NAME, PADDLE_PEFT_WEIGHTS_INDEX_NAME):
        path = os.path.join(directory, index)
        if os.path.isfile(path):
            weight_map = _read_json(path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise PaddleNLPAdapterError(f"{path}: no weight_map")
            files = [os.path.join(directory, f) for f in dict.fromkeys(weight_map.values())]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise PaddleNLPAdapterError(f"{path} names shard files that do not exist: {missing}")
            return [files]
    for name in (SAFE_PEFT_WEIGHTS_NAME, LORA_WEIGHTS_NAME):
        if os.path.isfile(os.path.join(directory, name)):
            return [[os.path.join(directory, name)]]
    # saved under pipeline parallel: one file per stage, each with the plain model's keys of its layers
    pp = sorted(n for n in os.listdir(directory) if re.fullmatch(r"lora_model_state\.pp\d+\.pdparams", n))
    if pp:
        return [[os.path.join(directory, n) for n in pp]]
    from .paddlenlp_tp import tp_shard_files

    tp = tp_shard_files(directory)  # saved per tensor-parallel rank: read_paddlenlp_tensors joins them
    if tp:
        return [tp[rank] for rank in sorted(tp)]
    raise FileNotFoundError(
        f"no PaddleNLP LoRA weights in {directory}: expected {LORA_WEIGHTS_NAME}, {SAFE_PEFT_WEIGHTS_INDEX_NAME}, "
        f"{SAFE_PEFT_WEIGHTS_NAME}, {PADDLE_PEFT_WEIGHTS_INDEX_NAME} or per-rank lora_model_state.tpXX.pdparams"
    )


def _why_not_lora(suffix: str) -> str:
    if suffix == "lora_AB" or suffix.startswith("lora_mixer"):
        return "a MoSLoRA mixer (lora_use_mixer)"
    if suffix == "bias":
        return "a trained bias (trainable_bias)"
    if suffix.endswith("_scale") or "quanter" in suffix:
        return "a quantization-aware-training scale (do_qat)"
    return "a fully trained weight (trainable_modules) or a tensor of an unsupported LoRA variant"


def read_paddlenlp_tensors(directory: str, config: Optional[AdapterConfig] = None) -> Dict[str, np.ndarray]:
    """PaddleNLP's LoRA state as ``{f"{module}.lora_A" / ".lora_B": float32 array}``
    (keys and layouts already equal ours), after checking every key is a LoRA
    factor of a module ``config.target_modules`` matches, with both factors and
    rank ``config.r``.  Raises ``PaddleNLPAdapterError`` naming file and key."""
    if config is None:
        config = load_paddlenlp_config(directory)
    from .paddlenlp_tp import join_tp_shards

    groups = paddlenlp_weight_files(directory)  # one group of files per tensor-parallel rank
    rank_states: List[Dict[str, np.ndarray]] = []
    where: Dict[str, str] = {}  # key -> the (first rank's) file holding it, for messages
    for files in groups:
        tensors: Dict[str, np.ndarray] = {}
        seen: Dict[str, str] = {}
        for path in files:
            part = _read_safetensors(path) if path.endswith(".safetensors") else _read_pdparams(path)
            for k, v in part.items():
                if k in tensors:
                    raise PaddleNLPAdapterError(f"tensor {k!r} is in both {seen[k]} and {path}")
                tensors[k], seen[k] = v, path
                where.setdefault(k, path)
        rank_states.append(tensors)
    if len(groups) > 1:
        degree = _read_json(os.path.join(directory, LORA_CONFIG_NAME)).get("tensor_parallel_degree", -1) or -1
        if len(groups) != max(int(degree), 1):
            raise PaddleNLPAdapterError(
                f"{directory}: {len(groups)} tensor-parallel rank files but "
                f"{LORA_CONFIG_NAME} says tensor_parallel_degree={degree}"
            )
    tensors = join_tp_shards(rank_states, directory) if len(groups) > 1 else rank_states[0]
    if not tensors:
        raise PaddleNLPAdapterError(f"the PaddleNLP LoRA weights in {directory} hold no tensors")
    patterns = [re.compile(p) for p in config.resolved_target_modules]
    modules: Dict[str, Dict[str, np.ndarray]] = {}
    for k, v in tensors.items():
        mod, _, suffix = k.rpartition(".")
        if suffix not in LORA_SUFFIXES:
            raise PaddleNLPAdapterError(
                f"{where[k]}: tensor {k!r} is {_why_not_lora(suffix)}, not a LoRA factor (lora_A / lora_B); "
                "paddlenlp_ext cannot reproduce the model PaddleNLP trained"
            )
        if not any(p.fullmatch(mod) for p in patterns):
            raise PaddleNLPAdapterError(
                f"{where[k]}: tensor {k!r} belongs to module {mod!r}, which no target_modules pattern "
                f"{config.resolved_target_modules} of {os.path.join(directory, LORA_CONFIG_NAME)} matches"
            )
        modules.setdefault(mod, {})[suffix] = v
    for mod, t in sorted(modules.items()):
        if set(t) != set(LORA_SUFFIXES):
            raise PaddleNLPAdapterError(f"{directory}: module {mod!r} has {sorted(t)}, needs both lora_A and lora_B")
        a, b = t["lora_A"], t["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != config.r or b.shape[0] != config.r:
            raise PaddleNLPAdapterError(
                f"{where[mod + '.lora_A']}: {mod}.lora_A {list(a.shape)} / lora_B {list(b.shape)} do not have rank "
                f"r={config.r} as [in, r] / [r, out]"
            )
    return tensors


def load_paddlenlp_adapter(directory: str) -> Tuple[AdapterConfig, Dict[str, np.ndarray]]:
    """``(AdapterConfig, tensors)`` of a PaddleNLP adapter directory, in our naming and layout."""
    config = load_paddlenlp_config(directory)
    return config, read_paddlenlp_tensors(directory, config)


def read_paddlenlp_bundle(directory: str) -> Tuple[AdapterConfig, Dict[str, Dict[str, np.ndarray]], int]:
    """``(config, {module: {suffix: array}}, nbytes)``: what ``merge.formats.AdapterBundle`` holds."""
    config, tensors = load_paddlenlp_adapter(directory)
    modules: Dict[str, Dict[str, np.ndarray]] = {}
    for k, v in tensors.items():
        mod, suffix = k.rsplit(".", 1)
        modules.setdefault(mod, {})[suffix] = v
    return config, modules, sum(int(v.nbytes) for v in tensors.values())
