"""The reward-model mode of ``load_config`` (``llm/run_reward.py``), without importing paddle.

``load_config`` in the reward mode (``config.modes.MODES``) accepts PaddleNLP's reward-model data keys
(``schema.RewardArgument``) on top of the model / training keys, held in ``cfg.alignment`` (the
preference key group shared with DPO and KTO, so the model build, the planner and resume read one
place).  This module holds the reward checks on top of the ones preference training shares
(``config.dpo.preference_problems``: lengths, adapters, parallelism, data files).
"""

from __future__ import annotations

from typing import List

from .dpo import preference_problems

#: metric_for_best_model values of a reward run (RewardTrainer's eval metrics, without "eval_")
REWARD_BEST_METRICS = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")


def reward_problems(cfg, where: str) -> List[str]:
    d = cfg.data
    p: List[str] = []
    if d.lazy:
        p.append(
            f"{where}: lazy=true is not supported for reward models yet (the pairs are read in memory); remove lazy"
        )
    # a family without a body + lm_head split (models/heads.py) is refused by the family table's reward feature
    return p + preference_problems(
        cfg, where, cfg.alignment.mode, REWARD_BEST_METRICS, score_head=True, named_datasets=True
    )
