"""The one run recipe: every training CLI (fine-tuning, DPO, KTO, reward, GRPO, PPO) is this skeleton plus
the hooks of its mode.

:func:`run_recipe` reads top to bottom:

1. train.log and the console, the library patches, the heap policy;
2. training args, resolved_config.json, the seed, the resume checkpoint checked, the tokenizer
   (``training.run.start_run``);
3. ``hooks.data``: the mode's data, validated before any model loads (a ValueError that is not a
   DataError becomes a config problem: exit 2 naming the config);
4. the model (streamed, quantized, adapters: ``training.model_build``);
5. ``hooks.trainer``: the mode's trainer on that model;
6. the callbacks every run has: MoE aux-loss log, per-epoch reshuffle and stream cursor, console /
   VisualDL / loss.png (showing the trainer's own metrics), step timer and heap trim;
7. the summary's start, ``hooks.describe`` adding the mode's settings;
8. ``eval_before_train``: one evaluation of the untrained model (``eval_loss_before_train``, and all its
   metrics as ``eval_before_train``);
9. training and saving (``training.run.train_and_save``), inside ``hooks.training()``; then
   ``hooks.trained`` adds the mode's counts (tokens, pairs, completions, rewards ...);
10. the final evaluation, ``hooks.evaluated`` adding the mode's view of its metrics;
11. run_summary.json, the final loss.png and the console's final table.

A mode's hooks are a :class:`RunHooks` subclass next to its trainer (``training/finetune.py``,
``dpo/run.py``, ``kto/run.py``, ``reward/run.py``, ``grpo/run.py``, ``ppo/run.py``); which one a CLI runs is
its row of ``config.modes.MODES``.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Dict

from ..config.modes import mode_of
from ..config.parse import ConfigError, RunConfig
from .run import attach_data_callbacks, build_model, library_patches, start_run, train_and_save, write_run_summary


class RunHooks:
    """What a mode supplies to :func:`run_recipe`; the defaults are what a mode without the step does."""

    #: the config mode (``config.modes.MODES``) this recipe trains
    mode = "sft"

    def data(self, cfg: RunConfig, args, tokenizer, resume_cursor):
        """-> an object with ``train``, ``dev`` (datasets or None), ``collator`` and ``reports`` (split -> dict)."""
        raise NotImplementedError

    def trainer(self, cfg: RunConfig, built, args, tokenizer, data):
        """-> the mode's trainer on ``built.model`` (``training.model_build.BuiltModel``)."""
        raise NotImplementedError

    @staticmethod
    def trainer_kwargs(built, args, tokenizer, data) -> Dict[str, Any]:
        """The Trainer arguments every mode's trainer takes (the mode adds its own config)."""
        return dict(
            model=built.model,
            args=args,
            train_dataset=data.train,
            eval_dataset=data.dev,
            tokenizer=tokenizer,
            data_collator=data.collator,
            adapter_config=built.adapter_config,
        )

    def tokens(self, trainer) -> int:
        """The tokens this process has trained so far (the console's tokens/s)."""
        return trainer.trained_real_tokens

    def describe(self, cfg: RunConfig, trainer) -> Dict[str, Any]:
        """Summary keys known before training (the mode's settings as the trainer resolved them)."""
        return {}

    def training(self):
        """A context around training and saving (e.g. GRPO's tool runner, closed however training ends)."""
        return contextlib.nullcontext()

    def trained(self, cfg: RunConfig, trainer, summary: Dict[str, Any], train_time: float) -> None:
        """Add the mode's counts to ``summary`` after training (``train_time``: seconds, the whole run's)."""

    def evaluated(self, cfg: RunConfig, trainer, metrics: Dict[str, Any], summary: Dict[str, Any]) -> None:
        """Add the final evaluation to ``summary`` (``metrics`` may be extended before they are logged)."""
        summary["eval"] = metrics


def run_recipe(cfg: RunConfig, hooks: RunHooks) -> Dict[str, Any]:
    """Train and/or evaluate as configured; returns the run summary (also output_dir/run_summary.json)."""
    if mode_of(cfg.alignment) != hooks.mode:
        raise ValueError(
            f"{type(hooks).__name__} runs mode {hooks.mode!r}; this config was loaded with mode "
            f"{mode_of(cfg.alignment)!r}: load_config(path, overrides, mode={hooks.mode!r})"
        )
    from .heap import limit_heap_retention
    from .logfile import run_logging

    # tensors under 2 MiB reuse freed heap memory within a step; HeapTrim gives it back between steps
    limit_heap_retention()
    with run_logging(cfg), library_patches(cfg):  # train.log + console first: it sees the whole run
        return _steps(cfg, hooks)


def _steps(cfg: RunConfig, hooks: RunHooks) -> Dict[str, Any]:
    from paddlenlp.utils.log import logger

    from ..adapters import count_parameters
    from ..data.reader import DataError
    from .callbacks import attach_step_callbacks
    from .console import current
    from .moe_aux import attach_moe_log
    from .reporting import attach_reporting

    wall_start = time.time()
    args, tokenizer, resume_cursor, resume_step = start_run(cfg)
    try:
        data = hooks.data(cfg, args, tokenizer, resume_cursor)
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        raise ConfigError([f"{cfg.source or 'config'}: {e}"]) from e
    for split, report in data.reports.items():
        logger.info(f"data[{split}]: {json.dumps(report, default=str)}")

    built = build_model(cfg, args)
    trainer = hooks.trainer(cfg, built, args, tokenizer, data)
    # MoE rows: router_aux_loss_coef * aux of the policy forward joins the loss (logged with the expert load);
    # the bias update after each optimizer step (docs/moe.md)
    attach_moe_log(trainer, built.model, float(cfg.model.moe_router_bias_update_rate or 0.0))
    built.trainable, built.total = count_parameters(built.model)  # the trainer hook may add layers (a score head)
    attach_data_callbacks(trainer, data.train, cfg, args, resume_step)
    attach_reporting(trainer, cfg, args, built, data.reports, tokens=lambda: hooks.tokens(trainer))
    step_timer = attach_step_callbacks(trainer)  # step times + heap trim (training/heap.py)
    summary: Dict[str, Any] = {
        **built.summary(),
        "world_size": args.world_size,
        "data": data.reports,
        **hooks.describe(cfg, trainer),
    }
    if args.do_eval and args.eval_before_train and args.do_train:  # eval-only: the one evaluation below
        metrics = trainer.evaluate()
        summary.update(eval_loss_before_train=metrics["eval_loss"], eval_before_train=metrics)
        current().line(f"eval loss before training: {metrics['eval_loss']:.4f}")

    if args.do_train:
        with hooks.training():
            train_time = train_and_save(trainer, cfg, args, data, summary)
        if trainer.moe_aux_log is not None:
            summary["moe"] = trainer.moe_aux_log.summary()
        hooks.trained(cfg, trainer, summary, train_time)
    if args.do_eval:
        metrics = trainer.evaluate()
        hooks.evaluated(cfg, trainer, metrics, summary)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    return write_run_summary(args, summary, step_timer, wall_start)
