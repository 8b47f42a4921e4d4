"""PPO (``llm/run_ppo.py``): the run recipe (``training.recipe``) with GRPO's hooks and :class:`~.trainer.PPOTrainer`."""

from __future__ import annotations

from typing import Any, Dict

from ..grpo.run import GRPOHooks
from ..training.recipe import run_recipe


class PPOHooks(GRPOHooks):
    mode = "ppo"

    def __init__(self):
        from .trainer import PPOTrainer

        super().__init__(trainer_cls=PPOTrainer)


def run(cfg) -> Dict[str, Any]:
    """Train as configured; returns the run summary (also output_dir/run_summary.json)."""
    return run_recipe(cfg, PPOHooks())
