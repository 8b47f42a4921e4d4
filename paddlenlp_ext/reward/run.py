"""Reward models (``llm/run_reward.py``): the run recipe (``training.recipe``) with DPO's preference hooks
(``dpo.run.PreferenceHooks``), the reward data (:func:`~paddlenlp_ext.reward.data.build_reward_datasets`) and
a trainer built on the model with its score head attached (seeded, after the adapters, so it is always
trainable) and saving through :class:`~paddlenlp_ext.reward.io.RewardCheckpointIO`.
"""

from __future__ import annotations

import os
from typing import Any, Dict

from ..config.parse import RunConfig
from ..dpo.run import PreferenceHooks
from ..training.recipe import run_recipe


def reward_info(cfg: RunConfig, tokenizer) -> Dict[str, Any]:
    """What ``reward_config.json`` records (see :mod:`paddlenlp_ext.reward.io`)."""
    from ..data.tokenize import resolve_chat_template

    template = cfg.data.chat_template
    return {
        "base_model_name_or_path": os.path.abspath(cfg.model.model_name_or_path),
        "chat_template": bool(resolve_chat_template(tokenizer, template)),
        "chat_template_file": os.path.abspath(template) if template else None,
        "max_seq_len": cfg.alignment.max_seq_len,
        "max_prompt_len": cfg.alignment.max_prompt_len,
    }


class RewardHooks(PreferenceHooks):
    mode = "reward"

    def data(self, cfg, args, tokenizer, resume_cursor):
        from .data import build_reward_datasets

        return self.build_data(build_reward_datasets, cfg, args, tokenizer, resume_cursor)

    def trainer(self, cfg, built, args, tokenizer, data):
        from paddlenlp.trainer import set_seed
        from paddlenlp.utils.log import logger

        from .head import attach_score_head
        from .io import RewardCheckpointIO
        from .trainer import RewardTrainer

        set_seed(args.seed)  # the head's init depends on the seed only
        head = attach_score_head(built.model)
        logger.info(f"score head: Linear({head.weight.shape[0]} -> 1), trainable; lm_head frozen")
        io = RewardCheckpointIO(built.adapter_config, reward_info(cfg, tokenizer))
        return RewardTrainer(
            **self.trainer_kwargs(built, args, tokenizer, data), reward_config=cfg.alignment, weights_io=io
        )


def run(cfg: RunConfig) -> Dict[str, Any]:
    """Train and/or evaluate as configured; returns the run summary (also output_dir/run_summary.json)."""
    return run_recipe(cfg, RewardHooks())
