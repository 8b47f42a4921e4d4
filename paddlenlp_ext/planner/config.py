"""Reading a run config for planning: ``config.parse.load_config`` minus the checks about *this* machine.

A plan is made on a laptop for a GPU cluster: the config's model and data directories need not
exist here, bf16 O2 is fine although this Paddle build is CPU-only, and tensor_parallel_degree 4
needs no 4-process launch.  So the config is parsed by ``load_config`` (unknown keys, types, ranges
and every cross-check still apply: exit 2 naming the key), and only the problems of the kinds in
``TOLERATED`` (``config.problems``: the checks tag what they found) -- the machine, the launch, the
file system, and layouts paddlenlp_ext cannot run yet but PaddleNLP can -- are set aside: the
config is parsed again with neutral values for those keys, and the original values are put back on
the result.  No problem is recognised by its wording.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import List, Sequence, Tuple

from ..config.environment import PARALLEL_KEYS
from ..config.parse import ConfigError, RunConfig, load_config, parse_overrides, read_json_config
from ..config.problems import kind_of
from .shapes import read_model_shape

#: the kinds of load_config problems (config.problems.Problem.kind) a plan does not care about: the
#: machine, the launch, the file system, and layouts PaddleNLP runs but paddlenlp_ext does not (yet)
TOLERATED = (
    "launch",
    "gpu_fp16",
    "gpu_bf16_o2",
    "device",
    "model_dir",
    "data_dir",
    "tokenizer_dir",
    "chat_template",
    "resume",
    "pipeline",
    "expert_parallel",
)

#: notes for the plan when a layout runs in PaddleNLP but not (yet) in paddlenlp_ext
UNSUPPORTED_NOTES = {
    "pipeline": "this method or combination does not run with pipeline_parallel_degree > 1 in paddlenlp_ext (full "
    "fine-tuning, LoRA family and LoKr do, docs/parallel.md); the plan is for PaddleNLP's pipeline",
    "expert_parallel": "expert_parallel_degree > 1 is verified by simulation only in paddlenlp_ext (the training "
    "CLI refuses it, docs/moe.md); the plan is for PaddleFormers' expert parallelism (E / EP experts per rank)",
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
        kinds.setdefault(kind_of(p), []).append(p)
    if any(k not in TOLERATED for k in kinds):
        raise ConfigError([q for q in problems if kind_of(q) not in TOLERATED]) from None
    raw = _raw(path, overrides)
    neutral: List[str] = []
    restore_training = {}
    world = 1
    for key in PARALLEL_KEYS:
        world *= max(1, _as_int(raw.get(key, 1)))
    if "gpu_fp16" in kinds:
        restore_training["fp16"] = True
        neutral += ["--fp16", "false"]
    if "gpu_bf16_o2" in kinds:
        restore_training["fp16_opt_level"] = "O2"
        neutral += ["--fp16_opt_level", "O1"]
    if "device" in kinds:
        restore_training["device"] = "gpu"
        neutral += ["--device", "cpu"]
    if "expert_parallel" in kinds:
        restore_training["expert_parallel_degree"] = _as_int(raw.get("expert_parallel_degree"))
        neutral += ["--expert_parallel_degree", "1"]
    if "pipeline" in kinds:
        restore_training["pipeline_parallel_degree"] = _as_int(raw.get("pipeline_parallel_degree"))
        restore_training["virtual_pp_degree"] = _as_int(raw.get("virtual_pp_degree"))
        neutral += ["--pipeline_parallel_degree", "1", "--virtual_pp_degree", "1"]
    for kind, key in (
        ("tokenizer_dir", "tokenizer_name_or_path"),
        ("chat_template", "chat_template"),
        ("resume", "resume_from_checkpoint"),
    ):
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
