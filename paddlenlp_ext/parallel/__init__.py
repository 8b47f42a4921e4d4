"""Tensor and pipeline parallelism for adapters (and quantized bases), and their CPU simulations.

Owns everything that knows the model is split over devices (a linear over a
model-parallel group, the layers over pipeline stages):

* :mod:`.collectives` -- the small interface a tensor-parallel layer talks
  through (identity / all-reduce / all-gather / split + a plain gather for
  checkpoints); :class:`FleetCollectives` calls fleet's ``mp_ops`` (through
  :mod:`paddlenlp_ext.integrations.mp_ops`).
* :mod:`.shard` -- which tensor-parallel linears are supported
  (Paddle's ``ColumnParallelLinear`` / ``RowParallelLinear`` and their
  sequence-parallel versions) and one rank's
  :class:`ShardSpec` of them.
* :mod:`.adapter_layers` -- LoRA (rsLoRA, LoRA+) and VeRA on those layers,
  picked by ``adapters.apply_adapters`` for tensor-parallel targets; PiSSA and
  LoKr are refused.
* :mod:`.quantized` -- :class:`QuantizedParallelLinear`, the QLoRA base that
  quantizes each rank's weight shard (``quant.quantize_model`` uses it).
* :mod:`.checkpoint` -- complete adapter checkpoints from sharded models
  (gather on save, offline unshard).
* :mod:`.simulate` -- N ranks in one CPU process (:class:`SimulatedGroup`): the
  same layer classes with simulated collectives, how all of the above is tested
  on machines whose Paddle build cannot run fleet's tensor parallelism.
* :mod:`.pp_adapters` -- adapters on a pipeline stage (PaddleNLP's
  ``*ForCausalLMPipe``): plain layer names, the pipeline group
  (:class:`FleetPipelineGroup`) and the checkpoint gathered to the first stage;
  :mod:`.pp_sim` -- N stages in one CPU process (PaddleNLP's own stage
  classes, activations sent and gradients received by hand).
* :mod:`.expert` -- expert parallelism of the decoder's MoE blocks
  (``expert_parallel_degree``): each rank keeps E/N experts, tokens go to their
  expert's rank by all-to-all and come back; fleet's ``alltoall_single`` or N
  simulated ranks (:class:`SimulatedExpertComm`).
* :mod:`.sharding_sim` -- sharding stages 2 and 3 (GPU-only) simulated as their
  partitioned optimizer step: Paddle's own partition and slice parameters
  (through :mod:`paddlenlp_ext.integrations.sharding`), k replicas in one process.

Never imports training or data.  Names load lazily (importing the package
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
    "ParallelLoRALinear": "adapter_layers",
    "ParallelVeRALinear": "adapter_layers",
    "PARALLEL_METHODS": "adapter_layers",
    "QuantizedParallelLinear": "quantized",
    "full_adapter_state_dict": "checkpoint",
    "unshard_adapter_states": "checkpoint",
    "adapter_split_axes": "checkpoint",
    "adapter_shard_specs": "checkpoint",
    "ParallelLinear": "layers",
    "VocabParallelEmbedding": "layers",
    "SimulatedGroup": "simulate",
    "SimulatedCollectives": "simulate",
    "SimulatedProcessGroup": "simulate",
    "SimulationError": "simulate",
    "simulate_sharded_training": "sharding_sim",
    "FleetPipelineGroup": "pp_adapters",
    "attach_pipeline_group": "pp_adapters",
    "prepare_stage_for_adapters": "pp_adapters",
    "apply_expert_parallel": "expert",
    "SimulatedExpertComm": "expert",
    "FleetExpertComm": "expert",
    "build_stages": "pp_sim",
    "run_pipeline": "pp_sim",
    "SimulatedPipelineGroup": "pp_sim",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
