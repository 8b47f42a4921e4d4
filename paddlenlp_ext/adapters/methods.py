"""The adapter method table: one row per parameter-efficient method (plain Python: no paddle).

Everything that differs between LoRA, VeRA, LoKr (and a method you add) is a field of its
:class:`AdapterMethod` row, in the spirit of ``models/family_table.py`` and PEFT's
``register_peft_method``.  The code that serves every method reads the row:

* ``adapters.config`` -- the flat keys that turn the method on and their mapping to
  :class:`~paddlenlp_ext.adapters.config.AdapterConfig` (``from_args``), the method's own options (a small
  dataclass whose fields are the ``AdapterConfig`` fields only it uses) and their checks, alpha and scaling;
* ``adapters.api`` / ``adapters.tp_layers`` -- the layer class and the tensor-parallel class, as
  dotted paths (``"module:Class"``) imported only when a model is built, so config code stays paddle-free;
* ``config/`` -- what the method supports and the refusals for what it does not (tensor / pipeline
  parallelism), with the message of each refusal;
* ``merge.formats`` / ``planner.params`` -- the tensors one adapted ``[in, out]`` Linear saves
  (``saved_shapes``) and which of them train (all but ``frozen``);
* ``export.peft_adapter`` -- the PEFT mapping (a dotted path to a ``PeftMapping``).

A new method is its module (the layer class) plus one :func:`register_method` call; see
docs/contributing.md ("Add a PEFT method") and tests/test_method_table.py, which adds "LoRA with a frozen A".
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

Shapes = Dict[str, Tuple[int, ...]]


@dataclass(frozen=True)
class Supports:
    """What a method runs with (a False is refused before anything loads, with the row's message)."""

    tensor_parallel: bool = False  # adapters.tp_layers has a class for it (``tp_layer``)
    pipeline_parallel: bool = False  # each stage can hold its own layers' adapters
    quantized_base: bool = True  # QLoRA: the branch reads x, never the base weight
    merge: bool = True  # merge_lora_params.py (the delta is a dense [in, out] matrix)
    peft_export: bool = False  # ``peft_export`` names its PEFT mapping
    reference_by_disabling: bool = True  # DPO / KTO / GRPO reference = the base with the adapters off


@dataclass(frozen=True)
class NoOptions:
    """A method without options of its own (rank, alpha, dropout and targets are common to all)."""


def _no_checks(cfg: Any) -> List[str]:
    return []


@dataclass(frozen=True)
class AdapterMethod:
    """One row of the table (see the module docstring for who reads which field)."""

    name: str  # AdapterConfig.method, "method" of adapter_config.json
    title: str  # for messages: "LoRA"
    key: str  # the flat config key that turns it on (PaddleNLP's name: "lora", "vera", "lokr")
    layer: str  # "module:Class" of the single-device layer (an adapters.base.AdapterLayer)
    from_args: Callable[[Mapping[str, Any]], Dict[str, Any]]  # flat keys -> AdapterConfig keyword arguments
    saved_shapes: Callable[[Any, int, int], Shapes]  # (config, in, out) -> {suffix: shape} one Linear saves
    options: type = NoOptions  # its own small config dataclass: AdapterConfig fields only this method uses
    check: Callable[[Any], List[str]] = _no_checks  # problems of its options (config -> messages)
    uses_alpha: bool = True  # False: alpha must stay None (no scaling factor)
    default_alpha: Callable[[int], float] = lambda r: 2.0 * r  # alpha when unset (None, or an ``unset_alpha``)
    unset_alpha: Tuple[Any, ...] = ()  # more values that mean "unset" (PaddleNLP's lokr_alpha 0)
    scaling: Callable[[Any], float] = lambda cfg: float(cfg.alpha) / cfg.r
    frozen: Tuple[str, ...] = ()  # saved suffixes that do not train (PiSSA's A0/B0)
    shared_params: Callable[[Any, int, int], int] = lambda cfg, max_in, max_out: 0  # one frozen copy per model
    variants: Mapping[str, str] = field(default_factory=dict)  # layer type -> "module:Class" (PiSSA)
    layer_type: Optional[Callable[[Any], str]] = None  # which variant a config builds (default: name)
    tp_layer: Optional[str] = None  # "module:Class" on Column/RowParallelLinear, None: refused
    peft_export: Optional[str] = None  # "module:MAPPING" (export.peft_adapter.PeftMapping), None: refused
    supports: Supports = Supports()
    refusals: Mapping[str, str] = field(default_factory=dict)  # feature -> why (the text of the refusal)
    # config keys (flat name) compared with a saved adapter (lora_path): {AdapterConfig field: flat key}
    flat_keys: Mapping[str, str] = field(default_factory=dict)
    mismatch_label: str = ""  # how a method mismatch with lora_path names the key (default: ``key``)
    foreign_message: str = "{field}={value!r} only applies to method={name!r}, not {method!r}"

    def option_defaults(self) -> Dict[str, Any]:
        """``{field: default}`` of the method's own options."""
        return {f.name: f.default for f in dataclasses.fields(self.options)}

    def resolve_layer_type(self, cfg: Any) -> str:
        return self.layer_type(cfg) if self.layer_type is not None else self.name

    def layer_path(self, layer_type: str) -> str:
        return self.layer if layer_type == self.name else self.variants[layer_type]

    def trainable_params(self, cfg: Any, in_f: int, out_f: int) -> int:
        """Trainable elements one adapted ``[in, out]`` Linear adds (``saved_shapes`` minus ``frozen``).

        >>> TABLE["lora"].trainable_params(_Cfg(r=4), 64, 176)  # A [64, 4] + B [4, 176]
        960
        """
        return sum(math.prod(s) for k, s in self.saved_shapes(cfg, in_f, out_f).items() if k not in self.frozen)


#: name -> row, in registration order (the order of ``method_keys()``)
TABLE: "OrderedDict[str, AdapterMethod]" = OrderedDict()


def register_method(row: AdapterMethod) -> AdapterMethod:
    """Add ``row`` to the table (its name and its key must be new); returns it."""
    for other in TABLE.values():
        if row.name == other.name or row.key == other.key:
            raise ValueError(f"adapter method {row.name!r} (key {row.key!r}) is already registered")
    TABLE[row.name] = row
    return row


def unregister_method(name: str) -> None:
    """Remove a row added by :func:`register_method` (tests that register a method of their own)."""
    del TABLE[name]


def method(name: str) -> AdapterMethod:
    """The row of ``name``; ValueError naming the known ones."""
    try:
        return TABLE[name]
    except KeyError:
        raise ValueError(f"unknown adapter method {name!r}; known: {sorted(TABLE)}") from None


def method_keys() -> Tuple[str, ...]:
    """The flat config keys that select a method, e.g. ``("lora", "vera", "lokr")``."""
    return tuple(row.key for row in TABLE.values())


def method_by_key(key: str) -> AdapterMethod:
    return next(row for row in TABLE.values() if row.key == key)


def layer_types() -> Dict[str, str]:
    """``{layer type: "module:Class"}`` over every row and variant."""
    out = {}
    for row in TABLE.values():
        out[row.name] = row.layer
        out.update(row.variants)
    return out


def load_object(path: str) -> Any:
    """``"package.module:Name"`` -> the object (imports the module: the paddle-bound half of a row)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def supporting(feature: str) -> List[str]:
    """Keys of the methods that support ``feature`` (a :class:`Supports` field), e.g. ``["lora", "vera"]``."""
    return [row.key for row in TABLE.values() if getattr(row.supports, feature)]


# ----------------------------------------------------------------------------------- LoRA
@dataclass(frozen=True)
class LoRAOptions:
    """LoRA's own options: rsLoRA scaling, LoRA+ learning-rate ratio, PiSSA initialisation."""

    rslora: bool = False
    lora_plus_scale: float = 1.0
    pissa: bool = False
    pissa_niter: int = 0


def _lora_check(cfg: Any) -> List[str]:
    p = [f"{name} must be a bool, got {getattr(cfg, name)!r}" for name in ("rslora", "pissa")
         if not isinstance(getattr(cfg, name), bool)]  # fmt: skip
    s = cfg.lora_plus_scale
    if not isinstance(s, (int, float)) or isinstance(s, bool) or not (s > 0) or math.isinf(s):
        p.append(f"lora_plus_scale must be a finite number > 0, got {s!r}")
    n = cfg.pissa_niter
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        p.append(f"pissa_niter must be an integer >= 0 (0 = exact SVD), got {n!r}")
    if cfg.pissa and cfg.quantization:
        p.append("pissa cannot be combined with a quantized base (the residual weight would have to be re-quantized)")
    return p


def _lora_args(a: Mapping[str, Any]) -> Dict[str, Any]:
    return dict(
        r=a.get("lora_rank", 8),
        alpha=a.get("lora_alpha"),
        dropout=a.get("lora_dropout", 0.0),
        rslora=bool(a.get("rslora", False)),
        lora_plus_scale=a.get("lora_plus_scale", 1.0),
        pissa=bool(a.get("pissa", False)),
        pissa_niter=a.get("pissa_niter", 0),
    )


def lora_shapes(cfg: Any, in_f: int, out_f: int) -> Shapes:
    """``lora_A [in, r]``, ``lora_B [r, out]`` (and PiSSA's frozen ``pissa_A0`` / ``pissa_B0``)."""
    shapes: Shapes = {"lora_A": (in_f, cfg.r), "lora_B": (cfg.r, out_f)}
    if getattr(cfg, "pissa", False):
        shapes.update(pissa_A0=(in_f, cfg.r), pissa_B0=(cfg.r, out_f))
    return shapes


def _lora_scaling(cfg: Any) -> float:
    return float(cfg.alpha) / (math.sqrt(cfg.r) if cfg.rslora else cfg.r)


register_method(
    AdapterMethod(
        name="lora",
        title="LoRA",
        key="lora",
        layer="paddlenlp_ext.adapters.lora:LoRALinear",
        variants={"pissa": "paddlenlp_ext.adapters.pissa:PiSSALinear"},
        layer_type=lambda cfg: "pissa" if cfg.pissa else "lora",
        from_args=_lora_args,
        saved_shapes=lora_shapes,
        frozen=("pissa_A0", "pissa_B0"),
        options=LoRAOptions,
        check=_lora_check,
        scaling=_lora_scaling,
        tp_layer="paddlenlp_ext.adapters.tp_layers:ParallelLoRALinear",
        peft_export="paddlenlp_ext.export.peft_adapter:LORA",
        supports=Supports(tensor_parallel=True, pipeline_parallel=True, peft_export=True),
        flat_keys={
            "r": "lora_rank",
            "alpha": "lora_alpha",
            "rslora": "rslora",
            "pissa": "pissa",
            "lora_plus_scale": "lora_plus_scale",
        },  # fmt: skip
        mismatch_label="lora/vera",
    )
)


# ----------------------------------------------------------------------------------- VeRA
@dataclass(frozen=True)
class VeRAOptions:
    """VeRA's own options: the seed of the shared projections, d's initial value, and the projections'
    sizes (filled in by ``apply_adapters`` and saved, so the projections can be regenerated)."""

    vera_seed: int = 0
    vera_d_init: float = 0.1
    vera_max_in: Optional[int] = None
    vera_max_out: Optional[int] = None


def _vera_check(cfg: Any) -> List[str]:
    p = []
    if not isinstance(cfg.vera_seed, int) or isinstance(cfg.vera_seed, bool):
        p.append(f"vera_seed must be an integer, got {cfg.vera_seed!r}")
    if not isinstance(cfg.vera_d_init, (int, float)) or isinstance(cfg.vera_d_init, bool):
        p.append(f"vera_d_init must be a number, got {cfg.vera_d_init!r}")
    for name in ("vera_max_in", "vera_max_out"):
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            p.append(f"{name} must be a positive integer or None, got {v!r}")
    return p


register_method(
    AdapterMethod(
        name="vera",
        title="VeRA",
        key="vera",
        layer="paddlenlp_ext.adapters.vera:VeRALinear",
        from_args=lambda a: dict(
            r=a.get("vera_rank", 8),
            dropout=a.get("lora_dropout", 0.0),
            vera_seed=a.get("vera_seed", 0),
            vera_d_init=a.get("vera_d_init", 0.1),
        ),
        saved_shapes=lambda cfg, in_f, out_f: {"vera_d": (cfg.r,), "vera_b": (out_f,)},
        shared_params=lambda cfg, max_in, max_out: cfg.r * (max_in + max_out),  # A [r, max_in], B [max_out, r]
        options=VeRAOptions,
        check=_vera_check,
        uses_alpha=False,
        scaling=lambda cfg: 1.0,
        tp_layer="paddlenlp_ext.adapters.tp_layers:ParallelVeRALinear",
        peft_export="paddlenlp_ext.export.peft_adapter:VERA",
        supports=Supports(tensor_parallel=True, pipeline_parallel=False, peft_export=True),
        refusals={
            "pipeline_parallel": "VeRA's shared projections span every adapted layer of the model, which one stage "
            "does not hold",
        },
        flat_keys={"r": "vera_rank"},
        mismatch_label="lora/vera",
    )
)


# ----------------------------------------------------------------------------------- LoKr
@dataclass(frozen=True)
class LoKrOptions:
    """LoKr's own options: how in/out split into Kronecker factors (-1 = most balanced) and whether W1
    is low rank too (``adapters.lokr``)."""

    lokr_factor: int = -1
    lokr_decompose_both: bool = False


def _lokr_check(cfg: Any) -> List[str]:
    p = []
    # lokr_factor 0 or < -1 would silently degrade to (1, dim) in PaddleNLP; a factor that does not
    # divide a dimension is legal there (nearest balanced divisor <= factor, see factorization)
    f = cfg.lokr_factor
    if not isinstance(f, int) or isinstance(f, bool) or not (f == -1 or f > 0):
        p.append(f"lokr_factor must be -1 (most balanced factors) or a positive integer, got {f!r}")
    if not isinstance(cfg.lokr_decompose_both, bool):
        p.append(f"lokr_decompose_both must be a bool, got {cfg.lokr_decompose_both!r}")
    return p


def factorization(dimension: int, factor: int = -1) -> Tuple[int, int]:
    """Split ``dimension`` into ``(m, n)`` with ``m * n == dimension`` (LyCORIS /
    PaddleNLP rule; ``m`` sizes W1, ``n`` sizes W2):

    * ``factor > 0`` dividing ``dimension``: exactly ``(factor, dimension // factor)``
      (not reordered, so ``m`` may exceed ``n``);
    * ``factor == -1``: the most balanced pair, ``m`` = the largest divisor
      ``<= sqrt(dimension)``;
    * ``factor > 0`` not dividing: the most balanced pair whose smaller side is
      a divisor ``<= factor`` (walk the divisors upwards, stop before one
      exceeds ``factor``), returned as ``(smaller, larger)``.

    >>> factorization(4096), factorization(768, 8), factorization(176), factorization(176, 10)
    ((64, 64), (8, 96), (11, 16), (8, 22))
    """
    if not isinstance(dimension, int) or dimension <= 0:
        raise ValueError(f"factorization: dimension must be a positive integer, got {dimension!r}")
    if not isinstance(factor, int) or not (factor == -1 or factor > 0):
        raise ValueError(f"factorization: factor must be -1 or a positive integer, got {factor!r}")
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    limit = dimension if factor == -1 else factor
    small = [d for d in range(1, math.isqrt(dimension) + 1) if dimension % d == 0]
    divisors = small + [dimension // d for d in reversed(small) if d * d != dimension]  # ascending
    m, n = 1, dimension
    for d in divisors[1:]:
        if d > limit:
            break
        m, n = d, dimension // d
        if m >= n:  # crossed sqrt(dimension): (m, n) is the mirror of the most balanced pair
            break
    return (m, n) if m <= n else (n, m)


def lokr_shapes(config: Any, in_features: int, out_features: int) -> "OrderedDict[str, Tuple[int, int]]":
    """``{suffix: shape}`` of the LoKr tensors of one ``[in, out]`` Linear, in
    a fixed order (W1 part first).  Same decision rule as PaddleNLP's
    ``LoKrLinear``: decompose W2 iff ``r < max(out_n, in_n) / 2``; decompose W1
    iff ``lokr_decompose_both`` and ``r < max(out_m, in_m) / 2``.

    >>> dict(lokr_shapes(_Cfg(r=4), 64, 176))  # 64 = 8 x 8, 176 = 11 x 16
    {'lokr_w1': (11, 8), 'lokr_w2_a': (16, 4), 'lokr_w2_b': (4, 8)}
    """
    r = config.r
    in_m, in_n = factorization(int(in_features), config.lokr_factor)
    out_m, out_n = factorization(int(out_features), config.lokr_factor)
    shapes: "OrderedDict[str, Tuple[int, int]]" = OrderedDict()
    if config.lokr_decompose_both and r < max(out_m, in_m) / 2:
        shapes["lokr_w1_a"] = (out_m, r)
        shapes["lokr_w1_b"] = (r, in_m)
    else:
        shapes["lokr_w1"] = (out_m, in_m)
    if r < max(out_n, in_n) / 2:
        shapes["lokr_w2_a"] = (out_n, r)
        shapes["lokr_w2_b"] = (r, in_n)
    else:
        shapes["lokr_w2"] = (out_n, in_n)
    return shapes


register_method(
    AdapterMethod(
        name="lokr",
        title="LoKr",
        key="lokr",
        layer="paddlenlp_ext.adapters.lokr:LoKrLinear",
        # rslora / pissa / lora_plus_scale are passed on so that combining them with LoKr is an error, not ignored
        from_args=lambda a: dict(
            r=a.get("lokr_dim", 8),
            alpha=a.get("lokr_alpha", 0.0),
            dropout=a.get("lora_dropout", 0.0),
            lokr_factor=a.get("lokr_factor", -1),
            lokr_decompose_both=bool(a.get("lokr_decompose_both", False)),
            rslora=bool(a.get("rslora", False)),
            pissa=bool(a.get("pissa", False)),
            lora_plus_scale=a.get("lora_plus_scale", 1.0),
        ),
        saved_shapes=lokr_shapes,
        options=LoKrOptions,
        check=_lokr_check,
        default_alpha=float,  # PaddleNLP LoKr: lokr_alpha 0 means alpha = lokr_dim, scaling 1
        unset_alpha=(0,),
        peft_export="paddlenlp_ext.export.peft_adapter:LOKR",
        supports=Supports(tensor_parallel=False, pipeline_parallel=True, peft_export=True),
        refusals={
            "tensor_parallel": "LoKr's Kronecker factors span the whole weight",
            "tensor_parallel_layer": "its Kronecker factors span the whole weight and do not split along a shard",
        },
        flat_keys={
            "r": "lokr_dim",
            "alpha": "lokr_alpha",
            "lokr_factor": "lokr_factor",
            "lokr_decompose_both": "lokr_decompose_both",
        },  # fmt: skip
        foreign_message="lokr_factor / lokr_decompose_both only apply to method={name!r}, not {method!r}",
    )
)


@dataclass
class _Cfg:
    """A stand-in config for the docstring examples."""

    r: int = 8
    pissa: bool = False
    lokr_factor: int = -1
    lokr_decompose_both: bool = False
