"""N tensor-parallel ranks simulated in one CPU process (how the parallel layers are tested).

Paddle 3.3's CPU build cannot run fleet's model-parallel ops, so the layers of
:mod:`paddlenlp_ext.parallel` are checked by running THE SAME layer classes on
N simulated ranks whose collectives are :class:`SimulatedCollectives`.

Design (lock-step ranks, one autograd graph):

* :meth:`SimulatedGroup.run` runs ``fn(rank)`` for every rank, each in its own
  thread, but strictly one at a time: rank 0 runs until its first collective,
  then rank 1 up to the same collective, ... ; when the last rank arrives, the
  collective is computed for all ranks at once and rank 0 resumes.  Every rank
  must call the same collectives in the same order with the same shapes (SPMD),
  else :class:`SimulationError` names what each rank called.
* Each collective is ONE ``PyLayer`` over the N ranks' tensors (N in, N out),
  so the N ranks' forwards form one autograd graph and the backward runs in the
  caller's thread (``paddle.autograd.backward([loss_0, ..., loss_{N-1}])``):
  rank i's output gradient flows back to rank i's input exactly as fleet's op
  sends it (``identity``: the sum of every rank's gradient; ``all_reduce``:
  rank i's own; ``all_gather``: rank i's slice of its own; ``split``: the
  concatenation of every rank's).
* Each rank has its own random generator state: all start from the state at
  ``run``/``build`` time (fleet seeds the global generator the same on every
  model-parallel rank), and the running rank's state is swapped in and out at
  every hand-over.  Replicated dropout masks and NEFTune noise therefore agree
  across ranks as they do under fleet.  Afterwards the generator is left where
  rank 0's ended.
* ``paddle.is_grad_enabled()`` is thread-local: the caller's setting is applied
  in every rank thread.  AMP ``auto_cast`` state is thread-local too and is NOT
  carried over (run simulations in the layers' own dtype).

:meth:`SimulatedGroup.build` constructs per-rank objects (models with
``tensor_parallel_degree > 1``) under
:func:`paddlenlp_ext.integrations.mp_ops.model_parallel_construction`, so
Paddle's ``ColumnParallelLinear`` / ``RowParallelLinear`` get a
:class:`SimulatedProcessGroup` as their ``model_parallel_group``; the parallel
adapter layers pick the simulated collectives from it (:func:`.collectives.collectives_for`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Callable, List, Optional, Sequence

import paddle
from paddle.autograd import PyLayer

from .collectives import Collectives, check_divisible


class SimulationError(RuntimeError):
    """The simulated ranks diverged (different collectives), one failed, or a wait timed out."""


class _Aborted(SimulationError):
    """Raised in the ranks that were waiting when another rank failed."""


# ------------------------------------------------------------ N-rank PyLayers
def _needs_grad(xs: Sequence[paddle.Tensor]) -> List[bool]:
    return [not x.stop_gradient for x in xs]


def _grad(g: Optional[paddle.Tensor], like_shape, dtype) -> paddle.Tensor:
    return g if g is not None else paddle.zeros(like_shape, dtype=dtype)


def _rank_sum(ts: Sequence[paddle.Tensor]) -> paddle.Tensor:
    total = ts[0]
    for t in ts[1:]:
        total = total + t  # rank order, as a ring all-reduce adds
    return total


class _IdentityN(PyLayer):
    """fleet ``c_identity`` on N ranks: out_i = x_i; grad x_i = sum_j grad out_j."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.needs, ctx.shape, ctx.dtype = _needs_grad(xs), xs[0].shape, xs[0].dtype
        return tuple(x.clone() for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        total = _rank_sum([_grad(g, ctx.shape, ctx.dtype) for g in grads])
        return tuple(total.clone() if n else None for n in ctx.needs)


class _AllReduceN(PyLayer):
    """fleet ``mp_allreduce`` on N ranks: out_i = sum_j x_j; grad x_i = grad out_i."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.needs, ctx.shape, ctx.dtype = _needs_grad(xs), xs[0].shape, xs[0].dtype
        total = _rank_sum(xs)
        return tuple(total.clone() for _ in xs)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(_grad(g, ctx.shape, ctx.dtype) if n else None for g, n in zip(grads, ctx.needs))


class _AllGatherN(PyLayer):
    """fleet ``c_concat`` on N ranks: out_i = concat_j x_j (last axis); grad x_i = slice i of grad out_i."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.needs = _needs_grad(xs)
        ctx.width = int(xs[0].shape[-1])
        full = paddle.concat(list(xs), axis=-1)  # N x [..., w] -> [..., N * w]
        ctx.shape, ctx.dtype = full.shape, full.dtype
        return tuple(full.clone() for _ in xs)

    @staticmethod
    def backward(ctx, *grads):
        w = ctx.width
        return tuple(_grad(g, ctx.shape, ctx.dtype)[..., i * w:(i + 1) * w].clone() if n else None
                     for i, (g, n) in enumerate(zip(grads, ctx.needs)))  # fmt: skip


class _SplitN(PyLayer):
    """``split`` on N ranks: out_i = slice i of x_i (last axis); grad x_i = concat_j grad out_j."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.needs = _needs_grad(xs)
        w = check_divisible(int(xs[0].shape[-1]), len(xs), "split of the last axis")
        outs = tuple(x[..., i * w : (i + 1) * w].clone() for i, x in enumerate(xs))  # [..., d] -> [..., d / N]
        ctx.shape, ctx.dtype = outs[0].shape, outs[0].dtype
        return outs

    @staticmethod
    def backward(ctx, *grads):
        full = paddle.concat([_grad(g, ctx.shape, ctx.dtype) for g in grads], axis=-1)  # [..., d]
        return tuple(full.clone() if n else None for n in ctx.needs)


class _SeqAllGatherN(PyLayer):
    """fleet ``AllGatherOp`` on N ranks: out_i = concat_j x_j (axis 0); grad x_i = slice i of sum_j grad out_j."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.needs, ctx.rows = _needs_grad(xs), int(xs[0].shape[0])
        full = paddle.concat(list(xs), axis=0)  # N x [s, ...] -> [N * s, ...]
        ctx.shape, ctx.dtype = full.shape, full.dtype
        return tuple(full.clone() for _ in xs)

    @staticmethod
    def backward(ctx, *grads):
        total, s = _rank_sum([_grad(g, ctx.shape, ctx.dtype) for g in grads]), ctx.rows
        return tuple(total[i * s : (i + 1) * s].clone() if n else None for i, n in enumerate(ctx.needs))


class _SeqReduceScatterN(PyLayer):
    """fleet ``ReduceScatterOp`` on N ranks: out_i = slice i of sum_j x_j (axis 0); grad x_i = concat_j grad out_j."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.needs = _needs_grad(xs)
        s = check_divisible(int(xs[0].shape[0]), len(xs), "reduce-scatter of the first axis")
        total = _rank_sum(xs)  # [S, ...]
        outs = tuple(total[i * s : (i + 1) * s].clone() for i in range(len(xs)))  # [S / N, ...]
        ctx.shape, ctx.dtype = outs[0].shape, outs[0].dtype
        return outs

    @staticmethod
    def backward(ctx, *grads):
        full = paddle.concat([_grad(g, ctx.shape, ctx.dtype) for g in grads], axis=0)  # [S, ...]
        return tuple(full.clone() if n else None for n in ctx.needs)


class _SeqScatterN(PyLayer):
    """fleet ``ScatterOp`` on N ranks: out_i = slice i of x_i (axis 0); grad x_i = concat_j grad out_j."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.needs = _needs_grad(xs)
        s = check_divisible(int(xs[0].shape[0]), len(xs), "scatter of the first axis")
        outs = tuple(x[i * s : (i + 1) * s].clone() for i, x in enumerate(xs))  # [S, ...] -> [S / N, ...]
        ctx.shape, ctx.dtype = outs[0].shape, outs[0].dtype
        return outs

    @staticmethod
    def backward(ctx, *grads):
        full = paddle.concat([_grad(g, ctx.shape, ctx.dtype) for g in grads], axis=0)  # [S, ...]
        return tuple(full.clone() if n else None for n in ctx.needs)


def _apply_all(layer_cls) -> Callable[[List[paddle.Tensor]], List[paddle.Tensor]]:
    return lambda xs: list(layer_cls.apply(*xs))


# -------------------------------------------------------------- group objects
class SimulatedProcessGroup:
    """Stands in for a fleet model-parallel ``Group`` in a layer's ``model_parallel_group``."""

    def __init__(self, simulation: "SimulatedGroup", rank: int):
        self.simulation = simulation
        self.rank = int(rank)
        self.nranks = simulation.world_size
        self.id = -1  # no communicator: any fleet op on this group fails instead of talking to a real ring
        self.name = f"simulated_mp_group_rank{rank}"

    def is_member(self) -> bool:
        return True

    def collectives(self) -> "SimulatedCollectives":
        return self.simulation.collectives(self.rank)

    def __repr__(self) -> str:
        return f"SimulatedProcessGroup(rank={self.rank}, nranks={self.nranks})"


class SimulatedCollectives(Collectives):
    """Rank ``rank``'s collectives in a :class:`SimulatedGroup` (only valid inside ``SimulatedGroup.run``)."""

    def __init__(self, simulation: "SimulatedGroup", rank: int):
        self.simulation = simulation
        self.rank = int(rank)
        self.world_size = simulation.world_size

    def _call(self, op: str, x: paddle.Tensor, combine) -> paddle.Tensor:
        return self.simulation.exchange(self.rank, (op, tuple(x.shape), str(x.dtype)), x, combine)

    def identity(self, x):
        return self._call("identity", x, _apply_all(_IdentityN))

    def all_reduce(self, x):
        return self._call("all_reduce", x, _apply_all(_AllReduceN))

    def all_gather(self, x):
        return self._call("all_gather", x, _apply_all(_AllGatherN))

    def split(self, x):
        return self._call("split", x, _apply_all(_SplitN))

    def seq_all_gather(self, x):
        return self._call("seq_all_gather", x, _apply_all(_SeqAllGatherN))

    def seq_reduce_scatter(self, x):
        return self._call("seq_reduce_scatter", x, _apply_all(_SeqReduceScatterN))

    def seq_scatter(self, x):
        return self._call("seq_scatter", x, _apply_all(_SeqScatterN))

    def gather_tensor(self, t, axis):
        def combine(ts):
            with paddle.no_grad():
                full = paddle.concat([x.detach() for x in ts], axis=axis)
            return [full.clone() for _ in ts]

        return self._call(f"gather_tensor(axis={axis})", t, combine)

    def __repr__(self) -> str:
        return f"SimulatedCollectives(rank={self.rank}, world_size={self.world_size})"


# ------------------------------------------------------------------ the group
class SimulatedGroup:
    """``world_size`` tensor-parallel ranks in this process (see the module docstring)."""

    def __init__(self, world_size: int, timeout: float = 600.0):
        if int(world_size) < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = int(world_size)
        self.timeout = float(timeout)
        self._cond = threading.Condition()
        self._active = False
        self._turn = 0
        self._arrived: List[Any] = [None] * self.world_size
        self._outputs: List[Any] = [None] * self.world_size
        self._rng: List[Any] = [None] * self.world_size
        self._error: Optional[BaseException] = None
        self._groups = [SimulatedProcessGroup(self, r) for r in range(self.world_size)]

    def process_group(self, rank: int) -> SimulatedProcessGroup:
        return self._groups[rank]

    def collectives(self, rank: int) -> SimulatedCollectives:
        if not 0 <= int(rank) < self.world_size:
            raise ValueError(f"rank {rank} is not in a group of {self.world_size}")
        return SimulatedCollectives(self, rank)

    # ---------------------------------------------------------------- build
    def build(self, fn: Callable[[int], Any], seed: int = 2024) -> List[Any]:
        """``[fn(rank) for rank]``, each inside ``model_parallel_construction(process_group(rank))``
        and starting from the same random state (replicated parameters come out equal, as under fleet)."""
        from ..integrations.mp_ops import model_parallel_construction

        start = paddle.get_rng_state()
        out, end0 = [], None
        for r in range(self.world_size):
            paddle.set_rng_state(start)
            with model_parallel_construction(self._groups[r], seed=seed):
                out.append(fn(r))
            if r == 0:
                end0 = paddle.get_rng_state()
        paddle.set_rng_state(end0)
        return out

    # ------------------------------------------------------------------ run
    def run(self, fn: Callable[[int], Any]) -> List[Any]:
        """``[fn(0), ..., fn(N-1)]`` run in lock step (collectives rendezvous); re-raises a rank's error."""
        with self._cond:
            if self._active:
                raise SimulationError("SimulatedGroup.run() does not nest")
            self._active, self._turn, self._error = True, 0, None
            self._arrived = [None] * self.world_size
            self._outputs = [None] * self.world_size
        start = paddle.get_rng_state()
        self._rng = [start] * self.world_size
        grad = paddle.is_grad_enabled()
        try:
            with concurrent.futures.ThreadPoolExecutor(self.world_size, thread_name_prefix="simulated-rank") as ex:
                futures = [ex.submit(self._rank_main, r, fn, grad) for r in range(self.world_size)]
                concurrent.futures.wait(futures)
            errors = [f.exception() for f in futures]
            root = next((e for e in errors if e is not None and not isinstance(e, _Aborted)), None)
            root = root or next((e for e in errors if e is not None), None)
            if root is not None:
                raise root
            return [f.result() for f in futures]
        finally:
            paddle.set_rng_state(self._rng[0])
            with self._cond:
                self._active = False

    def _rank_main(self, rank: int, fn, grad: bool):
        done = False
        try:
            with self._cond:
                self._wait_turn(rank)
            paddle.set_rng_state(self._rng[rank])
            with paddle.set_grad_enabled(grad):
                out = fn(rank)
            self.exchange(rank, ("end of SimulatedGroup.run",), None, None)
            done = True
            return out
        finally:
            self._leave(rank, done)

    def _leave(self, rank: int, done: bool) -> None:
        with self._cond:
            if done:
                self._rng[rank] = paddle.get_rng_state()
                self._turn = rank + 1
            elif self._error is None:
                self._error = _Aborted(f"simulated rank {rank} failed")
            self._cond.notify_all()

    def _wait_turn(self, rank: int) -> None:
        """Wait (holding the condition) until it is ``rank``'s turn; abort if a rank failed."""
        deadline = time.monotonic() + self.timeout
        while self._turn != rank and self._error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._error = SimulationError(f"simulated rank {rank} waited {self.timeout:.0f}s for its turn")
                self._cond.notify_all()
                raise self._error
            self._cond.wait(remaining)
        if self._error is not None:
            raise _Aborted(f"simulated rank {rank} stopped: {self._error}")

    def exchange(self, rank: int, signature: tuple, payload: Any, combine) -> Any:
        """Rank ``rank`` arrives at a collective; returns its share of ``combine(all payloads)``."""
        with self._cond:
            if not self._active:
                raise SimulationError("simulated collectives only work inside SimulatedGroup.run()")
            if self._error is not None:
                raise _Aborted(f"simulated rank {rank} stopped: {self._error}")
            self._rng[rank] = paddle.get_rng_state()
            self._arrived[rank] = (signature, payload)
            if rank == self.world_size - 1:
                sigs = [a[0] for a in self._arrived]
                if any(s != sigs[0] for s in sigs):
                    calls = "; ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
                    self._error = SimulationError(f"simulated ranks diverged at a collective: {calls}")
                    self._cond.notify_all()
                    raise self._error
                payloads = [a[1] for a in self._arrived]
                self._arrived = [None] * self.world_size
                outs = combine(payloads) if combine is not None else [None] * self.world_size
                self._outputs = list(outs)
                self._turn = 0
            else:
                self._turn = rank + 1
            self._cond.notify_all()
            self._wait_turn(rank)
            out, self._outputs[rank] = self._outputs[rank], None
        paddle.set_rng_state(self._rng[rank])
        return out
