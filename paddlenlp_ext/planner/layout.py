"""The smallest parallel layout that fits a device: fewest devices, then sharding over TP over PP.

Candidates, for 1, 2, 4, 8, ... devices: tensor parallel 1/2/4/8 (within a node; it must divide the
attention and key/value heads), pipeline parallel (powers of two up to the layer count), and the
devices left over either sharded (stage 1, 2 or 3 over all of them) or plain data parallel.  Among
the layouts of the fewest devices that fit, the one with the least pipeline, then the least tensor
parallelism, then the lowest sharding stage wins (each step down that list communicates less).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List

from ..adapters.methods import TABLE
from .memory import Estimate, Layout, PlanInputs, estimate

TP_CHOICES = (1, 2, 4, 8)
MAX_DEVICES = 1024


@dataclass
class Suggestion:
    estimate: Estimate
    supported: bool  # paddlenlp_ext runs this layout today
    why_not: str = ""


def supported(inp: PlanInputs, layout: Layout) -> str:
    """Why paddlenlp_ext cannot run ``layout`` yet ("" when it can).  Tensor parallelism runs full
    fine-tuning, LoRA (rsLoRA, LoRA+), VeRA and quantized bases; pipeline parallelism full fine-tuning
    and LoRA (rsLoRA, LoRA+) / LoKr adapters on a float base (paddlenlp_ext/parallel, docs/parallel.md)."""
    m = inp.params
    row = TABLE.get(m.method)  # an adapter method's row says what it runs with (adapters.methods)
    if layout.pp > 1:
        if m.method != "full" and not (row is not None and row.supports.pipeline_parallel):
            runs = " and ".join(r.title for r in TABLE.values() if r.supports.pipeline_parallel)
            return f"pipeline parallelism with {m.method} does not run in paddlenlp_ext (full fine-tuning, {runs} do)"
        if m.pissa or m.quantized_linears:
            return "pipeline parallelism with pissa or a quantized base does not run in paddlenlp_ext"
        if layout.tp > 1:
            return "tensor x pipeline parallelism does not run in paddlenlp_ext yet"
    if layout.tp > 1 and (m.method == "prefix" or (row is not None and not row.supports.tensor_parallel)):
        return f"tensor parallelism with {m.method} does not run in paddlenlp_ext"
    if layout.tp > 1 and inp.params.pissa:
        return "tensor parallelism with pissa does not run in paddlenlp_ext"
    return ""


def candidates(inp: PlanInputs, devices: int) -> Iterator[Layout]:
    s = inp.shape
    for pp in (2**k for k in range(0, 11)):
        if pp > s.num_hidden_layers or pp > devices or devices % pp:
            continue
        for tp in TP_CHOICES:
            if tp * pp > devices or devices % (tp * pp) or s.num_attention_heads % tp or s.num_key_value_heads % tp:
                continue
            rest = devices // (tp * pp)
            if rest == 1:
                yield Layout(tp=tp, pp=pp)
                continue
            for stage in (1, 2, 3):
                yield Layout(tp=tp, pp=pp, sharding_stage=stage, sharding_degree=rest)
            yield Layout(tp=tp, pp=pp, dp=rest)


def _rank(layout: Layout):
    # plain data parallelism never saves memory, so among equals it comes after sharding
    return (layout.pp, layout.tp, layout.sharding_stage if layout.sharding_stage else 4)


def suggest(inp: PlanInputs, device_memory: int, max_devices: int = MAX_DEVICES) -> List[Suggestion]:
    """The best layout that fits and, if paddlenlp_ext cannot run it, also the best one it can run.

    Empty when nothing up to ``max_devices`` fits (the batch or sequence must shrink, or recompute help)."""
    out: List[Suggestion] = []
    n = 1
    while n <= max_devices and not any(sg.supported for sg in out):
        fitting = []
        for layout in candidates(inp, n):
            est = estimate(inp, layout)
            if est.per_device_bytes <= device_memory:
                fitting.append(est)
        for est in sorted(fitting, key=lambda e: _rank(e.layout)):
            why = supported(inp, est.layout)
            if not out or (not why and not any(sg.supported for sg in out)):
                out.append(Suggestion(est, not why, why))
        n *= 2
    return out
