"""Reading a run config for planning: ``config.parse.load_config`` minus the checks about *this* machine.

A plan is made on a laptop for a GPU cluster: the config's model and data directories need not
exist here, bf16 O2 is fine although this Paddle build is CPU-only, and tensor_parallel_degree 4
needs no 4-process launch.  So the config is parsed by ``load_config`` (unknown keys, types, ranges
and every cross-check still apply: exit 2 naming the key), and only the problems listed in
``TOLERATED`` -- the machine, the launch, the file system, and layouts paddlenlp_ext cannot run
yet but PaddleNLP can -- are set aside: the config is parsed again with neutral values for those
keys, and the original values are put back on the result.  tests/test_planner.py checks that
every pattern still matches what ``load_config`` says.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from typing import List, Sequence, Tuple

from ..config.environment import PARALLEL_KEYS
from ..config.parse import ConfigError, RunConfig, load_config, parse_overrides, read_json_config
from .shapes import read_model_shape

#: load_config problems a plan does not care about -> what is set aside (see the module doc)
TOLERATED = {
    "launch": re.compile(r"needs a multiple of \d+ processes but this run has \d+"),
    "gpu_precision": re.compile(r"(fp16=true|bf16=true with fp16_opt_level=O2) needs a GPU"),
    "device": re.compile(r"device=gpu but the installed Paddle .* is a CPU build"),
    "model_dir": re.compile(r"model_name_or_path .* is not a model directory"),
    "data_dir": re.compile(r"dataset_name_or_path .* (is not a directory|has no (train|dev)\.json)"),
    "tokenizer_dir": re.compile(r"tokenizer_name_or_path .* is not a directory"),
    "chat_template": re.compile(r"chat_template file .* not found"),
    # a checkpoint to resume from changes nothing in the memory of a step
    "resume": re.compile(r"resume_from_checkpoint"),
    # methods / combinations paddlenlp_ext does not run pipeline parallel (PaddleNLP's pipeline does)
    "pipeline": re.compile(r"pipeline_parallel_degree=\d+ (with |is not supported)"),
}

#: notes for the plan when a layout runs in PaddleNLP but not (yet) in paddlenlp_ext
UNSUPPORTED_NOTES = {
    "pipeline": "this method or combination does not run with pipeline_parallel_degree > 1 in paddlenlp_ext (full "
                "fine-tuning, LoRA family and LoKr do, docs/parallel.md); the plan is for PaddleNLP's pipeline",
}


def _raw(path: str, overrides: Sequence[str]) -> dict:
    raw = dict(read_json_config(path)) if path else {}
    for k, v in parse_overrides(overrides):
        raw[k] = v
    return raw


def _as_int(value, default: int = 1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):  # load_config reported it already if it mattered
        return default


@contextlib.contextmanager
def _launched(world: int):
    """PADDLE_TRAINERS_NUM as a launch of ``world`` processes would set it (restored on exit)."""
    old = os.environ.get("PADDLE_TRAINERS_NUM")
    os.environ["PADDLE_TRAINERS_NUM"] = str(world)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PADDLE_TRAINERS_NUM", None)
        else:
            os.environ["PADDLE_TRAINERS_NUM"] = old


def load_plan_config(path: str, overrides: Sequence[str] = (), mode: str = "sft") -> Tuple[RunConfig, List[str]]:
    """``(RunConfig, notes)`` for planning.  ConfigError (exit 2) for every problem not in ``TOLERATED``;
    PlanError when the model is neither a directory with config.json nor a built-in shape."""
    try:
        return load_config(path, overrides, mode=mode), []
    except ConfigError as e:
        problems = e.problems
    kinds = {}
    for p in problems:
        kind = next((k for k, rx in TOLERATED.items() if rx.search(p)), None)
        if kind is None:
            real = [q for q in problems if not any(rx.search(q) for rx in TOLERATED.values())]
            raise ConfigError(real) from None
        kinds.setdefault(kind, []).append(p)
    raw = _raw(path, overrides)
    neutral: List[str] = []
    restore_training = {}
    world = 1
    for key in PARALLEL_KEYS:
        world *= max(1, _as_int(raw.get(key, 1)))
    for p in kinds.get("gpu_precision", []):
        if "fp16=true needs a GPU" in p:
            restore_training["fp16"] = True
            neutral += ["--fp16", "false"]
        else:  # bf16=true with fp16_opt_level=O2
            restore_training["fp16_opt_level"] = "O2"
            neutral += ["--fp16_opt_level", "O1"]
    if "device" in kinds:
        restore_training["device"] = "gpu"
        neutral += ["--device", "cpu"]
    if "pipeline" in kinds:
        restore_training["pipeline_parallel_degree"] = _as_int(raw.get("pipeline_parallel_degree"))
        restore_training["virtual_pp_degree"] = _as_int(raw.get("virtual_pp_degree"))
        neutral += ["--pipeline_parallel_degree", "1", "--virtual_pp_degree", "1"]
    for kind, key in (("tokenizer_dir", "tokenizer_name_or_path"), ("chat_template", "chat_template"),
                      ("resume", "resume_from_checkpoint")):
        if kind in kinds:
            neutral += [f"--{key}", "null"]
    model_name = str(raw.get("model_name_or_path", ""))
    data_name = raw.get("dataset_name_or_path")
    with tempfile.TemporaryDirectory(prefix="plan_") as tmp, _launched(world):
        if "model_dir" in kinds:
            shape = read_model_shape(model_name)  # PlanError: neither a config.json nor a built-in shape
            model_dir = os.path.join(tmp, "model")
            os.makedirs(model_dir)
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump({"model_type": shape.model_type}, f)  # what the config checks read (dropout keys)
            neutral += ["--model_name_or_path", model_dir]
        if "data_dir" in kinds:
            data_dir = os.path.join(tmp, "data")
            os.makedirs(data_dir)
            for split in ("train", "dev"):
                open(os.path.join(data_dir, f"{split}.json"), "w").close()
            neutral += ["--dataset_name_or_path", data_dir]
        cfg = load_config(path, list(overrides) + neutral, mode=mode)
    cfg.training.update(restore_training)
    if "model_dir" in kinds:
        cfg.model.model_name_or_path = model_name
    if "data_dir" in kinds:
        cfg.data.dataset_name_or_path = data_name
    notes = [UNSUPPORTED_NOTES[k] for k in UNSUPPORTED_NOTES if k in kinds]
    return cfg, notes
