"""Build a DPO run from a validated RunConfig (``load_config(..., mode="dpo")``), then train / evaluate.

Order as ``training.run``: training args -> tokenizer -> preference data
(validated, tokenized, packed) -> model (streamed, quantized) -> adapters ->
:class:`~paddlenlp_ext.dpo.trainer.DPOTrainer`.  Everything but the data and
the trainer is ``training.run``'s own functions.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict

from ..config.parse import ConfigError, RunConfig
from ..training.run import (
    attach_data_callbacks,
    build_model,
    library_patches,
    start_run,
    train_and_save,
    write_run_summary,
)


def preference_data_args(cfg: RunConfig) -> SimpleNamespace:
    """What ``dpo.data.build_preference_datasets`` reads, from the dpo and data groups."""
    o, d = cfg.alignment, cfg.data
    return SimpleNamespace(
        train_dataset_path=o.train_dataset_path,
        dev_dataset_path=o.dev_dataset_path,
        max_seq_len=o.max_seq_len,
        max_prompt_len=o.max_prompt_len,
        zero_padding=d.zero_padding,
        greedy_zero_padding=d.greedy_zero_padding,
        lazy=d.lazy,
        chat_template=d.chat_template,
        resume_cursor=None,
        dataset_dir=d.dataset_dir,
    )


def _dpo_data(data_args, tokenizer, **kw):
    from .data import build_preference_datasets

    return build_preference_datasets(data_args, tokenizer, **kw)


def _dpo_trainer(cfg, **kw):
    from .trainer import DPOTrainer

    return DPOTrainer(**kw, dpo_config=cfg.alignment)


def run(cfg: RunConfig, build_data: Callable = _dpo_data, make_trainer: Callable = _dpo_trainer) -> Dict[str, Any]:
    """Train and/or evaluate as configured; returns the run summary (also output_dir/run_summary.json).

    ``build_data(data_args, tokenizer, do_train=, do_eval=, flash_mask=, seed=)`` and
    ``make_trainer(cfg, **trainer_kwargs)`` are DPO's; ``kto.run`` passes KTO's."""
    if cfg.alignment is None:
        raise ValueError("dpo.run.run needs a preference config: load_config(path, overrides, mode='dpo' or 'kto')")
    from ..training.heap import limit_heap_retention
    from ..training.logfile import run_logging

    limit_heap_retention()
    with run_logging(cfg), library_patches(cfg):  # train.log and the console as in fine-tuning
        return _run(cfg, build_data, make_trainer)


def _run(cfg: RunConfig, build_data: Callable, make_trainer: Callable) -> Dict[str, Any]:
    from paddlenlp.utils.log import logger

    from ..data.reader import DataError
    from ..training.callbacks import attach_step_callbacks
    from ..training.console import current
    from ..training.reporting import attach_reporting

    wall_start = time.time()
    args, tokenizer, resume_cursor, resume_step = start_run(cfg)
    data_args = preference_data_args(cfg)
    data_args.resume_cursor = resume_cursor  # lazy: the stream seeks to the checkpoint's cursor
    try:
        data = build_data(
            data_args,
            tokenizer,
            do_train=args.do_train,
            do_eval=args.do_eval,
            flash_mask=cfg.model.flash_mask,
            seed=args.seed,
        )
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        raise ConfigError([f"{cfg.source or 'config'}: {e}"]) from e
    for split, report in data.reports.items():
        logger.info(f"data[{split}]: {json.dumps(report, default=str)}")

    built = build_model(cfg, args)
    trainer = make_trainer(
        cfg,
        model=built.model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.dev,
        tokenizer=tokenizer,
        data_collator=data.collator,
        adapter_config=built.adapter_config,
    )
    from ..adapters import count_parameters
    from ..training.moe_aux import attach_moe_log

    # MoE rows: router_aux_loss_coef * aux of the policy forward joins the loss (logged with the expert load); the
    # bias update after each optimizer step, as in fine-tuning (docs/moe.md)
    attach_moe_log(trainer, built.model, float(cfg.model.moe_router_bias_update_rate or 0.0))

    built.trainable, built.total = count_parameters(built.model)  # make_trainer may add layers (a reward head)
    attach_data_callbacks(trainer, data.train, cfg, args, resume_step)
    attach_reporting(trainer, cfg, args, built, data.reports, tokens=lambda: trainer.trained_real_tokens)
    step_timer = attach_step_callbacks(trainer)  # step times + heap trim (training/heap.py)
    summary: Dict[str, Any] = {
        **built.summary(),
        "world_size": args.world_size,
        "data": data.reports,
        "loss_type": trainer.loss_type,
        "reference": trainer.reference,
    }
    if args.do_eval and args.eval_before_train and args.do_train:  # eval-only: the one evaluation below
        metrics = trainer.evaluate()
        summary["eval_before_train"] = metrics
        current().line(f"eval loss before training: {metrics['eval_loss']:.4f}")
    if args.do_train:
        train_time = train_and_save(trainer, cfg, args, data, summary)
        if trainer.moe_aux_log is not None:
            summary["moe"] = trainer.moe_aux_log.summary()
        tokens, answer_tokens = trainer.global_token_counts()
        from ..training.rank_counts import sum_over_ranks

        pairs, real = sum_over_ranks([trainer.trained_pairs, trainer.trained_real_tokens])
        summary.update(
            row_tokens_trained=tokens,
            answer_tokens_trained=answer_tokens,
            pairs_trained=pairs,
            tokens_trained=real,
            row_padding_ratio=round(1.0 - real / max(tokens, 1), 4),
            pairs_per_second=round(pairs / max(train_time, 1e-9), 3),
        )
    if args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        summary["eval"] = metrics  # the final table shows loss, reward accuracy and margin
    return write_run_summary(args, summary, step_timer, wall_start)
