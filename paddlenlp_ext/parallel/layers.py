"""Tensor-parallel base layers of our decoder: linears (with fused segments) and the vocab-parallel embedding.

Like the adapter layers, they never communicate themselves: they call their model-parallel group's
:class:`~.collectives.Collectives` (fleet's ops on a GPU run, simulated ranks in tests), so the same classes
run under fleet and in ``tests/test_decoder_tp.py``.  Paddle orientation, full weight ``W [in, out]``, N ranks:

column (``W_i [in, out / N]``)::      y_i = identity(x) @ W_i + b_i          (sequence parallel: seq_all_gather(x))
row    (``W_i [in / N, out]``)::      y   = all_reduce(x_i @ W_i) + b        (sequence parallel: seq_reduce_scatter)
embedding (``E_i [vocab / N, h]``)::  e   = all_reduce(E_i[ids - lo] * (lo <= ids < hi))

A fused projection (Phi-3's ``qkv_proj``, ``gate_up_proj``) is a column layer with ``segments``: rank i holds
part i of every segment (``[q_i | k_i | v_i]``), so its local output splits into its own heads' q, k and v;
:meth:`.shard.ShardSpec.take` / ``join`` slice and rebuild checkpoints in the single-device layout.

Split parameters carry ``is_distributed`` / ``split_axis`` (fleet's gradient clip and broadcast read them) and
``tp_take`` / ``tp_full_shape`` (the streaming loader slices a single-device checkpoint with them).  A replicated
bias or norm weight that multiplies only this rank's tokens (sequence parallel) goes through ``identity``, whose
backward sums its partial gradients over the ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .collectives import collectives_for
from .shard import COLUMN, ROW, ShardSpec

__all__ = ["ParallelLinear", "VocabParallelEmbedding", "mark_split", "TPContext", "tp_context"]


def mark_split(param: paddle.Tensor, spec: ShardSpec, axis: int, full_shape: Sequence[int]) -> None:
    """Tag a split parameter: fleet's attributes, plus how to cut it from a complete checkpoint tensor."""
    param.is_distributed = True
    param.split_axis = axis
    param.tp_full_shape = tuple(int(s) for s in full_shape)
    param.tp_take = functools.partial(spec.take, axis=axis)


class ParallelLinear(nn.Layer):
    """A column- or row-parallel linear over ``group`` (see the module docstring); ``in_features`` /
    ``out_features`` are the full layer's, ``weight`` this rank's shard."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kind: str,
        group: Any,
        bias: bool = False,
        segments: Sequence[int] = (),
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.tp_spec = ShardSpec(
            kind,
            int(group.rank),
            int(group.nranks),
            in_features,
            out_features,
            gather_output=False,
            input_is_parallel=True,
            sequence_parallel=sequence_parallel,
            segments=tuple(segments),
        )
        spec = self.tp_spec
        self.model_parallel_group, self.world_size = group, spec.world_size
        self.in_features, self.out_features = in_features, out_features
        self.weight = self.create_parameter([spec.local_in, spec.local_out])  # [in / N, out] or [in, out / N]
        mark_split(self.weight, spec, spec.weight_axis, [in_features, out_features])
        self.bias = None
        if bias:
            self.bias = self.create_parameter([spec.local_out], is_bias=True)
            if kind == COLUMN:
                mark_split(self.bias, spec, 0, [out_features])

    @property
    def collectives(self):
        return collectives_for(self.model_parallel_group)

    def local_product(self, x_local: paddle.Tensor) -> paddle.Tensor:
        """``x_local @ W_i`` (+ the column bias shard): what the adapter layers wrap (``shard.local_product``)."""
        return F.linear(x_local, self.weight, self.bias if self.tp_spec.kind == COLUMN else None)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        spec, comm = self.tp_spec, self.collectives
        if spec.kind == COLUMN:
            x = comm.seq_all_gather(x) if spec.sequence_parallel else comm.identity(x)  # [T, in] (all tokens)
            return F.linear(x, self.weight, self.bias)  # [..., out / N]
        partial = F.linear(x, self.weight)  # [..., out], this rank's share of the sum
        y = comm.seq_reduce_scatter(partial) if spec.sequence_parallel else comm.all_reduce(partial)
        if self.bias is None:
            return y
        bias = comm.identity(self.bias) if spec.sequence_parallel and not self.bias.stop_gradient else self.bias
        return y + bias.astype(y.dtype)

    def extra_repr(self) -> str:
        s = self.tp_spec
        seg = f", segments={s.segments}" if s.segments else ""
        return f"{s.kind} parallel, rank {s.rank}/{s.world_size}, in={s.in_features}, out={s.out_features}{seg}"


class VocabParallelEmbedding(nn.Layer):
    """Rank i holds rows ``[i * V / N, (i + 1) * V / N)`` of the ``[V, hidden]`` table."""

    def __init__(self, vocab: int, hidden: int, group: Any):
        super().__init__()
        self.tp_spec = ShardSpec(ROW, int(group.rank), int(group.nranks), vocab, hidden)
        self.model_parallel_group = group
        self.num_embeddings, self.embedding_dim = vocab, hidden
        self.lo, self.hi = self.tp_spec.bounds(vocab)
        self.weight = self.create_parameter([self.hi - self.lo, hidden])  # [V / N, hidden]
        mark_split(self.weight, self.tp_spec, 0, [vocab, hidden])

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        inside = (ids >= self.lo) & (ids < self.hi)  # [B, L]
        local = paddle.where(inside, ids - self.lo, paddle.zeros_like(ids))
        e = F.embedding(local, self.weight) * inside.unsqueeze(-1).astype(self.weight.dtype)  # [B, L, hidden]
        return collectives_for(self.model_parallel_group).all_reduce(e)


@dataclass(frozen=True)
class TPContext:
    """How a model is split: its model-parallel group and whether activations are split by tokens too."""

    group: Any
    sequence_parallel: bool = False

    @property
    def degree(self) -> int:
        return int(self.group.nranks)

    @property
    def rank(self) -> int:
        return int(self.group.rank)

    @property
    def comm(self):
        return collectives_for(self.group)

    def column(self, n_in: int, n_out: int, bias: bool, segments: Sequence[int] = ()) -> ParallelLinear:
        return ParallelLinear(n_in, n_out, COLUMN, self.group, bias, segments, self.sequence_parallel)

    def row(self, n_in: int, n_out: int, bias: bool) -> ParallelLinear:
        return ParallelLinear(n_in, n_out, ROW, self.group, bias, (), self.sequence_parallel)


def tp_context(config: Any) -> Optional[TPContext]:
    """The :class:`TPContext` of a model config (None when ``tensor_parallel_degree`` <= 1)."""
    degree = int(getattr(config, "tensor_parallel_degree", 1) or 1)
    if degree <= 1:
        return None
    from ..integrations.mp_ops import current_model_parallel_group

    group = current_model_parallel_group()
    if int(group.nranks) != degree:
        raise ValueError(f"tensor_parallel_degree={degree} but the model-parallel group has {group.nranks} ranks")
    return TPContext(group, bool(getattr(config, "sequence_parallel", False)))
