"""A ``TrainingArguments`` class on PaddleNLP's with extra fields, and the fix-ups of PaddleNLP's argument
post-processing that we do not inherit.  The extra fields are given by the caller
(``training/training_args.py`` passes ``config.schema.ExtraTrainingArgument``), so this boundary imports no
package above it.

Relies on ``paddlenlp.trainer.TrainingArguments`` being a dataclass whose
``__post_init__`` turns ``evaluation_strategy="no"`` into ``"steps"`` when
``do_eval`` is set, and on ``paddlenlp.trainer.trainer_utils.IntervalStrategy``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from paddlenlp.trainer import TrainingArguments as PaddleNLPTrainingArguments
from paddlenlp.trainer.trainer_utils import IntervalStrategy

from .versions import check_versions

check_versions()

#: (module, attribute) pairs this module relies on (tests/test_integrations.py).
RELIED_ON = [
    ("paddlenlp.trainer", "TrainingArguments"),
    ("paddlenlp.trainer.trainer_utils", "IntervalStrategy"),
]


def training_arguments_class(extra: type, module: str) -> type:
    """PaddleNLP's ``TrainingArguments`` subclassed with the fields of the dataclass ``extra`` (name, type,
    default and metadata kept), named ``TrainingArguments`` and placed in ``module`` (where it is pickled from,
    as ``training_args.bin``)."""
    cls = dataclasses.make_dataclass(
        "TrainingArguments",
        [
            (f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
            for f in dataclasses.fields(extra)
        ],
        bases=(PaddleNLPTrainingArguments,),
    )
    cls.__module__ = module
    return cls


def make_training_arguments(cls: type, kwargs: Dict[str, Any]):
    """``cls(**kwargs)`` (a class of :func:`training_arguments_class`) with the user's ``evaluation_strategy`` kept.

    PaddleNLP silently turns evaluation_strategy "no" into "steps" when
    do_eval is set; we keep the user's "no" (= evaluate once, after training).
    Raises PaddleNLP's own ValueError/TypeError/AssertionError for bad values.
    """
    args = cls(**kwargs)
    if kwargs.get("evaluation_strategy", "no") == "no" and args.evaluation_strategy != IntervalStrategy.NO:
        args.evaluation_strategy = IntervalStrategy.NO
    return args
