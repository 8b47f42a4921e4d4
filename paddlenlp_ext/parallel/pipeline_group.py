"""The pipeline group as one stage sees it: its stage index and ``all_gather_object``.

:class:`FleetPipelineGroup` asks fleet's hybrid group (GPU runs); the CPU simulation brings its own
(:mod:`.pp_sim`).  A stage's adapters and weights are saved complete through it
(``adapters.pp_stage``).
"""

from __future__ import annotations

from typing import Any, List

__all__ = ["PipelineGroup", "FleetPipelineGroup"]


class PipelineGroup:
    """The pipeline group as one stage sees it."""

    stage: int
    num_stages: int

    def all_gather_object(self, obj: Any) -> List[Any]:  # pragma: no cover - interface
        """Every stage's ``obj``, in stage order (a collective: every stage calls it)."""
        raise NotImplementedError


class FleetPipelineGroup(PipelineGroup):
    """fleet's pipeline group of this process (``fleet.init`` with ``pp_degree > 1``)."""

    def __init__(self):
        from paddle.distributed import fleet

        hcg = fleet.get_hybrid_communicate_group()
        self._group = hcg.get_pipe_parallel_group()
        self.stage = int(hcg.get_stage_id())
        self.num_stages = int(hcg.get_pipe_parallel_world_size())

    def all_gather_object(self, obj: Any) -> List[Any]:
        import paddle.distributed as dist

        out: List[Any] = []
        dist.all_gather_object(out, obj, group=self._group)
        return out
