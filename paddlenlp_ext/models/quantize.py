"""Model-level quantization: replace a model's decoder ``nn.Linear`` layers by :class:`QuantizedLinear`.

Owns :func:`quantize_model` (target selection, all-or-nothing shape validation,
in-place replacement, size/path stats) and :func:`quantized_state_bytes`.  The
default targets are the project-wide decoder linears of the model family
(:func:`paddlenlp_ext.models.targets.decoder_linear_targets`).

Tensor parallel (``tensor_parallel_degree > 1``): Paddle's ``ColumnParallelLinear``
/ ``RowParallelLinear`` targets are replaced by
:class:`paddlenlp_ext.quant.parallel_linear.QuantizedParallelLinear`, which quantizes this
rank's weight shard with the same formats and keeps the layer's collectives;
sequence-parallel variants are refused.
"""

from __future__ import annotations

import gc
import logging
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import paddle.nn as nn

from .targets import NEVER_TARGET_PARTS, decoder_linear_targets
from ..quant import formats as F
from ..quant.formats import check_target_shape  # noqa: F401  (public here too: the checkpoint loader's pre-check)
from ..quant.linear import QuantizedLinear

_log = logging.getLogger("paddlenlp_ext.quant")


def default_target_modules(model: nn.Layer) -> List[str]:
    """The decoder linears of ``model``'s family (``model.config.model_type``; generic without a config)."""
    config = getattr(model, "config", None)
    return decoder_linear_targets(getattr(config, "model_type", None) if config is not None else None)


def _compile(patterns: Sequence[str]) -> List["re.Pattern[str]"]:
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


#: Paddle's tensor-parallel linears (PaddleNLP's mp / sequence-parallel layers subclass these), by module
_TENSOR_PARALLEL_LINEARS = (
    ("paddle.distributed.fleet.meta_parallel", ("ColumnParallelLinear", "RowParallelLinear")),
    ("paddle.distributed.fleet.utils.sequence_parallel_utils",
     ("ColumnSequenceParallelLinear", "RowSequenceParallelLinear")),
)  # fmt: skip


def _tensor_parallel_types() -> tuple:
    import importlib

    found = []
    for module, names in _TENSOR_PARALLEL_LINEARS:
        mod = importlib.import_module(module)
        found += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return tuple(found)


def _local_weight_shape(layer: nn.Layer) -> Tuple[int, int]:
    """``[in, out]`` of the weight this process quantizes (a tensor-parallel layer's: its shard's)."""
    return int(layer.weight.shape[0]), int(layer.weight.shape[1])


def select_targets(
    model: nn.Layer, target_modules: Optional[Sequence[str]] = None
) -> Tuple[Dict[str, nn.Layer], List[str]]:
    """``({name: layer}, skipped)``: the layers :func:`quantize_model` replaces, in model order.

    ``target_modules`` as in :func:`quantize_model`.  Targets are exact ``nn.Linear``
    instances and Paddle's ``ColumnParallelLinear`` / ``RowParallelLinear`` (built
    for a model-parallel group); matching ``nn.Linear`` subclasses are ``skipped``.
    A matching sequence-parallel (or other) tensor-parallel linear raises
    ``ValueError`` -- skipping it silently would leave the layers people most
    want quantized in fp32.
    """
    from ..parallel.layers import ParallelLinear
    from ..parallel.shard import is_supported, shard_spec

    pats = _compile(default_target_modules(model) if target_modules is None else target_modules)
    tp_types = _tensor_parallel_types() + (ParallelLinear,)  # ours: the decoder's tensor-parallel linears
    targets: Dict[str, nn.Layer] = {}
    skipped: List[str] = []
    for name, layer in model.named_sublayers():
        if not name or any(n in name for n in NEVER_TARGET_PARTS) or not _matches(name, pats):
            continue
        if isinstance(layer, tp_types):
            # QuantizedParallelLinear communicates as a plain Column/RowParallelLinear, not sequence parallel
            sequence_parallel = "SequenceParallel" in type(layer).__name__ or bool(
                getattr(getattr(layer, "tp_spec", None), "sequence_parallel", False)
            )
            if not is_supported(layer) or sequence_parallel:
                raise ValueError(
                    f"layer '{name}' is a tensor-parallel {type(layer).__name__}: tensor-parallel QLoRA "
                    "(weight_quantize_algo with tensor_parallel_degree > 1) is not supported yet for it "
                    "(only ColumnParallelLinear / RowParallelLinear; set sequence_parallel=False), or leave "
                    "these layers out via target_modules."
                )
            try:  # a layer not built for a model-parallel group fails here, before anything changes
                shard_spec(layer)
            except ValueError as e:
                raise ValueError(f"layer '{name}' is a tensor-parallel {type(layer).__name__}: {e}") from None
            targets[name] = layer
            continue
        if type(layer) is nn.Linear:
            targets[name] = layer
        elif isinstance(layer, nn.Linear):
            skipped.append(name)
    return targets, skipped


def amp_excluded_layers(model: nn.Layer) -> List[nn.Layer]:
    """The layers ``paddle.amp.decorate(level="O2", excluded_layers=...)`` must leave in float32.

    O2 casts every floating parameter *and buffer* of the layers it decorates;
    a :class:`QuantizedLinear`'s f32 block scales, double-quant scales and
    offset and its code-book table would become bf16/fp16 and decode a
    different weight (the codes were chosen for the f32 scales).  Returns the
    model's :class:`QuantizedLinear` instances (adapters wrapping them are not
    included: their own weights are meant to be cast).  For PaddleNLP's
    Trainer: ``excluded_layers=[...] + amp_excluded_layers(model)``.
    """
    return [layer for layer in model.sublayers(include_self=True) if isinstance(layer, QuantizedLinear)]


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
            (``named_sublayers``); default :func:`default_target_modules`, i.e.
            every Linear inside the numbered decoder blocks (``layers.N.``).
            Names containing a part of ``NEVER_TARGET_PARTS`` (``lm_head``,
            ``embed``) are never replaced.
        logger: object with ``.info`` (e.g. ``paddlenlp.utils.log.logger``).
        double_quant_block_size: ``weight_double_quant_block_size`` (256).
        backend: see :meth:`QuantizedLinear.from_linear`.

    Every shape is validated before anything is replaced, so a bad layer
    raises ``ValueError`` and leaves the model untouched.  Only exact
    ``nn.Linear`` instances and Paddle's Column/RowParallelLinear (each rank
    quantizes its shard, see :mod:`paddlenlp_ext.quant.parallel_linear`) are
    replaced (subclasses such as adapter layers are reported in ``skipped``);
    a matching sequence-parallel linear raises ``ValueError`` (see
    :func:`select_targets`).

    Returns a stats dict: ``algo``, ``layers_replaced``, ``replaced`` (names),
    ``skipped`` (matching names that were not plain ``nn.Linear``),
    ``params`` (weights quantized), ``bytes_before`` (their float weights),
    ``bytes_after`` (codes + scales), ``bytes_per_param`` (after / params),
    ``compression`` (before / after), ``path`` (sorted backend/forward paths
    planned: ``portable_dequant_matmul``, ``paddle_weight_only_linear``, ...).
    """
    fmt = F.get_format(algo)
    if double_quant and not fmt.blockwise:
        raise ValueError(
            f"weight_double_quant is only defined for nf4/fp4, got weight_quantize_algo={algo!r}. "
            "Set weight_double_quant=False."
        )
    pats = _compile(default_target_modules(model) if target_modules is None else target_modules)
    log = logger if logger is not None else _log
    targets_by_name, skipped = select_targets(model, [p.pattern for p in pats])
    targets = list(targets_by_name.items())
    del targets_by_name  # (the loop below drops its references one by one)

    # validate all shapes first: fail before mutating the model
    for name, layer in targets:
        check_target_shape(name, *_local_weight_shape(layer), algo, block_size)

    # parents only (keeping the target Linears referenced here would pin their float weights)
    target_names = {n for n, _ in targets}
    parents = {n: l for n, l in model.named_sublayers(include_self=True) if n not in target_names}
    n_targets = len(targets)
    stats: Dict[str, Any] = {
        "algo": algo,
        "block_size": block_size if fmt.blockwise else None,
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
        if type(layer) is nn.Linear:
            q = QuantizedLinear.from_linear(
                layer, algo, block_size, double_quant, double_quant_block_size, backend=backend
            )
        else:  # Column/RowParallelLinear: this rank's shard
            from ..quant.parallel_linear import QuantizedParallelLinear

            q = QuantizedParallelLinear.from_parallel_linear(
                layer, algo, block_size, double_quant, double_quant_block_size, backend=backend
            )
        setattr(parent, attr, q)
        stats["bytes_after"] += q.quantized_nbytes()
        stats["replaced"].append(name)
        paths.add(q.planned_path())
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
