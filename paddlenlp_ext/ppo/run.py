"""Build a PPO run (``load_config(..., mode="ppo")``) and train: GRPO's run with :class:`~.trainer.PPOTrainer`."""

from __future__ import annotations

from typing import Any, Dict


def run(cfg) -> Dict[str, Any]:
    """Train as configured; returns the run summary (also output_dir/run_summary.json)."""
    from ..grpo.run import run as grpo_run
    from .trainer import PPOTrainer

    return grpo_run(cfg, PPOTrainer)
