"""Build a KTO run from a validated RunConfig (``load_config(..., mode="kto")``), then train / evaluate.

``dpo.run.run`` (training args -> tokenizer -> data -> model -> adapters -> trainer -> summary)
with KTO's data (:func:`~paddlenlp_ext.kto.data.build_kto_datasets`) and trainer.
"""

from __future__ import annotations

from typing import Any, Dict

from ..config.parse import RunConfig


def _kto_trainer(cfg: RunConfig, **kw):
    from .trainer import KTOTrainer

    return KTOTrainer(**kw, kto_config=cfg.alignment)


def _kto_data(data_args, tokenizer, **kw):
    from .data import build_kto_datasets

    return build_kto_datasets(data_args, tokenizer, **kw)


def run(cfg: RunConfig) -> Dict[str, Any]:
    """Train and/or evaluate as configured; returns the run summary (also output_dir/run_summary.json)."""
    from ..dpo.run import run as run_preference

    if cfg.alignment is None or cfg.alignment.mode != "kto":
        raise ValueError("kto.run.run needs a KTO config: load_config(path, overrides, mode='kto')")
    return run_preference(cfg, build_data=_kto_data, make_trainer=_kto_trainer)
