"""Our ``TrainingArguments``: PaddleNLP's plus the training keys of ``config.schema.ExtraTrainingArgument``
(built from the paddle-free schema so the key list lives in one place; the class itself by
``integrations.training_args``, which owns what it relies on in PaddleNLP)."""

from __future__ import annotations

from typing import Any, Dict

from ..config.schema import ExtraTrainingArgument
from ..integrations import training_args as boundary

TrainingArguments = boundary.training_arguments_class(ExtraTrainingArgument, __name__)
TrainingArguments.__doc__ = "PaddleNLP TrainingArguments plus paddlenlp_ext's own training keys (docs/config.md)."


def make_training_arguments(kwargs: Dict[str, Any]):
    """``TrainingArguments(**kwargs)`` with the user's ``evaluation_strategy`` kept: PaddleNLP turns "no" into
    "steps" when do_eval is set; "no" means evaluate once, after training.  Raises PaddleNLP's own
    ValueError/TypeError/AssertionError for bad values."""
    return boundary.make_training_arguments(TrainingArguments, kwargs)
