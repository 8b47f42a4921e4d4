"""Paddle's group-sharded (sharding stage 2 / 3) optimizer internals, and the one fix they need.

Sharding stage 2 (``os_g``) and stage 3 (``p_g_os``) run only on GPU/XPU
(``group_sharded_parallel`` asserts the device), so their partitioned
optimizer step is shown on CPU by simulation
(:mod:`paddlenlp_ext.parallel.sharding_sim`).  The simulation partitions and
slices with Paddle's own code, reached here through private names:

``stage2_partition``  ``GroupShardedOptimizerStage2._segment_params``: which
                      rank owns (steps and broadcasts) each parameter --
                      greedy, each parameter to the rank with the fewest
                      trainable elements so far
``stage3_slice``      ``group_sharded_stage3._TensorWrapper``: the parameter
                      a rank's optimizer really steps under stage 3 -- a new
                      parameter named ``"slice@" + name`` holding the rank's
                      slice, with the regularizer and the per-parameter
                      learning rate (LoRA+) copied, nothing else

and the gradient scale both stages apply before reducing
(``_world_size_scaling = 1.0 / nranks``: a mean over the sharding ranks).

The fix, :func:`slice_aware_decay`: PaddleNLP's ``Trainer.create_optimizer``
decides weight decay by name (``apply_decay_param_fun(name)``: ``name in``
the names of the parameters that are not bias or norm).  Under stage 3 the
optimizer asks with ``"slice@" + name``, which is in no list, so weight decay
is silently off for every parameter.  The wrapper answers for ``"slice@X"``
what it answers for ``X``.  The simulation's negative control shows the
difference (tests/test_sharding_sim.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, List, Optional, Sequence

import paddle
from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage3
from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
    GroupShardedOptimizerStage2,
)

from .versions import check_versions

check_versions()

__all__ = ["SLICE_PREFIX", "stage2_partition", "stage3_slice", "slice_aware_decay", "RELIED_ON", "RELIED_ON_ATTRIBUTES"]

#: the name prefix stage 3 gives the slice parameters its optimizer steps
SLICE_PREFIX = "slice@"

RELIED_ON = [
    ("paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2.GroupShardedOptimizerStage2",
     "_segment_params", ("self",)),
    ("paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3", "_TensorWrapper", ("param",)),
    ("paddle.optimizer.AdamW", "__init__", None),
]  # fmt: skip

#: (method, attribute it must still assign): checked by tests/test_integrations.py
RELIED_ON_ATTRIBUTES = [
    ("paddle.optimizer.AdamW.__init__", "_apply_decay_param_fun"),
    (
        "paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2.GroupShardedStage2.__init__",
        "_world_size_scaling",
    ),
    (
        "paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3.GroupShardedStage3.__init__",
        "_world_size_scaling",
    ),
]


def stage2_partition(params: Sequence[paddle.Tensor], nranks: int) -> List[List[paddle.Tensor]]:
    """The parameters each of ``nranks`` sharding-stage-2 ranks owns, by Paddle's own rule.

    ``params`` in the optimizer's order (``optimizer._parameter_list``), as
    ``group_sharded_parallel`` passes them.
    """
    # _segment_params reads only these attributes of the optimizer (and caches in the name-mangled one)
    holder = SimpleNamespace(
        world_size=int(nranks), _local_params=list(params), _GroupShardedOptimizerStage2__segment_params=[]
    )
    return [list(p) for p in GroupShardedOptimizerStage2._segment_params(holder)]


def stage3_slice(param: paddle.Tensor, values: paddle.Tensor) -> paddle.Tensor:
    """The parameter a stage-3 rank's optimizer steps for its slice ``values`` [n] of ``param``.

    Built by Paddle's ``_TensorWrapper``: named ``"slice@" + param.name``, with
    ``param``'s regularizer and ``optimize_attr["learning_rate"]``; it shares
    (and takes over) the memory of ``values``.
    """
    storage = paddle.Tensor(values.detach().clone(), zero_copy=False)  # _TensorWrapper clears its input
    holder = SimpleNamespace(
        fw_storage=storage, name=param.name, regularizer=param.regularizer, optimize_attr=param.optimize_attr
    )
    return group_sharded_stage3._TensorWrapper(holder)


def slice_aware_decay(optimizer: Any) -> Any:
    """Make ``optimizer``'s name-based weight-decay rule answer for stage-3 slices as for their parameters.

    Returns ``optimizer`` (changed in place); an optimizer without such a rule is returned as is.
    """
    decide: Optional[Callable[[str], bool]] = getattr(optimizer, "_apply_decay_param_fun", None)
    if decide is None or getattr(decide, "slice_aware", False):
        return optimizer

    def decide_unsliced(name: str) -> bool:
        return decide(name[len(SLICE_PREFIX) :] if name.startswith(SLICE_PREFIX) else name)

    decide_unsliced.slice_aware = True
    optimizer._apply_decay_param_fun = decide_unsliced
    return optimizer
