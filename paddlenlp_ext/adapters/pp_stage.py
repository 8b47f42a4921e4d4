"""Adapters on pipeline-parallel models: naming, the pipeline group, complete checkpoints.

A pipeline stage (one rank of PaddleNLP's ``*ForCausalLMPipe``) holds some
decoder layers, so it holds the adapters of those layers only.  What this
module adds:

* :func:`prepare_stage_for_adapters` -- the stage's ``{sublayer name: plain
  model name}`` map (``adapters.apply_adapters(layer_names=...)`` matches
  ``target_modules`` and names tensors by the plain names, so configs and
  checkpoints are the same as on one device);
* :func:`attach_pipeline_group` puts the stage's pipeline group on the model
  (:class:`~paddlenlp_ext.parallel.pipeline_group.PipelineGroup`: what a stage
  needs from it to save, its stage index and ``all_gather_object``);
* :func:`save_stage_weights` -- full fine-tuning: every stage writes its own
  layers' weights (PaddleNLP's ``save_pretrained`` with variant ``ppXX``, keys
  already the plain model's), and the first stage writes ``config.json`` (with
  the plain model class) and one ``model.safetensors.index.json`` naming every
  stage's files, so the directory loads as a single-device checkpoint;
* :func:`gather_stage_states` -- every stage's adapter tensors gathered to one
  complete state (keys must not repeat across stages); the first stage writes
  it (``adapters.save_adapter``), so a pipeline checkpoint holds the same tensors
  as the single-device one and merge / ``lora_path`` read it unchanged.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

from ..parallel.pipeline_group import PipelineGroup
from .base import AdapterError, to_numpy_f32

__all__ = [
    "attach_pipeline_group",
    "pipeline_group_of",
    "gather_stage_states",
    "prepare_stage_for_adapters",
    "save_stage_weights",
    "INDEX_NAME",
]

#: the index a single-device ``from_pretrained`` reads (PaddleNLP's SAFE_WEIGHTS_INDEX_NAME)
INDEX_NAME = "model.safetensors.index.json"

_GROUP_ATTR = "_paddlenlp_ext_pipeline_group"


def attach_pipeline_group(model: Any, group: PipelineGroup) -> None:
    setattr(model, _GROUP_ATTR, group)


def pipeline_group_of(model: Any) -> PipelineGroup:
    group = getattr(model, _GROUP_ATTR, None)
    if group is None:
        raise AdapterError(
            "this pipeline stage has no pipeline group attached (adapters.pp_stage.attach_pipeline_group): "
            "its adapters cannot be saved complete"
        )
    return group


def gather_stage_states(model: Any, state: Mapping[str, Any]) -> Tuple[Dict[str, np.ndarray], bool]:
    """(every stage's adapter tensors in stage order, whether this is the first stage)."""
    group = pipeline_group_of(model)
    mine = {k: np.ascontiguousarray(to_numpy_f32(v)) for k, v in state.items()}
    parts = group.all_gather_object(mine)
    if len(parts) != group.num_stages:
        raise AdapterError(f"pipeline gather returned {len(parts)} states for {group.num_stages} stages")
    out: Dict[str, np.ndarray] = {}
    for stage, part in enumerate(parts):
        repeated = sorted(set(part) & set(out))
        if repeated:
            raise AdapterError(f"pipeline stage {stage} holds adapter tensors another stage holds too: {repeated[:5]}")
        out.update(part)
    return out, group.stage == 0


def prepare_stage_for_adapters(model: Any) -> Dict[str, str]:
    """``{sublayer name: plain model name}`` of a pipeline stage, for ``apply_adapters(layer_names=...)``."""
    from ..integrations.paddlenlp_pipe import pipeline_layer_names

    return pipeline_layer_names(model)


def _stage_files(output_dir: str, variant: str) -> Dict[str, List[str]]:
    """``{file: [keys]}`` of the weight files ``save_pretrained(variant=variant)`` wrote."""
    from safetensors import safe_open

    pattern = re.compile(rf"model\.{re.escape(variant)}(-\d{{5}}-of-\d{{5}})?\.safetensors")
    out = {}
    for name in sorted(os.listdir(output_dir)):
        if pattern.fullmatch(name):
            with safe_open(os.path.join(output_dir, name), "np") as f:
                out[name] = list(f.keys())
    return out


def save_stage_weights(model: Any, output_dir: str, max_shard_size: str = "4GB") -> None:
    """Write this stage's weights into ``output_dir``; the first stage adds config and the whole index.

    A collective over the pipeline group: every stage calls it with the same ``output_dir``.
    """
    group = pipeline_group_of(model)
    variant = f"pp{group.stage:02d}"
    os.makedirs(output_dir, exist_ok=True)
    for name in _stage_files(output_dir, variant):  # an earlier save's shards (their number may differ)
        os.remove(os.path.join(output_dir, name))
    # is_main_process=False: the stage writes its weights only (the config says the Pipe class)
    model.save_pretrained(
        output_dir, safe_serialization=True, max_shard_size=max_shard_size, variant=variant, is_main_process=False
    )
    files = _stage_files(output_dir, variant)
    total = sum(int(np.prod(t.shape)) * t.element_size() for t in model.state_dict().values())
    parts = group.all_gather_object((files, total))
    if group.stage != 0:
        return
    weight_map: Dict[str, str] = {}
    for stage, (stage_files, _) in enumerate(parts):
        for name, keys in stage_files.items():
            for k in keys:
                if k in weight_map:
                    raise AdapterError(f"pipeline stage {stage} saved {k!r}, which another stage saved too")
                weight_map[k] = name
    index = {"metadata": {"total_size": sum(t for _, t in parts)}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(output_dir, INDEX_NAME), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2) + "\n")
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__.removesuffix("Pipe")]  # LlamaForCausalLMPipe -> LlamaForCausalLM
    config.save_pretrained(output_dir)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(output_dir)
