"""Expert parallelism of the decoder's MoE blocks: each of N ranks holds E/N experts, tokens travel to them.

``expert_parallel_degree`` (PaddleNLP's / PaddleFormers' training key) = N.  Rank r owns the contiguous experts
``[r * E/N, (r + 1) * E/N)`` (PaddleFormers' ``moe_layer``: expert i lives on rank ``i // (E/N)``).  The EP
ranks are data-parallel ranks: each has its own micro-batch, routes it with its replica of the router, and:

1. sorts its (token, slot) assignments by expert (what the single-process block does, ``MoEBlock._grouped``),
   so the rows bound for rank d are one contiguous chunk;
2. exchanges the per-expert counts (an all-to-all of N x E/N integers, no gradient) so every rank knows how
   many rows it receives from each source for each of its experts;
3. **dispatch**: an all-to-all of the rows (rank d receives, source by source, the chunks bound for it);
4. reorders what it received from source-major to expert-major (a host-computed permutation), runs each
   local expert once over its contiguous rows, and puts the outputs back in source-major order;
5. **combine**: the reverse all-to-all returns every row's output to the rank that sent it, in the order it
   was sent; the block then weighs and sums the k slots as the single-process block does.

The all-to-all's backward is the all-to-all with the split sizes swapped (each row's gradient goes back to
its sender), so the experts' gradients on their owner sum the contributions of every rank's tokens.

Communication goes through :class:`ExpertComm`: :class:`FleetExpertComm` calls
``paddle.distributed.alltoall_single`` on fleet's expert-parallel group (GPU launches; read, not run here),
and :class:`SimulatedExpertComm` runs N ranks in one CPU process on top of
:class:`~paddlenlp_ext.parallel.simulate.SimulatedGroup` (how this module is tested: EP = 2 and 4 equal one
process in loss and every gradient, ``tests/test_expert_parallel.py``).
"""

from __future__ import annotations

import abc
from typing import Any, List, Sequence

import numpy as np
import paddle
from paddle import nn
from paddle.autograd import PyLayer

__all__ = [
    "ExpertComm",
    "FleetExpertComm",
    "SimulatedExpertComm",
    "ExpertParallel",
    "apply_expert_parallel",
    "owned_experts",
    "source_to_expert_order",
]


def owned_experts(num_experts: int, degree: int, rank: int) -> range:
    """The global expert ids rank ``rank`` of ``degree`` holds (contiguous, as PaddleFormers places them).

    >>> list(owned_experts(8, 4, 1))
    [2, 3]
    """
    if degree < 1 or num_experts % degree:
        raise ValueError(f"num_experts={num_experts} is not a multiple of expert_parallel_degree={degree}")
    per = num_experts // degree
    return range(rank * per, (rank + 1) * per)


def source_to_expert_order(recv_counts: np.ndarray) -> np.ndarray:
    """The permutation that turns the rows a rank received (source-major: source 0's rows for its local
    experts 0..P-1, then source 1's, ...) into expert-major order (local expert 0's rows from sources 0..N-1,
    then expert 1's, ...).  ``recv_counts`` [N sources, P local experts] -> indices [sum] into the received rows.

    >>> source_to_expert_order(np.array([[1, 2], [0, 1]])).tolist()  # rows: s0e0, s0e1, s0e1, s1e1
    [0, 1, 2, 3]
    >>> source_to_expert_order(np.array([[1, 1], [1, 1]])).tolist()  # rows: s0e0, s0e1, s1e0, s1e1
    [0, 2, 1, 3]
    """
    n, p = recv_counts.shape
    starts = np.concatenate([[0], np.cumsum(recv_counts.reshape(-1))[:-1]]).reshape(n, p)  # [N, P] row offsets
    pieces = [np.arange(starts[s, e], starts[s, e] + recv_counts[s, e]) for e in range(p) for s in range(n)]
    return np.concatenate(pieces).astype("int64") if pieces else np.zeros([0], "int64")


class ExpertComm(abc.ABC):
    """One rank's view of its expert-parallel group."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def exchange_counts(self, counts: np.ndarray) -> np.ndarray:
        """``counts`` [N, P] (row d: this rank's rows for rank d's P experts) -> [N, P] (row s: what source s
        sends to this rank, per local expert).  No gradient."""

    @abc.abstractmethod
    def all_to_all(self, x: paddle.Tensor, in_splits: Sequence[int], out_splits: Sequence[int]) -> paddle.Tensor:
        """Rows ``x`` [sum(in_splits), H], chunk d to rank d -> [sum(out_splits), H], chunk s from rank s.
        Backward: the same with the split sizes swapped."""


# ------------------------------------------------------------------------------------------------ fleet
class _FleetAllToAll(PyLayer):
    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group):
        ctx.args = (list(in_splits), list(out_splits), group)
        out = paddle.empty([int(sum(out_splits))] + list(x.shape[1:]), dtype=x.dtype)
        paddle.distributed.alltoall_single(
            out, x.contiguous(), in_split_sizes=list(in_splits), out_split_sizes=list(out_splits), group=group
        )
        return out

    @staticmethod
    def backward(ctx, dy):
        in_splits, out_splits, group = ctx.args
        dx = paddle.empty([int(sum(in_splits))] + list(dy.shape[1:]), dtype=dy.dtype)
        paddle.distributed.alltoall_single(
            dx, dy.contiguous(), in_split_sizes=out_splits, out_split_sizes=in_splits, group=group
        )
        return dx


class FleetExpertComm(ExpertComm):
    """``paddle.distributed.alltoall_single`` on ``group`` (fleet's ``get_expert_parallel_group()``).  Needs a
    GPU launch; not run on this CPU-only machine (the simulation runs the same dispatch logic)."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.world_size = int(group.rank), int(group.nranks)

    def exchange_counts(self, counts):
        send = paddle.to_tensor(np.ascontiguousarray(counts, dtype="int64").reshape(-1))  # [N * P]
        recv = paddle.empty_like(send)
        paddle.distributed.alltoall_single(recv, send, group=self.group)  # equal splits: P per rank
        return recv.numpy().reshape(counts.shape)

    def all_to_all(self, x, in_splits, out_splits):
        return _FleetAllToAll.apply(x, in_splits, out_splits, self.group)


# ------------------------------------------------------------------------------------------- simulated
class _AllToAllN(PyLayer):
    """N ranks' all-to-all as one PyLayer: out_d = concat_s chunk d of x_s; grad x_s = concat_d chunk s of
    grad out_d (the reverse all-to-all)."""

    @staticmethod
    def forward(ctx, splits, *xs):
        # splits[s][d]: rows source s sends to rank d
        n = len(xs)
        ctx.splits, ctx.needs = splits, [not x.stop_gradient for x in xs]
        ctx.width, ctx.dtype = list(xs[0].shape[1:]), xs[0].dtype
        chunks = [paddle.split(x, list(splits[s]), axis=0) if x.shape[0] else [x] * n for s, x in enumerate(xs)]
        return tuple(paddle.concat([chunks[s][d] for s in range(n)], axis=0) for d in range(n))

    @staticmethod
    def backward(ctx, *grads):
        n, splits = len(grads), ctx.splits
        grads = [
            g if g is not None else paddle.zeros([sum(splits[s][d] for s in range(n))] + ctx.width, ctx.dtype)
            for d, g in enumerate(grads)
        ]
        col = [[splits[s][d] for s in range(n)] for d in range(n)]  # rows of grad out_d per source
        chunks = [paddle.split(g, col[d], axis=0) if g.shape[0] else [g] * n for d, g in enumerate(grads)]
        return tuple(
            paddle.concat([chunks[d][s] for d in range(n)], axis=0) if ctx.needs[s] else None for s in range(n)
        )


class SimulatedExpertComm(ExpertComm):
    """Rank ``rank``'s expert-parallel collectives inside a :class:`~paddlenlp_ext.parallel.simulate.SimulatedGroup` run."""

    def __init__(self, simulation, rank: int):
        self.simulation, self.rank, self.world_size = simulation, int(rank), simulation.world_size

    def exchange_counts(self, counts):
        def combine(all_counts):  # all_counts[s] [N, P]: rank d gets row d of every source's
            return [np.stack([c[d] for c in all_counts]) for d in range(len(all_counts))]

        return self.simulation.exchange(self.rank, ("expert_counts", counts.shape), np.asarray(counts), combine)

    def all_to_all(self, x, in_splits, out_splits):
        def combine(payloads):
            splits = [list(p[1]) for p in payloads]
            n = len(payloads)
            for d in range(n):  # what each rank expects must be what the others send it
                if [splits[s][d] for s in range(n)] != list(payloads[d][2]):
                    raise ValueError(
                        f"all_to_all: rank {d} expects {payloads[d][2]} rows, the sources send "
                        f"{[splits[s][d] for s in range(n)]}"
                    )
            return list(_AllToAllN.apply(splits, *[p[0] for p in payloads]))

        # the shapes differ by rank (data-dependent row counts): the signature names the op, width and dtype
        sig = ("expert_all_to_all", tuple(x.shape[1:]), str(x.dtype))
        return self.simulation.exchange(self.rank, sig, (x, tuple(in_splits), tuple(out_splits)), combine)


# -------------------------------------------------------------------------------------------- dispatch
class ExpertParallel:
    """The expert-parallel state of one MoE block on one rank (set by :func:`apply_expert_parallel`)."""

    def __init__(self, comm: ExpertComm, num_experts: int):
        self.comm, self.num_experts = comm, int(num_experts)
        self.local = owned_experts(self.num_experts, comm.world_size, comm.rank)

    def run(self, block: nn.Layer, xs: paddle.Tensor, counts: np.ndarray) -> paddle.Tensor:
        """``xs`` [T*k, H]: this rank's rows sorted by global expert (``counts`` [E] per expert) -> every
        row's expert output [T*k, H], same order (dispatch, local experts, combine; module docstring)."""
        n, p = self.comm.world_size, len(self.local)
        send = np.asarray(counts, dtype="int64").reshape(n, p)  # [N, P]: rows for rank d's experts
        recv = self.comm.exchange_counts(send)  # [N, P]: rows from source s for my experts
        in_splits, out_splits = send.sum(axis=1).tolist(), recv.sum(axis=1).tolist()
        got = self.comm.all_to_all(xs, in_splits, out_splits)  # [sum recv, H] source-major
        perm = source_to_expert_order(recv)  # [sum recv] expert-major -> source-major row
        local_counts = np.zeros([self.num_experts], "int64")
        local_counts[self.local.start : self.local.stop] = recv.sum(axis=0)
        if perm.size:
            ys = block.run_sorted(paddle.gather(got, paddle.to_tensor(perm)), local_counts)  # expert-major
            ys = paddle.gather(ys, paddle.to_tensor(np.argsort(perm, kind="stable")))  # back to source-major
        else:
            ys = got * 0.0  # no row for my experts: still take part in the combine (SPMD)
        return self.comm.all_to_all(ys, out_splits, in_splits)  # [T*k, H] in the order sent


def apply_expert_parallel(model: nn.Layer, comm: ExpertComm) -> List[str]:
    """Keep on ``model`` only rank ``comm.rank``'s experts of every MoE block (``experts.J`` renumbered from 0,
    the local ids) and route its blocks through ``comm``.  Returns the names of the blocks changed.

    Built from the single-process model (every rank loads the same weights, then drops the experts it does
    not own), so the simulation starts from exactly the single process's parameters.
    """
    from .moe import MoEBlock

    done = []
    for name, layer in model.named_sublayers():
        if not isinstance(layer, MoEBlock):
            continue
        spec = layer.spec
        if spec.fused_experts:
            raise ValueError(
                f"expert_parallel_degree={comm.world_size}: {spec.model_type}'s fused experts "
                "(one 3-D parameter for all experts) are not split; set expert_parallel_degree=1"
            )
        local = owned_experts(spec.num_experts, comm.world_size, comm.rank)
        layer.experts = nn.LayerList([layer.experts[e] for e in local])
        layer.expert_parallel = ExpertParallel(comm, spec.num_experts)
        done.append(name)
    return done
