"""Model-level helpers: replace Linear layers by :class:`QuantizedLinear`."""

from __future__ import annotations

import gc
import logging
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np
import paddle.nn as nn

from . import formats as F
from .linear import QuantizedLinear

_log = logging.getLogger("paddlenlp_ext.quant")


def _compile(patterns: Optional[Sequence[str]]) -> List["re.Pattern[str]"]:
    from . import DEFAULT_TARGET_MODULES

    if patterns is None:
        patterns = DEFAULT_TARGET_MODULES
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"target_modules: invalid regular expression {p!r}: {e}") from None
    return out


def _matches(name: str, pats: Iterable["re.Pattern[str]"]) -> bool:
    return any(p.fullmatch(name) for p in pats)


def quantized_state_bytes(model: nn.Layer) -> int:
    """Bytes of all quantized buffers (codes + scales) of the model's :class:`QuantizedLinear` layers."""
    return int(sum(l.quantized_nbytes() for _, l in model.named_sublayers() if isinstance(l, QuantizedLinear)))


def quantize_model(
    model: nn.Layer,
    algo: str,
    block_size: int = F.DEFAULT_BLOCK_SIZE,
    double_quant: bool = False,
    target_modules: Optional[Sequence[str]] = None,
    logger: Optional[Any] = None,
    double_quant_block_size: int = F.DEFAULT_DOUBLE_QUANT_BLOCK_SIZE,
    backend: str = "auto",
) -> Dict[str, Any]:
    """Replace matching ``nn.Linear`` sublayers of ``model`` in place by :class:`QuantizedLinear`.

    Args:
        model: any ``paddle.nn.Layer``.
        algo: ``weight_only_int8``, ``weight_only_int4``, ``nf4`` or ``fp4``.
        block_size: nf4/fp4 block size (``weight_blocksize``).
        double_quant: nf4/fp4 double quantization (``weight_double_quant``).
        target_modules: regexes ``re.fullmatch``-ed against sublayer names
            (``named_sublayers``); default :data:`DEFAULT_TARGET_MODULES`, i.e.
            every Linear inside the numbered decoder blocks.  Names containing
            ``lm_head`` or ``embed`` are never replaced.
        logger: object with ``.info`` (e.g. ``paddlenlp.utils.log.logger``).
        double_quant_block_size: ``weight_double_quant_block_size`` (256).
        backend: see :meth:`QuantizedLinear.from_linear`.

    Every shape is validated before anything is replaced, so a bad layer
    raises ``ValueError`` and leaves the model untouched.  Only exact
    ``nn.Linear`` instances are replaced (subclasses such as adapter layers or
    tensor-parallel linears are reported in ``skipped``).

    Returns a stats dict: ``algo``, ``layers_replaced``, ``replaced`` (names),
    ``skipped`` (matching names that were not plain ``nn.Linear``),
    ``params`` (weights quantized), ``bytes_before`` (their float weights),
    ``bytes_after`` (codes + scales), ``bytes_per_param`` (after / params),
    ``compression`` (before / after), ``path`` (sorted backend/forward paths
    planned: ``portable_dequant_matmul``, ``paddle_weight_only_linear``, ...).
    """
    if algo not in F.SUPPORTED_ALGOS:
        raise ValueError(f"unknown weight_quantize_algo {algo!r}; supported: {list(F.SUPPORTED_ALGOS)}")
    if double_quant and algo not in F.BLOCK_ALGOS:
        raise ValueError(
            f"weight_double_quant is only defined for nf4/fp4, got weight_quantize_algo={algo!r}. "
            "Set weight_double_quant=False."
        )
    pats = _compile(target_modules)
    log = logger if logger is not None else _log

    targets, skipped = [], []
    for name, layer in model.named_sublayers():
        if not name or any(n in name for n in _NEVER_PARTS) or not _matches(name, pats):
            continue
        if type(layer) is nn.Linear:
            targets.append((name, layer))
        elif isinstance(layer, nn.Linear):
            skipped.append(name)

    # validate all shapes first: fail before mutating the model
    for name, layer in targets:
        in_f, out_f = int(layer.weight.shape[0]), int(layer.weight.shape[1])
        try:
            F.check_shape(in_f, out_f, algo, block_size)
        except ValueError as e:
            raise ValueError(f"layer '{name}': {e}") from None

    # parents only (keeping the target Linears referenced here would pin their float weights)
    parents = {n: l for n, l in model.named_sublayers(include_self=True) if type(l) is not nn.Linear}
    n_targets = len(targets)
    stats: Dict[str, Any] = {
        "algo": algo,
        "block_size": block_size if algo in F.BLOCK_ALGOS else None,
        "double_quant": bool(double_quant),
        "layers_replaced": 0,
        "replaced": [],
        "skipped": skipped,
        "params": 0,
        "bytes_before": 0,
        "bytes_after": 0,
    }
    paths = set()
    for i in range(len(targets)):
        name, layer = targets[i]
        targets[i] = None  # drop our reference so the float weight can be freed as we go
        parent_name, _, attr = name.rpartition(".")
        parent = parents[parent_name]
        w = layer.weight
        stats["params"] += int(np.prod(w.shape))
        stats["bytes_before"] += int(np.prod(w.shape)) * w.element_size()
        q = QuantizedLinear.from_linear(
            layer, algo, block_size, double_quant, double_quant_block_size, backend=backend
        )
        setattr(parent, attr, q)
        stats["bytes_after"] += q.quantized_nbytes()
        stats["replaced"].append(name)
        paths.add(_planned_path(q))
        del layer, w
    gc.collect()
    stats["layers_replaced"] = len(stats["replaced"])
    stats["bytes_per_param"] = stats["bytes_after"] / stats["params"] if stats["params"] else 0.0
    stats["compression"] = stats["bytes_before"] / stats["bytes_after"] if stats["bytes_after"] else 0.0
    stats["path"] = sorted(paths)
    if not n_targets:
        log.warning(f"quantize_model: no nn.Linear matched target_modules={list(p.pattern for p in pats)}")
    else:
        log.info(
            f"quantize_model: {algo} replaced {stats['layers_replaced']} linear layers, "
            f"{stats['bytes_before'] / 2**20:.2f} MiB -> {stats['bytes_after'] / 2**20:.2f} MiB "
            f"({stats['bytes_per_param']:.4f} bytes/param), path={stats['path']}"
        )
    return stats


_NEVER_PARTS = ("lm_head", "embed")


def _planned_path(q: QuantizedLinear) -> str:
    from . import linear as L

    if q.backend == L.BACKEND_WEIGHT_ONLY:
        return L.PATH_WEIGHT_ONLY
    if q.algo in F.BLOCK_ALGOS and L._on_gpu(q.quant_weight) and L.paddleslim_ops() is not None:
        return L.PATH_PADDLESLIM
    return L.PATH_PORTABLE
