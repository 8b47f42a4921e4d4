"""Supervised fine-tuning (``llm/run_finetune.py``): the run recipe (``training.recipe``) with these hooks.

data: ``data.build.build_datasets`` (read, validated, tokenized, packed; a lazy stream resumes at its
cursor) -> trainer: :class:`~paddlenlp_ext.training.trainer.FinetuneTrainer` (NEFTune noise on the embeddings
when asked; prefix tuning's weights io) -> summary: supervised tokens and tokens/s after training; eval loss,
perplexity, token accuracy and the generation metrics (``eval_with_do_generation``) after the evaluation.
"""

from __future__ import annotations

from typing import Any, Dict

from ..config.parse import RunConfig
from .recipe import RunHooks, run_recipe


class FinetuneHooks(RunHooks):
    mode = "sft"

    def data(self, cfg, args, tokenizer, resume_cursor):
        from ..data.build import build_datasets

        self.tokenizer = tokenizer  # the generation eval's
        return build_datasets(
            cfg, tokenizer, do_train=args.do_train, do_eval=args.do_eval, seed=args.seed, resume_cursor=resume_cursor
        )

    def trainer(self, cfg, built, args, tokenizer, data):
        from .trainer import FinetuneTrainer

        self.model = built.model  # the generation eval's (the trainer may wrap it)
        neftune_hook = None
        if cfg.model.neftune:
            from .. import adapters as adapter_api

            neftune_hook = adapter_api.attach_neftune(built.model, cfg.model.neftune_noise_alpha)
        return FinetuneTrainer(
            **self.trainer_kwargs(built, args, tokenizer, data), neftune_hook=neftune_hook, weights_io=built.prefix_io
        )

    def tokens(self, trainer) -> int:
        return trainer.trained_tokens

    def trained(self, cfg, trainer, summary, train_time) -> None:
        tokens, supervised = trainer.global_token_counts()
        summary.update(
            tokens_trained=tokens,
            supervised_tokens_trained=supervised,
            supervised_token_fraction=round(supervised / max(tokens, 1), 4),
            tokens_per_second=round(tokens / max(train_time, 1e-9), 2),
        )

    def evaluated(self, cfg, trainer, metrics, summary) -> None:
        if cfg.data.eval_with_do_generation and trainer.args.should_save:
            from .console import current
            from .run import evaluate_generation

            gen_metrics = evaluate_generation(cfg, self.model, self.tokenizer, trainer.args.output_dir)
            metrics.update(gen_metrics)
            summary.update(gen_metrics)
            current().line("generation eval: " + ", ".join(f"{k} {v:.4f}" for k, v in gen_metrics.items()))
        summary.update(
            eval_loss=metrics["eval_loss"],
            eval_perplexity=metrics.get("eval_perplexity"),
            eval_accuracy=metrics.get("eval_accuracy"),
        )


def run(cfg: RunConfig) -> Dict[str, Any]:
    """Fine-tune and/or evaluate as configured; returns the run summary (also output_dir/run_summary.json)."""
    return run_recipe(cfg, FinetuneHooks())
