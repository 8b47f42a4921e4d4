"""Tensor and pipeline parallelism's low layer, and their CPU simulations.

Owns what knows the model is split over devices, below the model, quantization and adapter code that builds
on it (docs/architecture.md, the layering):

* :mod:`.collectives` -- the small interface a tensor-parallel layer talks
  through (identity / all-reduce / all-gather / split + a plain gather for
  checkpoints); :class:`FleetCollectives` calls fleet's ``mp_ops`` (through
  :mod:`paddlenlp_ext.integrations.mp_ops`).
* :mod:`.shard` -- which tensor-parallel linears are supported
  (Paddle's ``ColumnParallelLinear`` / ``RowParallelLinear`` and their
  sequence-parallel versions) and one rank's
  :class:`ShardSpec` of them.
* :mod:`.layers` -- our decoder's tensor-parallel base layers (column/row linears with fused segments, the
  vocab-parallel embedding).
* :mod:`.simulate` -- N ranks in one CPU process (:class:`SimulatedGroup`): the
  same layer classes with simulated collectives, how tensor parallelism is tested
  on machines whose Paddle build cannot run fleet's tensor parallelism.
* :mod:`.pipeline_group` -- the pipeline group as one stage sees it (:class:`FleetPipelineGroup`);
  :mod:`.pp_sim` -- N stages in one CPU process (PaddleNLP's own stage
  classes, activations sent and gradients received by hand).
* :mod:`.sharding_sim` -- sharding stages 2 and 3 (GPU-only) simulated as their
  partitioned optimizer step: Paddle's own partition and slice parameters
  (through :mod:`paddlenlp_ext.integrations.sharding`), k replicas in one process.

Built on it, in the packages that own what is split: the TP LoRA/VeRA layers
(``adapters.tp_layers``), complete TP adapter checkpoints (``adapters.tp_checkpoint``), adapters on a
pipeline stage (``adapters.pp_stage``), the per-shard quantized base (``quant.parallel_linear``) and expert
parallelism of the MoE blocks (``models.decoder.expert_parallel``).

Never imports training, data, models, quant or adapters.  Names load lazily (importing the package
imports nothing heavy).
"""

from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {
    "Collectives": "collectives",
    "FleetCollectives": "collectives",
    "collectives_for": "collectives",
    "ShardSpec": "shard",
    "shard_spec": "shard",
    "ParallelLinear": "layers",
    "VocabParallelEmbedding": "layers",
    "SimulatedGroup": "simulate",
    "SimulatedCollectives": "simulate",
    "SimulatedProcessGroup": "simulate",
    "SimulationError": "simulate",
    "simulate_sharded_training": "sharding_sim",
    "FleetPipelineGroup": "pipeline_group",
    "build_stages": "pp_sim",
    "run_pipeline": "pp_sim",
    "SimulatedPipelineGroup": "pp_sim",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
