"""Our ``TrainingArguments`` (PaddleNLP's plus ``ExtraTrainingArgument``) and the fix-ups
of PaddleNLP's argument post-processing that we do not inherit.

Relies on ``paddlenlp.trainer.TrainingArguments`` being a dataclass whose
``__post_init__`` turns ``evaluation_strategy="no"`` into ``"steps"`` when
``do_eval`` is set, and on ``paddlenlp.trainer.trainer_utils.IntervalStrategy``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from paddlenlp.trainer import TrainingArguments as _PaddleNLPTrainingArguments
from paddlenlp.trainer.trainer_utils import IntervalStrategy

from ..config.schema import ExtraTrainingArgument
from .versions import check_versions

check_versions()

#: (module, attribute) pairs this module relies on (tests/test_integrations.py).
RELIED_ON = [
    ("paddlenlp.trainer", "TrainingArguments"),
    ("paddlenlp.trainer.trainer_utils", "IntervalStrategy"),
]

# Built from the paddle-free schema so the key list lives in one place.
TrainingArguments = dataclasses.make_dataclass(
    "TrainingArguments",
    [
        (f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
        for f in dataclasses.fields(ExtraTrainingArgument)
    ],
    bases=(_PaddleNLPTrainingArguments,),
)
TrainingArguments.__module__ = __name__
TrainingArguments.__doc__ = "PaddleNLP TrainingArguments plus paddlenlp_ext's own training keys (docs/config.md)."


def make_training_arguments(kwargs: Dict[str, Any]):
    """``TrainingArguments(**kwargs)`` with the user's ``evaluation_strategy`` kept.

    PaddleNLP silently turns evaluation_strategy "no" into "steps" when
    do_eval is set; we keep the user's "no" (= evaluate once, after training).
    Raises PaddleNLP's own ValueError/TypeError/AssertionError for bad values.
    """
    args = TrainingArguments(**kwargs)
    if kwargs.get("evaluation_strategy", "no") == "no" and args.evaluation_strategy != IntervalStrategy.NO:
        args.evaluation_strategy = IntervalStrategy.NO
    return args
