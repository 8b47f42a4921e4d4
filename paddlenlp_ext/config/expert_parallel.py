"""Config-time checks of ``expert_parallel_degree`` (PaddleNLP's / PaddleFormers' training key), without paddle.

What is built (docs/moe.md, "Expert parallelism"): the decoder's MoE blocks split over N ranks, each holding
E/N experts, tokens dispatched and combined by all-to-all (``models/decoder/expert_parallel.py``), verified by simulating the
ranks on the CPU.  The training CLI does not launch it yet: on fleet, the experts' gradients must be kept out of
the data-parallel / sharding all-reduce over the ranks that do not hold them, which nothing here can run or
check on this CPU-only build.  So every ``expert_parallel_degree`` > 1 is refused before loading (exit 2, naming
the key): first with the reason specific to the model (no experts, a count the degree does not divide, fused
experts, another parallelism), else with the reason above.  PaddleNLP's default -1 and 1 mean "off".
"""

from typing import List, Optional

from ..models.family_table import row
from .problems import Problem

KEY = "expert_parallel_degree"


def expert_parallel_problems(cfg, model_type: str, model_dir: Optional[str]) -> List[str]:
    """The refusals of ``expert_parallel_degree`` (and PaddleNLP's ``use_expert_parallel``) for ``cfg``.

    Worked examples: ``expert_parallel_degree: 2`` on a llama -> ["expert_parallel_degree=2: llama has no
    experts ..."]; ``3`` on a mixtral with 8 experts -> ["expert_parallel_degree=3: config.json has 8 experts,
    not a multiple of 3 ..."]; ``1`` or ``-1`` anywhere -> [].
    """
    t = cfg.training
    try:
        degree = int(t.get(KEY, -1) if t.get(KEY, -1) is not None else -1)
    except (TypeError, ValueError):
        return [f"{KEY}={t.get(KEY)!r} must be an integer (1 or -1: no expert parallelism)"]
    family = row(model_type)
    on_moe_row = family is not None and family.decoder and family.arch is not None and family.arch.mlp == "moe"
    out = []
    if t.get("use_expert_parallel", False) and family is not None and family.decoder:
        out.append(
            f"use_expert_parallel=true: {model_type} trains on our decoder, which does not read PaddleNLP's "
            f"switch; remove use_expert_parallel ({KEY} is the key, docs/moe.md)"
        )
    if degree <= 1:
        return out
    head = f"{KEY}={degree}"
    if not on_moe_row:
        where = (
            "trains on its PaddleNLP-layout model here (models/qwen3), which has no expert-parallel dispatch"
            if model_type == "qwen3_moe"
            else "has no experts on the decoder's MoE rows"
        )
        return out + [f"{head}: {model_type} {where}; set {KEY} to 1 (or remove it)"]
    spec = _spec(model_dir, model_type)
    if spec is not None and spec.num_experts % degree:
        return out + [
            f"{head}: config.json has {spec.num_experts} experts, not a multiple of {degree} (each rank "
            f"holds num_experts / {KEY}); choose a {KEY} that divides {spec.num_experts}"
        ]
    if spec is not None and spec.fused_experts:
        return out + [
            f"{head}: {model_type}'s experts are fused 3-D parameters (one tensor for all experts), "
            f"which the expert-parallel dispatch does not split; set {KEY} to 1"
        ]
    others = [
        f"{k}={t.get(k)}"
        for k in (
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "sep_parallel_degree",
            "context_parallel_degree",
        )
        if int(t.get(k, 1) or 1) > 1
    ]
    # a layout PaddleFormers runs and this build does not (yet): tagged, so a memory plan for another machine
    # sets it aside (planner/config.py); the model-specific refusals above stay untagged
    if others:
        return out + [
            Problem(
                f"{head} with {', '.join(others)} is not supported (expert parallelism is verified alone); "
                f"set {KEY} to 1 or the others to 1",
                "expert_parallel",
            )
        ]
    return out + [
        Problem(
            f"{head}: expert parallelism of {model_type} is verified by simulation only (docs/moe.md, "
            '"Expert parallelism"); the training CLI does not wire fleet\'s expert-parallel group yet (the '
            f"experts' gradients must stay out of the data-parallel all-reduce); set {KEY} to 1",
            "expert_parallel",
        )
    ]


def _spec(model_dir: Optional[str], model_type: str):
    """The MoE spec of ``model_dir``'s config.json, or None when it cannot be read (reported elsewhere)."""
    from ..models.decoder.moe_spec import MoEConfigError, moe_spec
    from ..models.hf_layout import HFLayoutError, read_config_json

    try:
        return moe_spec(read_config_json(model_dir), model_type)
    except (HFLayoutError, MoEConfigError, OSError, TypeError, ValueError, KeyError):
        return None
