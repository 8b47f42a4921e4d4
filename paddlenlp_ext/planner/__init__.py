"""Memory planning: bytes per device of a fine-tuning run, from its config alone (no paddle import).

Owns the memory model (weights, gradients, optimizer states, activations, logits, step
temporaries, framework overhead per device: ``memory``), the parameter accounting of each method
(full, LoRA / VeRA / LoKr, quantized bases, prefix tuning: ``params``), model shapes from a
config.json or built-in names (``shapes``), parallel layouts and the smallest one that fits
(``layout``), reading a run config for a machine that is not this one (``config``), and
``llm/tools/plan_memory.py`` (``cli``, ``report``).  It never imports paddle: a plan needs no GPU
and no weights.  Calibration against real CPU runs: bench/plan_memory.py, docs/parallel.md.

The training CLI prints one line at start::

    from paddlenlp_ext.planner import estimate_for_run, format_one_line
    print(format_one_line(estimate_for_run(cfg), device_memory=total_bytes))
"""

from .config import load_plan_config
from .layout import Suggestion, suggest
from .memory import BREAKDOWN_KEYS, Estimate, Layout, PlanInputs, estimate
from .params import QuantSpec, account, quantized_linear_bytes
from .report import parse_size
from .run import estimate_for_run, format_one_line, host_memory_bytes, inputs_from_run, layout_from_config
from .shapes import BUILTIN_SHAPES, ModelShape, PlanError, read_model_shape

__all__ = [
    "BREAKDOWN_KEYS",
    "BUILTIN_SHAPES",
    "Estimate",
    "Layout",
    "ModelShape",
    "PlanError",
    "PlanInputs",
    "QuantSpec",
    "Suggestion",
    "account",
    "estimate",
    "estimate_for_run",
    "format_one_line",
    "host_memory_bytes",
    "inputs_from_run",
    "layout_from_config",
    "load_plan_config",
    "parse_size",
    "quantized_linear_bytes",
    "read_model_shape",
    "suggest",
]
