"""Prefix-tuning configuration, model facts and config checks (never imports paddle).

``PrefixConfig`` has exactly the fields of PaddleNLP's ``PrefixConfig``
(``paddlenlp.peft.prefix.prefix_config``) and writes them the same way
(``prefix_config.json``, ``indent=2``, sorted keys), so a prefix directory
written here loads in PaddleNLP and the other way round.

Shapes, for a model with L layers, H_kv key/value heads of size D
(D = hidden_size // num_attention_heads) and P prefix tokens:

    no projection:  embedding [P, 2*L*H_kv*D]
    projection:     embedding [P, H_kv*D] -> Linear(H_kv*D, M) -> tanh
                    -> Linear(M, 2*L*H_kv*D),  M = prefix_projection_hidden_size

H_kv is ``multi_query_group_num`` when set, else ``num_attention_heads``.
PaddleNLP's ``get_prefix_tuning_params`` leaves it unset for Llama (so a GQA
Llama prefix would get num_attention_heads heads, which cannot be concatenated
to the model's keys) and sets it to ``num_key_value_heads`` for Qwen2.  Here
it is unset for Llama without GQA (byte-identical config to PaddleNLP's) and
``num_key_value_heads`` for GQA Llama and for every Qwen2.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from ..adapters.config import ADAPTER_METHOD_KEYS

PREFIX_CONFIG_NAME = "prefix_config.json"  # paddlenlp.utils.env.PREFIX_CONFIG_NAME
PREFIX_WEIGHTS_NAME = "prefix_model_state.pdparams"  # paddlenlp.utils.env.PREFIX_WEIGHTS_NAME
PAST_KEY_VALUES_NAME = "pre_caches.npy"  # paddlenlp.utils.env.PAST_KEY_VALUES_FILE_NAME

#: model_type values whose past_key_values layout ([batch, seq, kv_heads, head_dim] per layer) we build
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

#: ModelArgument keys that shape the prefix; they mean nothing without prefix_tuning
TUNING_KEYS = ("num_prefix_tokens", "prefix_projection", "prefix_projection_hidden_size", "prefix_dropout")

#: ModelArgument keys of the other parameter-efficient methods (prefix tuning wraps the model alone)
OTHER_METHOD_KEYS = (*ADAPTER_METHOD_KEYS, "lora_path", "lokr_path")


class PrefixConfigError(ValueError):
    """A prefix configuration that cannot be built or does not fit the model."""


@dataclass
class PrefixConfig:
    """The fields of PaddleNLP's PrefixConfig, in its order (see the module doc for shapes)."""

    prefix_dropout: float = 0.0
    num_prefix_tokens: Optional[int] = None
    num_attention_heads: Optional[int] = None
    multi_query_group_num: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    prefix_projection: bool = False
    prefix_projection_hidden_size: Optional[int] = None
    tensor_parallel_degree: int = -1
    dtype: Optional[str] = None

    # -- derived sizes -----------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.multi_query_group_num if self.multi_query_group_num is not None else self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        """H_kv * D: one layer's key (or value) width per prefix token."""
        return self.num_kv_heads * self.head_dim

    @property
    def output_dim(self) -> int:
        """2 * L * H_kv * D: every layer's key and value per prefix token."""
        return 2 * self.num_hidden_layers * self.kv_dim

    def trainable_params(self) -> int:
        p, out = self.num_prefix_tokens, self.output_dim
        if not self.prefix_projection:
            return p * out
        m = self.prefix_projection_hidden_size
        return p * self.kv_dim + (self.kv_dim * m + m) + (m * out + out)

    def validate(self) -> "PrefixConfig":
        for key in ("num_prefix_tokens", "num_attention_heads", "num_hidden_layers", "hidden_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise PrefixConfigError(f"prefix config: {key} must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise PrefixConfigError(
                f"prefix config: hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.multi_query_group_num is not None and self.multi_query_group_num <= 0:
            raise PrefixConfigError(
                f"prefix config: multi_query_group_num must be > 0, got {self.multi_query_group_num}"
            )
        if self.prefix_projection and not self.prefix_projection_hidden_size:
            raise PrefixConfigError("prefix config: prefix_projection=true needs prefix_projection_hidden_size")
        if not 0.0 <= float(self.prefix_dropout) < 1.0:
            raise PrefixConfigError(f"prefix config: prefix_dropout must be in [0, 1), got {self.prefix_dropout}")
        if self.tensor_parallel_degree is not None and self.tensor_parallel_degree > 1:
            raise PrefixConfigError(
                f"prefix config: saved with tensor_parallel_degree={self.tensor_parallel_degree} (one weight file per "
                "rank); merge it first (PaddleNLP: save_pretrained(merge_tensor_parallel=True))"
            )
        return self

    # -- files ---------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, PREFIX_CONFIG_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(self.to_dict(), indent=2, sort_keys=True))  # as PaddleNLP writes it
        return path

    @classmethod
    def load(cls, directory: str) -> "PrefixConfig":
        path = os.path.join(directory, PREFIX_CONFIG_NAME)
        if not os.path.isfile(path):
            raise PrefixConfigError(f"{directory!r} has no {PREFIX_CONFIG_NAME} (is it a prefix-tuning directory?)")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except ValueError as e:
            raise PrefixConfigError(f"{path}: invalid JSON: {e}") from e
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})  # PaddleNLP also skips unknown keys


@dataclass(frozen=True)
class ModelFacts:
    """What the prefix needs to know about the model (from config.json or a PretrainedConfig)."""

    model_type: Optional[str]
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    tensor_parallel_degree: int = 1

    @classmethod
    def of(cls, config: Any) -> "ModelFacts":
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        heads = get("num_attention_heads")
        kv = get("num_key_value_heads") or heads
        return cls(
            get("model_type"),
            get("hidden_size"),
            heads,
            kv,
            get("num_hidden_layers"),
            get("tensor_parallel_degree", 1) or 1,
        )


def prefix_config_for_model(
    facts: ModelFacts,
    num_prefix_tokens: int,
    prefix_projection: bool = False,
    prefix_projection_hidden_size: Optional[int] = None,
    prefix_dropout: float = 0.0,
    dtype: Optional[str] = None,
) -> PrefixConfig:
    """The PrefixConfig PaddleNLP's run_finetune would build for this model (GQA Llama: see module doc)."""
    if facts.model_type not in SUPPORTED_MODEL_TYPES:
        raise PrefixConfigError(
            f"prefix tuning supports model_type {' and '.join(SUPPORTED_MODEL_TYPES)}; got {facts.model_type!r}"
        )
    gqa = facts.num_key_value_heads != facts.num_attention_heads
    return PrefixConfig(
        prefix_dropout=float(prefix_dropout),
        num_prefix_tokens=num_prefix_tokens,
        num_attention_heads=facts.num_attention_heads,
        multi_query_group_num=facts.num_key_value_heads if (gqa or facts.model_type == "qwen2") else None,
        num_hidden_layers=facts.num_hidden_layers,
        hidden_size=facts.hidden_size,
        prefix_projection=bool(prefix_projection),
        prefix_projection_hidden_size=(prefix_projection_hidden_size or facts.hidden_size)
        if prefix_projection
        else None,
        tensor_parallel_degree=facts.tensor_parallel_degree,
        dtype=dtype,
    ).validate()


def model_mismatches(pc: PrefixConfig, facts: ModelFacts) -> List[str]:
    """Why a saved prefix cannot run on this model (empty: it fits)."""
    out = []
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
        if getattr(pc, key) != getattr(facts, key):
            out.append(f"the prefix was made for {key}={getattr(pc, key)} but the model has {getattr(facts, key)}")
    if not out and pc.num_kv_heads != facts.num_key_value_heads:
        out.append(
            f"the prefix has {pc.num_kv_heads} key/value heads per layer but the model has num_key_value_heads="
            f"{facts.num_key_value_heads} (PaddleNLP's get_prefix_tuning_params ignores GQA for llama: such a "
            "prefix cannot be concatenated to this model's keys, in PaddleNLP either)"
        )
    return out


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def config_problems(m, d, t: Mapping[str, Any], where: str) -> List[str]:
    """Prefix-tuning checks of one run config (ModelArgument ``m``, DataArgument ``d``,
    training keys ``t``), for ``config.parse``; each problem says what to change."""
    defaults = {f.name: f.default for f in dataclasses.fields(type(m))}
    if not m.prefix_tuning:
        p = (
            [f"{where}: prefix_path is set but prefix_tuning is false; set prefix_tuning=true to use it"]
            if m.prefix_path
            else []
        )
        return p + [
            f"{where}: {k}={getattr(m, k)!r} applies only with prefix_tuning=true; set it or remove {k}"
            for k in TUNING_KEYS
            if getattr(m, k, defaults.get(k)) != defaults.get(k)
        ]
    p = []
    others = [k for k in OTHER_METHOD_KEYS if getattr(m, k, None)]
    if others:
        p.append(
            f"{where}: prefix_tuning cannot be combined with {', '.join(others)}: one parameter-efficient "
            "method at a time (the prefix runs in front of a frozen, unmodified model)"
        )
    if m.weight_quantize_algo:
        p.append(f"{where}: prefix_tuning with weight_quantize_algo is not supported; remove weight_quantize_algo")
    if t.get("tensor_parallel_degree", 1) > 1:
        p.append(f"{where}: prefix_tuning with tensor_parallel_degree > 1 is not supported; use data parallel")
    if d.zero_padding and m.use_flash_attention and not m.flash_mask:
        p.append(
            f"{where}: prefix_tuning with zero_padding and use_flash_attention needs flash_mask=true (the "
            "flash path takes FlashMask start rows, which get the prefix columns; a dense packed mask does "
            "not reach it); or set use_flash_attention=false"
        )
    if m.prefix_projection_hidden_size is not None and not m.prefix_projection:
        p.append(f"{where}: prefix_projection_hidden_size applies only with prefix_projection=true")
    facts = None
    if m.model_name_or_path:
        raw = _read_json(os.path.join(m.model_name_or_path, "config.json"))
        facts = ModelFacts.of(raw) if raw else None
        if facts is not None and facts.model_type not in SUPPORTED_MODEL_TYPES:
            p.append(
                f"{where}: prefix_tuning supports model_type {' and '.join(SUPPORTED_MODEL_TYPES)}; "
                f"{m.model_name_or_path!r} is {facts.model_type!r}"
            )
            facts = None
    if m.prefix_path:
        p += _saved_prefix_problems(m, defaults, facts, where)
    return p


def _saved_prefix_problems(m, defaults, facts: Optional[ModelFacts], where: str) -> List[str]:
    """prefix_path: the directory holds a loadable prefix that fits the model; keys set in the
    config that contradict the saved prefix are errors (unset keys follow the saved prefix)."""
    if not os.path.isfile(os.path.join(m.prefix_path, PREFIX_WEIGHTS_NAME)):
        return [
            f"{where}: prefix_path {m.prefix_path!r} has no {PREFIX_WEIGHTS_NAME} (is it a prefix-tuning "
            "output directory? per-rank tensor-parallel files must be merged first)"
        ]
    try:
        saved = PrefixConfig.load(m.prefix_path).validate()
    except PrefixConfigError as e:
        return [f"{where}: prefix_path: {e}"]
    p = []
    for key in TUNING_KEYS:
        mine, theirs = getattr(m, key), getattr(saved, key)
        if key == "prefix_projection_hidden_size" and not saved.prefix_projection:
            theirs = None
        if mine != defaults.get(key) and mine != theirs:
            p.append(
                f"{where}: {key}={mine!r} but the prefix in prefix_path was trained with {theirs!r}; "
                "remove the key or make them match (the saved prefix's settings apply)"
            )
    if facts is not None:
        p += [f"{where}: prefix_path {m.prefix_path!r}: {x}" for x in model_mismatches(saved, facts)]
    return p
