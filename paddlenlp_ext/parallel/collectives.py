"""The collectives a tensor-parallel layer uses, behind one small interface.

A layer of :mod:`paddlenlp_ext.parallel` never calls a communication op itself;
it calls its :class:`Collectives` (one rank's view of its model-parallel group):

============  ==========================================  ===========================================
method        forward                                     backward (of the input gradient)
============  ==========================================  ===========================================
identity      ``x``                                       all-reduce (sum) over the ranks
all_reduce    all-reduce (sum) over the ranks             identity
all_gather    concat of every rank's ``x``, last axis     this rank's slice of the gradient
split         this rank's slice of ``x``, last axis       all-gather of the ranks' gradients
============  ==========================================  ===========================================

(``identity`` / ``all_reduce`` / ``all_gather`` are fleet's ``c_identity`` /
``mp_allreduce`` / ``c_concat``; ``split`` is what ``c_split`` means.)

Sequence parallelism (``sequence_parallel=true``) cuts the activations along
their first axis (the sequence) between the tensor-parallel linears; its three
operations are fleet's ``AllGatherOp`` / ``ReduceScatterOp`` / ``ScatterOp``
(``paddle.distributed.fleet.utils.sequence_parallel_utils``):

==================  ====================================  ===========================================
method              forward                               backward (of the input gradient)
==================  ====================================  ===========================================
seq_all_gather      concat of every rank's ``x``, axis 0  sum over the ranks, this rank's slice (axis 0)
seq_reduce_scatter  sum over the ranks, this rank's slice concat of every rank's gradient, axis 0
seq_scatter         this rank's slice of ``x``, axis 0    concat of every rank's gradient, axis 0
==================  ====================================  ===========================================
:meth:`Collectives.gather_tensor` is a plain all-gather along any axis, without
autograd, for writing complete checkpoints.

Implementations: :class:`FleetCollectives` (fleet's ``mp_ops`` on a real
model-parallel group, through :mod:`paddlenlp_ext.integrations.mp_ops`; needs a
GPU/XPU build) and :class:`~paddlenlp_ext.parallel.simulate.SimulatedCollectives`
(N ranks in one CPU process, for tests).  :func:`collectives_for` picks the one
that matches a layer's ``model_parallel_group``.
"""

from __future__ import annotations

import abc
from typing import Any

import paddle
from paddle.autograd import PyLayer


def check_divisible(width: int, world_size: int, what: str) -> int:
    """``width // world_size``, or a clear error when the split would be uneven."""
    if width % world_size:
        raise ValueError(f"{what}: size {width} is not divisible by the tensor-parallel degree {world_size}")
    return width // world_size


class Collectives(abc.ABC):
    """One rank's view of a tensor-parallel group (see the module docstring)."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def identity(self, x: paddle.Tensor) -> paddle.Tensor:
        """Forward identity, backward all-reduce of the gradient."""

    @abc.abstractmethod
    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """Forward all-reduce (sum), backward identity."""

    @abc.abstractmethod
    def all_gather(self, x: paddle.Tensor) -> paddle.Tensor:
        """Forward all-gather along the last axis, backward this rank's slice."""

    @abc.abstractmethod
    def split(self, x: paddle.Tensor) -> paddle.Tensor:
        """Forward this rank's slice of the last axis, backward all-gather."""

    @abc.abstractmethod
    def seq_all_gather(self, x: paddle.Tensor) -> paddle.Tensor:
        """Forward all-gather along axis 0, backward reduce-scatter (sequence parallel)."""

    @abc.abstractmethod
    def seq_reduce_scatter(self, x: paddle.Tensor) -> paddle.Tensor:
        """Forward reduce-scatter along axis 0, backward all-gather (sequence parallel)."""

    @abc.abstractmethod
    def seq_scatter(self, x: paddle.Tensor) -> paddle.Tensor:
        """Forward this rank's slice of axis 0, backward all-gather (sequence parallel)."""

    @abc.abstractmethod
    def gather_tensor(self, t: paddle.Tensor, axis: int) -> paddle.Tensor:
        """Every rank's ``t`` concatenated along ``axis`` (rank order), no autograd."""

    def local_slice(self, x: paddle.Tensor) -> paddle.Tensor:
        """This rank's slice of the last axis of ``x`` (no communication)."""
        width = check_divisible(int(x.shape[-1]), self.world_size, "split of the last axis")
        return x[..., self.rank * width : (self.rank + 1) * width]


class _ScaleGrad(PyLayer):
    """Forward ``x``; backward the gradient times ``factor`` (no communication)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = float(factor)
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy * ctx.factor


def scale_grad(x: paddle.Tensor, factor: float) -> paddle.Tensor:
    """``x`` whose gradient is multiplied by ``factor`` on the way back."""
    return _ScaleGrad.apply(x, factor)


class _SplitLastAxis(PyLayer):
    """``split`` on a fleet group: the forward is local; the backward gathers with ``c_concat``."""

    @staticmethod
    def forward(ctx, x, collectives):
        ctx.collectives = collectives
        return collectives.local_slice(x).clone()  # [..., d] -> [..., d / N]

    @staticmethod
    def backward(ctx, dy):
        from ..integrations import mp_ops

        return mp_ops.c_concat(dy, ctx.collectives.group)  # [..., d / N] -> [..., d]


class FleetCollectives(Collectives):
    """Fleet's model-parallel ops on ``group`` (a ``paddle.distributed`` Group of the hybrid topology)."""

    def __init__(self, group: Any):
        if group is None:
            raise ValueError("FleetCollectives needs the layer's model-parallel group (got None)")
        self.group = group
        self.rank = int(group.rank)
        self.world_size = int(group.nranks)

    def identity(self, x):
        from ..integrations import mp_ops

        return mp_ops.c_identity(x, self.group)

    def all_reduce(self, x):
        from ..integrations import mp_ops

        return mp_ops.mp_allreduce(x, self.group)

    def all_gather(self, x):
        from ..integrations import mp_ops

        return mp_ops.c_concat(x, self.group)

    def split(self, x):
        return _SplitLastAxis.apply(x, self)

    # fleet's sequence-parallel ops communicate over the hybrid group's model-parallel group, which is
    # this layer's group in a fleet run (Paddle's own sequence-parallel linears rely on the same)
    def seq_all_gather(self, x):
        from ..integrations import mp_ops

        return mp_ops.seq_all_gather(x)

    def seq_reduce_scatter(self, x):
        from ..integrations import mp_ops

        return mp_ops.seq_reduce_scatter(x)

    def seq_scatter(self, x):
        from ..integrations import mp_ops

        return mp_ops.seq_scatter(x)

    @paddle.no_grad()
    def gather_tensor(self, t, axis):
        parts: list = []
        paddle.distributed.all_gather(parts, t.contiguous(), group=self.group)
        return paddle.concat(parts, axis=axis)

    def __repr__(self) -> str:
        return f"FleetCollectives(rank={self.rank}, world_size={self.world_size})"


def collectives_for(group: Any) -> Collectives:
    """The collectives of a layer's ``model_parallel_group``: simulated for a
    :class:`~paddlenlp_ext.parallel.simulate.SimulatedProcessGroup`, fleet's otherwise."""
    from .simulate import SimulatedProcessGroup

    if isinstance(group, SimulatedProcessGroup):
        return group.collectives()
    return FleetCollectives(group)
