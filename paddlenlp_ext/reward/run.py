"""Build a reward-model run from a validated RunConfig (``load_config(..., mode="reward")``), then train / evaluate.

``dpo.run.run`` (training args -> tokenizer -> data -> model (+quant) -> adapters -> trainer -> summary)
with the reward data (:func:`~paddlenlp_ext.reward.data.build_reward_datasets`) and a trainer built on
the model with its score head attached (seeded, after the adapters, so it is always trainable) and
saving through :class:`~paddlenlp_ext.reward.io.RewardCheckpointIO`.
"""

from __future__ import annotations

import os
from typing import Any, Dict

from ..config.parse import RunConfig


def _reward_data(data_args, tokenizer, **kw):
    from .data import build_reward_datasets

    return build_reward_datasets(data_args, tokenizer, **kw)


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


def _reward_trainer(cfg: RunConfig, **kw):
    from paddlenlp.trainer import set_seed
    from paddlenlp.utils.log import logger

    from .head import attach_score_head
    from .io import RewardCheckpointIO
    from .trainer import RewardTrainer

    model, args = kw["model"], kw["args"]
    set_seed(args.seed)  # the head's init depends on the seed only
    head = attach_score_head(model)
    logger.info(f"score head: Linear({head.weight.shape[0]} -> 1), trainable; lm_head frozen")
    io = RewardCheckpointIO(kw["adapter_config"], reward_info(cfg, kw["tokenizer"]))
    return RewardTrainer(**kw, reward_config=cfg.alignment, weights_io=io)


def run(cfg: RunConfig) -> Dict[str, Any]:
    """Train and/or evaluate as configured; returns the run summary (also output_dir/run_summary.json)."""
    from ..dpo.run import run as run_preference

    if cfg.alignment is None or cfg.alignment.mode != "reward":
        raise ValueError("reward.run.run needs a reward config: load_config(path, overrides, mode='reward')")
    return run_preference(cfg, build_data=_reward_data, make_trainer=_reward_trainer)
