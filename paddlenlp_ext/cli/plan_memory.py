"""``llm/tools/plan_memory.py``: will this run fit, and on how many devices?"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

from .common import EXIT_CONFIG_ERROR, pop_tool_args
from ..config.parse import ConfigError
from ..planner.config import load_plan_config
from ..planner.layout import MAX_DEVICES, suggest
from ..planner.report import parse_size, suggestion_text, table, to_json
from ..planner.run import estimate_for_run
from ..planner.shapes import PlanError

USAGE = """usage: python llm/tools/plan_memory.py CONFIG.json [--key value ...] [--device_memory 24GB] [--json]
                                     [--target gpu|cpu] [--world_size N] [--max_devices N]

Per-device memory of a fine-tuning run, from its config alone (no GPU, no weights: the model's
config.json or a built-in shape: Llama-2-7b/13b/70b, Qwen2-0.5B/1.5B/7B).  Every --key value is a
config override, as for llm/run_finetune.py.
  --device_memory SIZE  memory of one device (24GB = 24 GiB); also suggests the smallest layout that fits
  --json                print {"per_device_bytes", "breakdown", "assumptions", ...} instead of the table
  --target gpu|cpu      plan for GPUs (default; cpu when the config says device cpu) or this CPU build
  --world_size N        devices of the launch (default: the product of the parallel degrees)
  --max_devices N       largest layout --device_memory may suggest (default 1024)
See docs/parallel.md."""

TOOL_OPTIONS = {"device_memory": parse_size, "json": str, "target": str, "world_size": int, "max_devices": int}


def _flag(argv: List[str], name: str) -> List[str]:
    """``--json`` takes no value: give it one so pop_tool_args can take it out."""
    out = []
    for i, a in enumerate(argv):
        out.append(a)
        if a == f"--{name}" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            out.append("true")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else EXIT_CONFIG_ERROR
    opts, rest = pop_tool_args(_flag(argv, "json"), TOOL_OPTIONS)
    as_json = opts.get("json", "false").lower() in ("true", "1", "yes")
    target = opts.get("target")
    if target not in (None, "gpu", "cpu"):
        print(f"--target: expected gpu or cpu, got {target!r}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if not rest or rest[0].startswith("--"):
        print("error: the first argument must be the config file (CONFIG.json)\n" + USAGE, file=sys.stderr)
        return EXIT_CONFIG_ERROR
    path, overrides = rest[0], rest[1:]
    try:
        cfg, notes = load_plan_config(path, overrides)
        if target is None:  # a plan is for the GPUs of the run unless the config itself says cpu
            target = "cpu" if cfg.training.get("device") == "cpu" else "gpu"
        est = estimate_for_run(cfg, target=target, world_size=opts.get("world_size"))
        est.assumptions.extend(notes)
        device_memory = opts.get("device_memory")
        suggestions = (
            suggest(est.inputs, device_memory, opts.get("max_devices", MAX_DEVICES)) if device_memory else None
        )
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except PlanError as e:
        print(f"plan error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if as_json:
        print(json.dumps(to_json(est, device_memory, suggestions), indent=2))
    else:
        print(table(est))
        if device_memory:
            print()
            print(suggestion_text(est, device_memory, suggestions, path, overrides))
    return 0
