"""PaddleNLP's pipeline-parallel models (``*ForCausalLMPipe``): the private names we touch.

* :func:`is_pipeline_model`, :func:`pipeline_layer_names` -- a pipeline stage
  names its sublayers by position (``"3.self_attn.q_proj"``; with virtual
  stages ``"2.1.self_attn.q_proj"``); PaddleNLP's ``PipelinePretrainedModel``
  maps its state-dict keys to the plain model's (``state_dict()``), and we
  read that mapping once, by parameter identity, to name adapter layers as the
  plain model does (``"llama.layers.2.self_attn.q_proj"``).  Reading it caches
  PaddleNLP's mapping (``_single_to_pp_mapping``), which would go stale when
  adapters add parameters, so :func:`pipeline_layer_names` clears it again.
* :func:`set_pipeline_loss` -- the criterion the last stage applies is
  ``PipelineLayer._loss_fn`` (a list, one per loss); :func:`set_pipeline_inputs`
  -- how the Trainer's batches become the stages' inputs is the model's
  ``_prepare_pipeline_inputs_func``.
* :func:`pipeline_stage_construction` -- builds one stage of a
  ``*ForCausalLMPipe`` in a single CPU process without ``fleet.init``, for the
  simulation (:mod:`paddlenlp_ext.parallel.pp_sim`): PaddleNLP's
  constructor asks ``fleet.get_hybrid_communicate_group()`` for the model-
  parallel size and the topology (``_parent_hcg`` gives the stage), and
  ``PipelineLayer`` reads ``ParallelEnv().device_id`` (unset on a CPU build)
  and the strategy's ``hybrid_configs``.  The context installs exactly those
  and removes them on exit; it refuses to run when fleet is initialized.
* :func:`gpu_argument_routing` -- PaddleNLP's pipeline layers pass
  ``(hidden, mask / start-end rows, position ids)`` as a tuple without its
  ``None`` entries and tell them apart by dtype, with one rule on GPU (int32 =
  FlashMask start rows, int64 = position ids) and another elsewhere.  The
  simulation runs the GPU rule (what a real run takes) by answering ``"gpu"``
  to the pipeline modules' ``get_env_device`` only.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Dict, Iterator

import paddle
from paddle.distributed import fleet
from paddle.distributed.fleet.base import topology
from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import PipelineLayer

from .mp_ops import restore_fleet
from .versions import check_versions

check_versions()

__all__ = [
    "is_pipeline_model",
    "pipeline_layer_names",
    "set_pipeline_loss",
    "set_pipeline_inputs",
    "pipeline_stage_construction",
    "gpu_argument_routing",
    "pipeline_stage",
    "RELIED_ON",
    "RELIED_ON_ATTRIBUTES",
]

_PIPE_MODULES = ("paddlenlp.transformers.llama.modeling_pp", "paddlenlp.transformers.qwen2.modeling_pp")

RELIED_ON = [
    ("paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers.PipelineLayer", "__init__",
     ("self", "layers", "num_stages", "topology", "loss_fn", "seg_method", "recompute_interval", "recompute_ctx",
      "num_virtual_pipeline_stages", "use_cudagraph", "use_dualpipev")),
    ("paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers.PipelineLayer", "forward",
     ("self", "input", "chunk_id")),
    ("paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers.PipelineLayer", "get_num_virtual_stages",
     ("self",)),
    ("paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers.PipelineLayer", "_construct_shared_comm",
     ("self",)),
    ("paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers.PipelineLayer",
     "allreduce_shared_weight_gradients", ("self",)),
    ("paddle.distributed.fleet.base.topology.CommunicateTopology", "__init__", ("self", "hybrid_group_names", "dims")),
    ("paddlenlp.transformers.model_utils.PipelinePretrainedModel", "state_dict", ("self", "args", "kwargs")),
    ("paddlenlp.transformers", "AutoModelForCausalLMPipe", None),
    ("paddlenlp.transformers.llama.modeling_pp.LlamaForCausalLMPipe", "_prepare_pipeline_inputs_func", ("inputs",)),
    ("paddlenlp.trainer.Trainer", "training_pipeline_step", ("self", "model", "inputs")),
    ("paddlenlp.transformers.llama.modeling_pp", "get_env_device", None),
    ("paddlenlp.transformers.qwen2.modeling_pp", "get_env_device", None),
]  # fmt: skip

RELIED_ON_ATTRIBUTES = [
    ("paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers.PipelineLayer.__init__", "_loss_fn"),
    ("paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers.PipelineLayer.__init__", "_stage_id"),
    ("paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers.PipelineLayer.__init__", "_num_stages"),
    ("paddlenlp.transformers.model_utils.PipelinePretrainedModel.__init_hook__", "_single_to_pp_mapping"),
    ("paddlenlp.transformers.model_utils.PipelinePretrainedModel.__init_hook__", "_pp_to_single_mapping"),
    ("paddle.distributed.parallel.ParallelEnv.__init__", "_device_id"),
    ("paddle.distributed.fleet.fleet.Fleet._init_hybrid_parallel_env", "_hcg"),
    ("paddle.distributed.fleet.fleet.Fleet.init", "_user_defined_strategy"),
]


def is_pipeline_model(model: Any) -> bool:
    return isinstance(model, PipelineLayer)


def pipeline_stage(model: Any) -> tuple:
    """``(stage id, number of stages)`` of a pipeline model."""
    return int(model._stage_id), int(model._num_stages)


def pipeline_layer_names(model: Any) -> Dict[str, str]:
    """``{stage sublayer name: the plain model's name}`` for every sublayer that holds parameters directly."""
    plain_of = {id(t): name for name, t in model.state_dict().items()}  # PaddleNLP maps the keys
    model._single_to_pp_mapping = None  # recomputed on the next state_dict(), with any added parameters
    model._pp_to_single_mapping = None
    out: Dict[str, str] = {}
    for layer_name, layer in model.named_sublayers():
        for pname, p in layer.named_parameters(include_sublayers=False):
            plain = plain_of.get(id(p))
            if plain is None or not plain.endswith("." + pname):
                continue
            out[layer_name] = plain[: -len(pname) - 1]
    return out


def set_pipeline_loss(model: Any, criterion: paddle.nn.Layer) -> None:
    """Make ``criterion(last stage output, labels)`` the loss the last stage computes."""
    model._loss_fn = [criterion]


def set_pipeline_inputs(model: Any, fn: Any) -> None:
    """Make ``fn(batch or micro-batches) -> [first-stage inputs, last-stage inputs]`` the model's
    ``_prepare_pipeline_inputs_func``: PaddleNLP's Trainer hands it to the wrapped model and calls it
    in ``training_pipeline_step`` and ``prediction_pipeline_step`` (its DPO trainer sets it the same way)."""
    model._prepare_pipeline_inputs_func = fn


class _StageHybridGroup:
    """The part of a hybrid-parallel group PaddleNLP's pipeline constructors ask for: one stage, no TP."""

    def __init__(self, num_stages: int, stage_id: int):
        self._topo = topology.CommunicateTopology(
            ["data", "pipe", "sharding", "sep", "model"], [1, int(num_stages), 1, 1, 1]
        )
        self._topo._parent_hcg = SimpleNamespace(stage_id=int(stage_id), _pp_degree=int(num_stages))

    def topology(self):
        return self._topo

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self):
        return None

    # what paddlenlp_ext.parallel.pipeline_group.FleetPipelineGroup asks (its collective is not simulated here)
    def get_stage_id(self) -> int:
        return int(self._topo._parent_hcg.stage_id)

    def get_pipe_parallel_world_size(self) -> int:
        return int(self._topo._parent_hcg._pp_degree)

    def get_pipe_parallel_group(self):
        return None


_active: list = []


@contextlib.contextmanager
def pipeline_stage_construction(num_stages: int, stage_id: int) -> Iterator[None]:
    """Within the block, ``*ForCausalLMPipe(config)`` builds stage ``stage_id`` of ``num_stages``."""
    if topology._HYBRID_PARALLEL_GROUP is not None or getattr(fleet.fleet, "_hcg", None) is not None:
        raise RuntimeError("pipeline_stage_construction: fleet is initialized; build the model normally")
    if _active:
        raise RuntimeError("pipeline_stage_construction blocks do not nest (one stage is built at a time)")
    f = fleet.fleet
    had_strategy, had_hcg = hasattr(f, "_user_defined_strategy"), hasattr(f, "_hcg")
    had_device = "_device_id" in vars(paddle.distributed.ParallelEnv)
    _active.append(stage_id)
    shared_comm = PipelineLayer._construct_shared_comm
    try:
        # tied embeddings (SharedLayerDesc): fleet would build a communication group between the first and last
        # stage and broadcast the table; the simulation builds none (every stage loads the same weights) and sums
        # the copies' gradients itself, as fleet's allreduce_shared_weight_gradients does
        PipelineLayer._construct_shared_comm = lambda self: {}
        f._hcg = _StageHybridGroup(num_stages, stage_id)
        if not had_strategy:
            f._user_defined_strategy = fleet.DistributedStrategy()
        if not had_device:
            paddle.distributed.ParallelEnv._device_id = 0  # a CPU build never sets it
        yield
    finally:
        PipelineLayer._construct_shared_comm = shared_comm
        restore_fleet(had_hcg, had_strategy)
        if not had_device and "_device_id" in vars(paddle.distributed.ParallelEnv):
            del paddle.distributed.ParallelEnv._device_id
        _active.clear()


@contextlib.contextmanager
def gpu_argument_routing() -> Iterator[None]:
    """PaddleNLP's pipeline layers read their tuple arguments by the GPU rule within the block."""
    import importlib

    saved = []
    try:
        for name in _PIPE_MODULES:
            mod = importlib.import_module(name)
            saved.append((mod, mod.get_env_device))
            mod.get_env_device = lambda: "gpu"
        yield
    finally:
        for mod, fn in saved:
            mod.get_env_device = fn
