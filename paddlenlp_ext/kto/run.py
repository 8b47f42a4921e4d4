"""KTO (``llm/run_kto.py``): the run recipe (``training.recipe``) with DPO's preference hooks
(``dpo.run.PreferenceHooks``), KTO's data (:func:`~paddlenlp_ext.kto.data.build_kto_datasets`) and trainer.
"""

from __future__ import annotations

from typing import Any, Dict

from ..config.parse import RunConfig
from ..dpo.run import PreferenceHooks
from ..training.recipe import run_recipe


class KTOHooks(PreferenceHooks):
    mode = "kto"

    def data(self, cfg, args, tokenizer, resume_cursor):
        from .data import build_kto_datasets

        return self.build_data(build_kto_datasets, cfg, args, tokenizer, resume_cursor)

    def trainer(self, cfg, built, args, tokenizer, data):
        from .trainer import KTOTrainer

        return KTOTrainer(**self.trainer_kwargs(built, args, tokenizer, data), kto_config=cfg.alignment)


def run(cfg: RunConfig) -> Dict[str, Any]:
    """Train and/or evaluate as configured; returns the run summary (also output_dir/run_summary.json)."""
    return run_recipe(cfg, KTOHooks())
