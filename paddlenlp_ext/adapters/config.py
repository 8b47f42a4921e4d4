"""Adapter configuration (plain Python: importing this module never imports paddle).

``AdapterConfig`` describes one parameter-efficient adapter (LoRA and its
variants rsLoRA / LoRA+ / PiSSA, VeRA, or LoKr) and round-trips through
``adapter_config.json`` next to ``adapter_model.safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from ..models.targets import decoder_linear_targets
from .methods import TABLE, AdapterMethod, method_by_key, method_keys

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

#: the built-in methods (``adapters.methods.TABLE`` is the live list, with methods registered later)
SUPPORTED_METHODS = tuple(TABLE)

#: Default targets when the model type is unknown: every linear layer inside
#: the decoder layers (one definition, ``paddlenlp_ext.models.targets``).
DEFAULT_TARGET_MODULES = tuple(decoder_linear_targets(None))


class AdapterConfigError(ValueError):
    """Raised for an invalid adapter configuration."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class AdapterConfig:
    """Configuration of one adapter.

    Fields
    ------
    method: a row of the method table (``adapters.methods``): ``"lora"``, ``"vera"``, ``"lokr"``
        or a registered one.  Which fields below are a method's own options is its row's
        ``options`` dataclass; another method's option left off its default is an error.
    r: rank (``lora_rank`` for LoRA, ``vera_rank`` for VeRA, ``lokr_dim`` for
        LoKr); default 8.
    alpha: LoRA alpha; ``None`` (or PaddleNLP's "unset" value -1) resolves to
        ``2 * r``.  LoKr: ``lokr_alpha``, ``None`` or 0 resolves to ``r``
        (scaling 1, as PaddleNLP's LoKrLinear).  Not used by VeRA
        (VeRA has no scaling factor; setting it is an error).
    dropout: dropout probability on the adapter branch input.
    rslora: LoRA scaling ``alpha / sqrt(r)`` instead of ``alpha / r``.
    lora_plus_scale: LoRA+ ratio ``lr_B / lr_A`` (1.0 = plain LoRA).
    pissa: initialise A/B from the top-r singular triplets of W (PiSSA).
    pissa_niter: 0 = exact SVD; >0 = randomized SVD with that many power
        iterations.
    target_modules: list of regexes, each matched with ``re.fullmatch``
        against the full sublayer name; ``None`` = the decoder linears of
        ``model_type`` (``models.targets.decoder_linear_targets``).
    vera_seed / vera_d_init: VeRA projection seed and initial value of d.
    vera_max_in / vera_max_out: dimensions of the shared VeRA projections;
        filled in by ``apply_adapters`` (the largest in/out features over the
        adapted layers) and persisted, so the projections can be regenerated.
    lokr_factor / lokr_decompose_both: LoKr's split of in/out into Kronecker
        factors (-1 = most balanced) and whether W1 is low rank too
        (``adapters.lokr``).
    base_model_name_or_path / model_type: informational.
    quantization: dict describing the quantized base (set by the caller) or
        ``None``.
    """

    method: str = "lora"
    r: int = 8
    alpha: Optional[float] = None
    dropout: float = 0.0
    rslora: bool = False
    lora_plus_scale: float = 1.0
    pissa: bool = False
    pissa_niter: int = 0
    target_modules: Optional[List[str]] = None
    vera_seed: int = 0
    vera_d_init: float = 0.1
    vera_max_in: Optional[int] = None
    vera_max_out: Optional[int] = None
    lokr_factor: int = -1
    lokr_decompose_both: bool = False
    base_model_name_or_path: Optional[str] = None
    model_type: Optional[str] = None
    quantization: Optional[Dict[str, Any]] = None

    def __post_init__(self):
        if isinstance(self.method, str):
            self.method = self.method.lower()
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        elif isinstance(self.target_modules, tuple):
            self.target_modules = list(self.target_modules)
        if _is_number(self.alpha) and self.alpha == -1:  # PaddleNLP's "unset"
            self.alpha = None
        row = TABLE.get(self.method)  # an unknown method is named by validate()
        if row is not None and row.uses_alpha and _is_int(self.r):
            if self.alpha is None or (_is_number(self.alpha) and self.alpha in row.unset_alpha):
                self.alpha = row.default_alpha(self.r)  # LoRA: 2 r; LoKr: r (lokr_alpha 0, scaling 1)
        if _is_int(self.alpha):
            self.alpha = float(self.alpha)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> "AdapterConfig":
        """The common checks, then the method's row: its alpha rule, the other methods' options left at
        their defaults, and its own checks (``adapters.methods``)."""

        def err(msg):
            raise AdapterConfigError(f"AdapterConfig: {msg}")

        if self.method not in TABLE:
            err(f"method must be one of {tuple(TABLE)}, got {self.method!r}")
        row = TABLE[self.method]
        if not _is_int(self.r) or self.r <= 0:
            err(f"r (rank) must be a positive integer, got {self.r!r}")
        if not _is_number(self.dropout) or not (0.0 <= self.dropout < 1.0):
            err(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        own = row.option_defaults()
        for other in TABLE.values():  # another method's option set here would be silently ignored
            for name, default in other.option_defaults().items():
                value = getattr(self, name)
                if other is not row and name not in own and value != default:
                    err(other.foreign_message.format(field=name, value=value, name=other.name, method=self.method))
        for problem in row.check(self):
            err(problem)
        if row.uses_alpha:
            if not _is_number(self.alpha) or not (self.alpha > 0) or math.isinf(self.alpha):
                err(f"alpha must be a finite number > 0, got {self.alpha!r}")
        elif self.alpha is not None:
            err(f"alpha is not used by {row.title} (the adapter has no scaling factor); leave it None")
        if self.target_modules is not None:
            if not isinstance(self.target_modules, list) or not self.target_modules:
                err(f"target_modules must be a non-empty list of regex strings or None, got {self.target_modules!r}")
            for pat in self.target_modules:
                if not isinstance(pat, str):
                    err(f"target_modules entries must be strings, got {pat!r}")
                try:
                    re.compile(pat)
                except re.error as e:
                    err(f"target_modules entry {pat!r} is not a valid regex: {e}")
        if self.quantization is not None and not isinstance(self.quantization, dict):
            err(f"quantization must be a dict or None, got {type(self.quantization).__name__}")
        if self.quantization and not row.supports.quantized_base:
            err(f"{row.title} does not run on a quantized base: {row.refusals.get('quantized_base', 'not verified')}")
        return self

    # --------------------------------------------------------------- derived
    @property
    def row(self) -> AdapterMethod:
        """This method's row of the table (``adapters.methods``)."""
        return TABLE[self.method]

    @property
    def layer_type(self) -> str:
        """The layer to build: the method's name, or a variant of it ("pissa" for lora + pissa)."""
        return self.row.resolve_layer_type(self)

    @property
    def scaling(self) -> float:
        """Factor applied to the adapter branch (the row's rule; 1.0 for VeRA)."""
        return self.row.scaling(self)

    @property
    def resolved_target_modules(self) -> List[str]:
        if self.target_modules is not None:
            return list(self.target_modules)
        return decoder_linear_targets(self.model_type)

    # --------------------------------------------------------------- (de)ser
    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["target_modules"] is not None:
            d["target_modules"] = list(d["target_modules"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AdapterConfig":
        if not isinstance(d, Mapping):
            raise AdapterConfigError(f"AdapterConfig.from_dict expects a mapping, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise AdapterConfigError(f"AdapterConfig: unknown keys {unknown}; valid keys are {sorted(names)}")
        return cls(**dict(d))

    def save(self, save_dir: str) -> str:
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, CONFIG_NAME)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        return path

    @classmethod
    def load(cls, load_dir: str) -> "AdapterConfig":
        path = os.path.join(load_dir, CONFIG_NAME) if os.path.isdir(load_dir) else load_dir
        if not os.path.isfile(path):
            from .paddlenlp_format import is_paddlenlp_adapter, load_paddlenlp_config

            if is_paddlenlp_adapter(load_dir):  # PaddleNLP's lora_config.json, converted
                return load_paddlenlp_config(load_dir)
            raise FileNotFoundError(f"no {CONFIG_NAME} found at {path}")
        with open(path, "r", encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise AdapterConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(d)


#: Flat config keys (PaddleNLP's names) that select a built-in adapter method (``methods.method_keys()``: live).
ADAPTER_METHOD_KEYS = method_keys()


def adapter_config_from_args(args: Mapping[str, Any]) -> Optional[AdapterConfig]:
    """The one mapping from flat config keys to an :class:`AdapterConfig`.

    Used by the CLI (``training.run``), by config validation before anything
    loads (``config.parse``) and by the tests, so the three cannot disagree.
    ``args`` holds PaddleNLP-style keys (``lora``, ``lora_rank``,
    ``lora_alpha``, ``rslora``, ``lora_plus_scale``, ``pissa``,
    ``pissa_niter``, ``vera``, ``vera_rank``, ``vera_seed``, ``vera_d_init``,
    ``lokr``, ``lokr_dim``, ``lokr_alpha``, ``lokr_factor``,
    ``lokr_decompose_both``, ``lora_dropout``, ``lora_target_modules`` /
    ``target_modules``) and optionally ``model_name_or_path``, ``model_type``
    and ``quantization``; other keys are ignored.  Returns ``None`` when no
    method key (``ADAPTER_METHOD_KEYS``) is on.
    ``lora_alpha`` -1 (PaddleNLP's "unset") means ``2 * lora_rank``;
    ``lokr_alpha`` 0 (PaddleNLP's default) means scaling 1.

    >>> adapter_config_from_args({"lora": True, "lora_rank": 4, "rslora": True}).scaling  # 8 / sqrt(4)
    4.0
    """
    a = dict(args)
    on = [k for k in method_keys() if a.get(k, False)]
    if len(on) > 1:
        raise AdapterConfigError(f"only one adapter method at a time; got {' and '.join(on)} both true")
    if not on:
        return None
    row = method_by_key(on[0])
    targets = a.get("lora_target_modules")
    if targets is None:
        targets = a.get("target_modules")
    kw: Dict[str, Any] = dict(
        target_modules=targets,
        base_model_name_or_path=a.get("base_model_name_or_path", a.get("model_name_or_path")),
        model_type=a.get("model_type"),
        quantization=a.get("quantization"),
    )
    kw.update(method=row.name, **row.from_args(a))  # the row maps its own flat keys
    return AdapterConfig(**kw)
