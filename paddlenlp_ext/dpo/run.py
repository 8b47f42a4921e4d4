"""DPO (``llm/run_dpo.py``): the run recipe (``training.recipe``) with preference hooks.

data: preference pairs (validated, tokenized, packed: :func:`~paddlenlp_ext.dpo.data.build_preference_datasets`)
-> trainer: :class:`~paddlenlp_ext.dpo.trainer.DPOTrainer` -> summary: loss type and reference; pairs, answer
tokens and padding after training; the eval metrics (reward accuracy and margin) after the evaluation.
:class:`PreferenceHooks` is shared with KTO (``kto.run``) and reward models (``reward.run``), which supply
their own data and trainer.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict

from ..config.parse import RunConfig
from ..training.recipe import RunHooks, run_recipe


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


class PreferenceHooks(RunHooks):
    """The hooks of a pair (or example) trainer: DPO's; KTO and reward models override data and trainer."""

    mode = "dpo"

    def data(self, cfg, args, tokenizer, resume_cursor):
        from .data import build_preference_datasets

        return self.build_data(build_preference_datasets, cfg, args, tokenizer, resume_cursor)

    @staticmethod
    def build_data(build, cfg, args, tokenizer, resume_cursor):
        """``build`` (``build_preference_datasets`` or KTO's / the reward model's) on the alignment keys."""
        data_args = preference_data_args(cfg)
        data_args.resume_cursor = resume_cursor  # lazy: the stream seeks to the checkpoint's cursor
        return build(
            data_args,
            tokenizer,
            do_train=args.do_train,
            do_eval=args.do_eval,
            flash_mask=cfg.model.flash_mask,
            seed=args.seed,
        )

    def trainer(self, cfg, built, args, tokenizer, data):
        from .trainer import DPOTrainer

        return DPOTrainer(**self.trainer_kwargs(built, args, tokenizer, data), dpo_config=cfg.alignment)

    def describe(self, cfg, trainer) -> Dict[str, Any]:
        return {"loss_type": trainer.loss_type, "reference": trainer.reference}

    def trained(self, cfg, trainer, summary, train_time) -> None:
        from ..training.rank_counts import sum_over_ranks

        tokens, answer_tokens = trainer.global_token_counts()
        pairs, real = sum_over_ranks([trainer.trained_pairs, trainer.trained_real_tokens])
        summary.update(
            row_tokens_trained=tokens,
            answer_tokens_trained=answer_tokens,
            pairs_trained=pairs,
            tokens_trained=real,
            row_padding_ratio=round(1.0 - real / max(tokens, 1), 4),
            pairs_per_second=round(pairs / max(train_time, 1e-9), 3),
        )


def run(cfg: RunConfig) -> Dict[str, Any]:
    """Train and/or evaluate as configured; returns the run summary (also output_dir/run_summary.json)."""
    return run_recipe(cfg, PreferenceHooks())
