"""The reward-model mode of ``load_config`` (``llm/run_reward.py``), without importing paddle.

``load_config(path, overrides, mode="reward")`` accepts PaddleNLP's reward-model data keys
(``schema.RewardArgument``) on top of the model / training keys, held in ``cfg.dpo`` (the
preference key group shared with DPO and KTO, so the model build, the planner and resume read one
place).  This module holds the reward checks on top of the ones preference training shares
(``config.dpo.preference_problems``: lengths, adapters, parallelism, data files).
"""

from __future__ import annotations

from typing import List

from ..models.families import read_model_type
from ..models.heads import BODY_ATTRIBUTE
from .dpo import preference_problems

#: metric_for_best_model values of a reward run (RewardTrainer's eval metrics, without "eval_")
REWARD_BEST_METRICS = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")


def reward_problems(cfg, where: str) -> List[str]:
    m, d = cfg.model, cfg.data
    p: List[str] = []
    if d.lazy:
        p.append(f"{where}: lazy=true is not supported for reward models yet (the pairs are read in memory); "
                 "remove lazy")
    model_type = read_model_type(m.model_name_or_path) if m.model_name_or_path else None
    if model_type is not None and model_type not in BODY_ATTRIBUTE:
        p.append(f"{where}: model_type {model_type!r} cannot take a reward head here: the score head reads the "
                 f"decoder's last hidden state, supported for {', '.join(sorted(BODY_ATTRIBUTE))}")
    return p + preference_problems(cfg, where, "reward", REWARD_BEST_METRICS)
