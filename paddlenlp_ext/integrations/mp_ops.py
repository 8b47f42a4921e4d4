"""Paddle fleet's model-parallel collectives, and building its tensor-parallel layers without ``fleet.init``.

Two jobs, both on private names of ``paddle.distributed.fleet``:

* the collectives a tensor-parallel layer needs, called exactly as Paddle's own
  ``ColumnParallelLinear`` / ``RowParallelLinear`` and PaddleNLP's
  ``ColumnParallelLoRALinear`` / ``RowParallelLoRALinear`` call them
  (``paddle.distributed.fleet.layers.mpu.mp_ops``):

  ``c_identity``    ``_c_identity``: forward identity, backward all-reduce (sum) of the input gradient
  ``mp_allreduce``  ``_mp_allreduce``: forward all-reduce (sum, in place on its input), backward identity
  ``c_concat``      ``_c_concat``: all-gather along the last axis (its grad op takes this rank's slice)

  and, for sequence parallelism, the PyLayers Paddle's ``ColumnSequenceParallelLinear`` /
  ``RowSequenceParallelLinear`` use (``paddle.distributed.fleet.utils.sequence_parallel_utils``;
  they communicate over the hybrid group's model-parallel group): ``seq_all_gather``
  (``AllGatherOp``), ``seq_reduce_scatter`` (``ReduceScatterOp``), ``seq_scatter`` (``ScatterOp``).

  They need a GPU/XPU build: Paddle 3.3's CPU build has no ``c_identity``
  kernel, and gloo refuses ``all_reduce`` on the calculation stream.
  ``_c_split`` is deliberately not used: its dynamic-mode backward gathers the
  gradient along axis 0 (``all_gather_into_tensor``) although its forward split
  the last axis; :mod:`paddlenlp_ext.parallel.collectives` splits locally and
  gathers the gradient with ``c_concat`` instead.

* :func:`model_parallel_construction`: lets Paddle's ``ColumnParallelLinear`` /
  ``RowParallelLinear`` -- and PaddleNLP models built with
  ``tensor_parallel_degree > 1``, which call them without ``mp_group`` -- be
  constructed in one process without ``fleet.init``, as one rank of a
  simulated group (:mod:`paddlenlp_ext.parallel.simulate`).  Their ``__init__``
  reads ``fleet.fleet._user_defined_strategy`` (the mp_configs),
  ``topology._HYBRID_PARALLEL_GROUP`` (group, world size, rank) and draws the
  weight under the rng tracker's ``model_parallel_rng`` state.  The context
  manager installs a default strategy, a hybrid group that answers with the
  given group, and that rng state, and removes exactly what it installed on
  exit.  It refuses to run when fleet is initialized for real.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import paddle
from paddle.distributed import fleet
from paddle.distributed.fleet.base import topology
from paddle.distributed.fleet.layers.mpu import mp_ops
from paddle.distributed.fleet.layers.mpu.random import MODEL_PARALLEL_RNG, get_rng_state_tracker
from paddle.distributed.fleet.utils import sequence_parallel_utils

from .versions import check_versions

check_versions()

__all__ = [
    "c_identity",
    "mp_allreduce",
    "c_concat",
    "seq_all_gather",
    "seq_reduce_scatter",
    "seq_scatter",
    "current_model_parallel_group",
    "model_parallel_construction",
    "is_installed",
    "RELIED_ON",
]

RELIED_ON = [
    ("paddle.distributed.fleet.layers.mpu.mp_ops", "_c_identity", ("tensor", "group", "skip_c_identity_dynamic")),
    ("paddle.distributed.fleet.layers.mpu.mp_ops", "_mp_allreduce",
     ("tensor", "op", "group", "use_calc_stream", "use_model_parallel", "skip_c_identity_dynamic")),
    ("paddle.distributed.fleet.layers.mpu.mp_ops", "_c_concat", ("tensor", "group")),
    ("paddle.distributed.fleet.utils.sequence_parallel_utils.AllGatherOp", "forward", ("ctx", "input")),
    ("paddle.distributed.fleet.utils.sequence_parallel_utils.ReduceScatterOp", "forward", ("ctx", "input")),
    ("paddle.distributed.fleet.utils.sequence_parallel_utils.ScatterOp", "forward", ("ctx", "input")),
    ("paddle.distributed.fleet.utils.sequence_parallel_utils.ColumnSequenceParallelLinear", "__init__",
     ("self", "in_features", "out_features", "weight_attr", "has_bias", "gather_output", "fuse_matmul_bias",
      "mp_group", "name")),
    ("paddle.distributed.fleet.utils.sequence_parallel_utils.RowSequenceParallelLinear", "__init__",
     ("self", "in_features", "out_features", "weight_attr", "has_bias", "input_is_parallel", "fuse_matmul_bias",
      "mp_group", "name")),
    ("paddle.distributed.fleet.base.topology", "_HYBRID_PARALLEL_GROUP", None),
    ("paddle.distributed.fleet.layers.mpu.random", "MODEL_PARALLEL_RNG", None),
    ("paddle.distributed.fleet.layers.mpu.random.RNGStatesTracker", "add", ("self", "name", "seed")),
    ("paddle.distributed.fleet", "DistributedStrategy", None),
    # the attributes paddlenlp_ext.parallel.shard reads from the layers it wraps
    ("paddle.distributed.fleet.meta_parallel.ColumnParallelLinear", "__init__",
     ("self", "in_features", "out_features", "weight_attr", "has_bias", "gather_output", "fuse_matmul_bias",
      "mp_group", "name")),
    ("paddle.distributed.fleet.meta_parallel.RowParallelLinear", "__init__",
     ("self", "in_features", "out_features", "weight_attr", "has_bias", "input_is_parallel", "fuse_matmul_bias",
      "mp_group", "name")),
]  # fmt: skip


#: (method, attribute it must still assign): checked by tests/test_integrations.py
RELIED_ON_ATTRIBUTES = [
    ("paddle.distributed.fleet.fleet.Fleet._init_hybrid_parallel_env", "_hcg"),
]


# ------------------------------------------------------------------ collectives
def c_identity(x: paddle.Tensor, group: Any) -> paddle.Tensor:
    """Forward: ``x``.  Backward: the input gradient all-reduced (sum) over ``group``."""
    return mp_ops._c_identity(x, group=group)


def seq_all_gather(x: paddle.Tensor) -> paddle.Tensor:
    """Sequence parallel: forward all-gather along axis 0, backward reduce-scatter (fleet's ``AllGatherOp``)."""
    return sequence_parallel_utils.AllGatherOp.apply(x)


def seq_reduce_scatter(x: paddle.Tensor) -> paddle.Tensor:
    """Sequence parallel: forward reduce-scatter along axis 0, backward all-gather (``ReduceScatterOp``)."""
    return sequence_parallel_utils.ReduceScatterOp.apply(x)


def seq_scatter(x: paddle.Tensor) -> paddle.Tensor:
    """Sequence parallel: forward this rank's slice of axis 0, backward all-gather (``ScatterOp``)."""
    return sequence_parallel_utils.ScatterOp.apply(x)


def mp_allreduce(x: paddle.Tensor, group: Any) -> paddle.Tensor:
    """Forward: ``x`` all-reduced (sum) over ``group`` -- in place: ``x`` must be a fresh tensor.
    Backward: identity."""
    return mp_ops._mp_allreduce(x, group=group, use_calc_stream=True, use_model_parallel=True)


def c_concat(x: paddle.Tensor, group: Any) -> paddle.Tensor:
    """All-gather along the last axis (rank order).  Backward: this rank's slice of the gradient."""
    return mp_ops._c_concat(x, group=group)


# ---------------------------------------------------- construction without fleet
class _SimulatedHybridGroup:
    """What the tensor-parallel layers' ``__init__`` asks the hybrid communicate group."""

    def __init__(self, group: Any):
        self.group = group

    def get_model_parallel_group(self) -> Any:
        return self.group

    def get_model_parallel_world_size(self) -> int:
        return int(self.group.nranks)

    def get_model_parallel_rank(self) -> int:
        return int(self.group.rank)

    def __getattr__(self, name: str) -> Any:
        # Anything else (pipeline stage, data-parallel group, ...) is a question a simulated
        # tensor-parallel group cannot answer: fail loudly instead of guessing.
        raise AttributeError(
            f"simulated hybrid-parallel group has no {name!r}: only the model-parallel group is simulated"
        )


def restore_fleet(had_hcg: bool, had_strategy: bool) -> None:
    """Undo a simulation's ``fleet.fleet._hcg`` / ``_user_defined_strategy`` (kept if they existed before)."""
    f = fleet.fleet
    if had_hcg:
        f._hcg = None
    elif hasattr(f, "_hcg"):
        del f._hcg
    if not had_strategy and hasattr(f, "_user_defined_strategy"):
        del f._user_defined_strategy


_installed: list = []
_default_strategy: list = []  # one DistributedStrategy, made on first use (making one logs a line)


def is_installed() -> bool:
    """True while a :func:`model_parallel_construction` block is active."""
    return bool(_installed)


@contextlib.contextmanager
def model_parallel_construction(group: Any, seed: int = 2024) -> Iterator[None]:
    """Within the block, Paddle's tensor-parallel layers build as rank ``group.rank`` of ``group``.

    ``group`` needs ``nranks`` and ``rank`` (a :class:`~paddlenlp_ext.parallel.simulate.SimulatedProcessGroup`).
    ``seed + group.rank`` seeds the ``model_parallel_rng`` state the layers draw their
    weights from, as fleet seeds it differently per model-parallel rank.
    """
    if topology._HYBRID_PARALLEL_GROUP is not None or getattr(fleet.fleet, "_hcg", None) is not None:
        raise RuntimeError(
            "model_parallel_construction: fleet is initialized (a hybrid-parallel group exists); "
            "build the model normally, the real group is used"
        )
    if _installed:
        raise RuntimeError("model_parallel_construction blocks do not nest (one rank is built at a time)")
    fleet_obj = fleet.fleet
    had_strategy = hasattr(fleet_obj, "_user_defined_strategy")
    had_hcg = hasattr(fleet_obj, "_hcg")
    tracker = get_rng_state_tracker()
    rng_seed = int(seed) + int(group.rank)
    add_rng = MODEL_PARALLEL_RNG not in tracker.states_
    if add_rng and rng_seed in tracker.seeds_:
        raise RuntimeError(f"model_parallel_construction: rng seed {rng_seed} is already registered; pass another seed")
    _installed.append(group)
    try:
        if not had_strategy:
            if not _default_strategy:
                _default_strategy.append(fleet.DistributedStrategy())
            fleet_obj._user_defined_strategy = _default_strategy[0]
        topology._HYBRID_PARALLEL_GROUP = _SimulatedHybridGroup(group)
        # Paddle's sequence-parallel linears ask fleet.get_hybrid_communicate_group() instead
        fleet_obj._hcg = topology._HYBRID_PARALLEL_GROUP
        if add_rng:
            tracker.add(MODEL_PARALLEL_RNG, rng_seed)
        yield
    finally:
        topology._HYBRID_PARALLEL_GROUP = None
        restore_fleet(had_hcg, had_strategy)
        if add_rng:
            tracker.states_.pop(MODEL_PARALLEL_RNG, None)
            tracker.seeds_.discard(rng_seed)
        _installed.clear()


def current_model_parallel_group() -> Any:
    """The model-parallel group of this process: fleet's hybrid communicate group (``fleet.init`` with
    ``mp_degree``), or the simulated group inside :func:`model_parallel_construction`."""
    hcg = topology._HYBRID_PARALLEL_GROUP
    if hcg is None:
        raise RuntimeError(
            "tensor_parallel_degree > 1 needs fleet's hybrid-parallel group (launch with "
            "python -m paddle.distributed.launch; PaddleNLP's Trainer calls fleet.init)"
        )
    return hcg.get_model_parallel_group()
