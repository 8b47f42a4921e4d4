"""Which tensor-parallel linears are supported, and what one rank's shard of them is.

Paddle orientation: a linear's weight is ``[in_features, out_features]``.

* column parallel (``ColumnParallelLinear``): rank ``i`` holds output columns
  ``[i*out/N, (i+1)*out/N)`` of the weight and of the bias; its input is the
  full (replicated) ``x``; its output is its slice of ``y`` -- all-gathered
  when ``gather_output``.
* row parallel (``RowParallelLinear``): rank ``i`` holds input rows
  ``[i*in/N, (i+1)*in/N)`` of the weight; its input is its slice of ``x``
  (split here unless ``input_is_parallel``); the partial products are
  all-reduced and the (replicated) bias is added once, after the all-reduce.

Supported bases: exactly Paddle's ``paddle.distributed.fleet.meta_parallel``
``ColumnParallelLinear`` / ``RowParallelLinear`` (what PaddleNLP's
``linear_utils`` hands its models on GPU/CPU), their sequence-parallel
versions ``ColumnSequenceParallelLinear`` / ``RowSequenceParallelLinear``
(``paddle.distributed.fleet.utils.sequence_parallel_utils``: the column input
and the row output are this rank's part of the sequence, axis 0;
``ShardSpec.sequence_parallel``), and this package's
:class:`~paddlenlp_ext.quant.parallel_linear.QuantizedParallelLinear`.  MC2, refined-recompute and
vendor (NPU/XPU) subclasses communicate differently and are refused with a
clear error (:func:`shard_spec`).  ``mp_async_allreduce`` /
``mp_skip_c_identity`` / ``fuse_matmul_bias`` of the base only change how fleet
overlaps or fuses the same math; the wrappers use the plain ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

COLUMN = "column"
ROW = "row"


@dataclass(frozen=True)
class ShardSpec:
    """One rank's shard of a tensor-parallel linear (full sizes, split kind, rank)."""

    kind: str
    rank: int
    world_size: int
    in_features: int
    out_features: int
    gather_output: bool = False
    input_is_parallel: bool = True
    sequence_parallel: bool = False  # column input / row output cut along axis 0 (the sequence)
    #: a fused column-parallel projection's output segments (full sizes, e.g. (q, kv, kv) of a qkv_proj):
    #: rank i holds part i of EACH segment ([q_i | k_i | v_i]), not the i-th contiguous block
    segments: Tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in (COLUMN, ROW):
            raise ValueError(f"ShardSpec.kind must be {COLUMN!r} or {ROW!r}, got {self.kind!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.world_size}")
        split = self.out_features if self.kind == COLUMN else self.in_features
        if split % self.world_size:
            raise ValueError(f"{self.kind}-parallel size {split} is not divisible by {self.world_size} ranks")
        if self.segments:
            if self.kind != COLUMN or sum(self.segments) != self.out_features:
                raise ValueError(
                    f"segments {self.segments} must sum to a column-parallel out_features ({self.out_features})"
                )
            if any(seg % self.world_size for seg in self.segments):
                raise ValueError(f"fused segments {self.segments} are not each divisible by {self.world_size} ranks")

    @property
    def weight_axis(self) -> int:
        """Axis of the ``[in, out]`` weight that is split (1 for column, 0 for row)."""
        return 1 if self.kind == COLUMN else 0

    @property
    def local_in(self) -> int:
        return self.in_features // self.world_size if self.kind == ROW else self.in_features

    @property
    def local_out(self) -> int:
        return self.out_features // self.world_size if self.kind == COLUMN else self.out_features

    def bounds(self, size: int) -> Tuple[int, int]:
        """``[lo, hi)`` of this rank's part of an axis of ``size`` elements split in N equal parts."""
        if size % self.world_size:
            raise ValueError(f"an axis of {size} elements cannot be split over {self.world_size} ranks")
        step = size // self.world_size
        return self.rank * step, (self.rank + 1) * step

    def _segmented(self, size: int) -> bool:
        return bool(self.segments) and size == self.out_features

    def take(self, full: Any, axis: int) -> Any:
        """This rank's part of ``full`` (numpy array or paddle tensor) along ``axis``: the contiguous block
        ``[lo, hi)``, or for a fused projection's output axis the concatenation of its part of every segment.

        >>> import numpy as np
        >>> ShardSpec("column", 1, 2, 1, 6, segments=(4, 2)).take(np.arange(6), 0).tolist()  # [q0 q1 | k0] ...
        [2, 3, 5]
        """
        size = int(full.shape[axis])
        if self._segmented(size):
            parts, start = [], 0
            for seg in self.segments:
                step = seg // self.world_size
                parts.append(_slice(full, axis, start + self.rank * step, start + (self.rank + 1) * step))
                start += seg
            return _concat(parts, axis)
        lo, hi = self.bounds(size)
        return _slice(full, axis, lo, hi)

    def join(self, parts: Sequence[Any], axis: int) -> Any:
        """The complete tensor from every rank's part (rank order), the inverse of :meth:`take`.

        >>> import numpy as np
        >>> spec = ShardSpec("column", 0, 2, 1, 6, segments=(4, 2))
        >>> spec.join([np.array([0, 1, 4]), np.array([2, 3, 5])], 0).tolist()
        [0, 1, 2, 3, 4, 5]
        """
        if not self._segmented(sum(int(p.shape[axis]) for p in parts)):
            return _concat(list(parts), axis)
        out, start = [], 0
        for seg in self.segments:
            step = seg // self.world_size
            out += [_slice(p, axis, start, start + step) for p in parts]
            start += step
        return _concat(out, axis)


def _slice(t: Any, axis: int, lo: int, hi: int) -> Any:
    index = [slice(None)] * len(t.shape)
    index[axis] = slice(lo, hi)
    return t[tuple(index)]


def _concat(parts: Sequence[Any], axis: int) -> Any:
    if isinstance(parts[0], paddle.Tensor):
        return paddle.concat(list(parts), axis=axis)
    import numpy as np

    return np.concatenate(list(parts), axis=axis)


def _fleet_types() -> Tuple[type, type]:
    from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def _sequence_parallel_types() -> Tuple[type, type]:
    from paddle.distributed.fleet.utils.sequence_parallel_utils import (
        ColumnSequenceParallelLinear,
        RowSequenceParallelLinear,
    )

    return ColumnSequenceParallelLinear, RowSequenceParallelLinear


def _built(layer: nn.Layer) -> None:
    missing = [a for a in ("weight", "world_size", "model_parallel_group") if not hasattr(layer, a)]
    if missing:
        raise ValueError(
            f"{type(layer).__name__} has no {missing}: it was not built by its __init__ (fleet.init, or "
            "paddlenlp_ext.parallel.SimulatedGroup.build in a simulation)"
        )


def unsupported_reason(layer: nn.Layer) -> str:
    name = type(layer).__name__
    hint = ("only Paddle's ColumnParallelLinear / RowParallelLinear (paddle.distributed.fleet.meta_parallel) and "
            "ColumnSequenceParallelLinear / RowSequenceParallelLinear (fleet.utils.sequence_parallel_utils) are "
            "supported")  # fmt: skip
    return (f"{name} is a tensor-parallel linear this package has no tensor-parallel layer for "
            f"(it communicates differently); {hint}")  # fmt: skip


def shard_spec(layer: nn.Layer) -> ShardSpec:
    """The :class:`ShardSpec` of a supported tensor-parallel linear; NotImplementedError otherwise."""
    spec = getattr(layer, "tp_spec", None)
    if isinstance(spec, ShardSpec):
        return spec
    column, row = _fleet_types()
    column_sp, row_sp = _sequence_parallel_types()
    if type(layer) in (column, column_sp):
        _built(layer)
        ws = int(layer.world_size)
        in_f, out_local = (int(s) for s in layer.weight.shape)
        return ShardSpec(COLUMN, int(layer.model_parallel_group.rank) if ws > 1 else 0, ws, in_f, out_local * ws,
                         gather_output=bool(layer.gather_output),
                         sequence_parallel=type(layer) is column_sp)  # fmt: skip
    if type(layer) in (row, row_sp):
        _built(layer)
        ws = int(layer.world_size)
        return ShardSpec(ROW, int(layer.rank) if ws > 1 else 0, ws, int(layer.in_features), int(layer.out_features),
                         input_is_parallel=bool(layer.input_is_parallel),
                         sequence_parallel=type(layer) is row_sp)  # fmt: skip
    raise NotImplementedError(unsupported_reason(layer))


def is_supported(layer: nn.Layer) -> bool:
    types = _fleet_types() + _sequence_parallel_types()
    return isinstance(getattr(layer, "tp_spec", None), ShardSpec) or type(layer) in types


def local_product(layer: nn.Layer, x_local: paddle.Tensor) -> paddle.Tensor:
    """This rank's ``x_local @ W_local`` -- plus the bias shard for column parallel (the row-parallel bias
    is added once after the all-reduce, :func:`output_bias`).  ``[..., local_in] -> [..., local_out]``."""
    own = getattr(layer, "local_product", None)
    if callable(own):
        return own(x_local)
    if shard_spec(layer).kind == COLUMN:
        return F.linear(x_local, layer.weight, layer.bias)
    return F.linear(x_local, layer.weight)


def output_bias(layer: nn.Layer) -> Optional[paddle.Tensor]:
    """The replicated bias a row-parallel layer adds after the all-reduce (None for column parallel)."""
    if shard_spec(layer).kind == COLUMN:
        return None
    return layer.bias
