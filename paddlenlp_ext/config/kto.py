"""The KTO mode of ``load_config`` (``llm/run_kto.py``), without importing paddle.

``load_config`` in the KTO mode (``config.modes.MODES``) accepts the KTO keys (``schema.KTOArgument``:
PaddleNLP's KTOConfig and KTODataArgument) on top of the model / training keys, held in
``cfg.alignment`` (the preference key group shared with DPO, so the model build, the planner and
resume read one place).  This module holds what differs from DPO: the KTO cross checks
(weights, streaming data) on top of the checks both share (``config.dpo.preference_problems``).
"""

from __future__ import annotations

from typing import List

from .dpo import apply_preference_aliases, preference_problems

#: metric_for_best_model values of a KTO run (KTOTrainer's eval metrics, without "eval_")
KTO_BEST_METRICS = (
    "loss",
    "kto_loss",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
    "loss/chosen",
    "loss/rejected",
)


def apply_kto_aliases(cfg) -> None:
    """PaddleNLP's run_kto.py rewrites (zero padding on, rslora_plus), as derived settings."""
    apply_preference_aliases(cfg, "KTO")


def kto_problems(cfg, where: str) -> List[str]:
    o, d = cfg.alignment, cfg.data
    p: List[str] = []
    if o.desirable_weight == 0 and o.undesirable_weight == 0:
        p.append(f"{where}: desirable_weight and undesirable_weight are both 0: nothing to train")
    if d.lazy:
        p.append(
            f"{where}: lazy=true is not supported for KTO (each example's KL pair is another example's "
            "completion, read in memory); remove lazy"
        )
    return p + preference_problems(cfg, where, "KTO", KTO_BEST_METRICS)
