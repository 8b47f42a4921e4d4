"""Our TrainingArguments: PaddleNLP's plus the keys of ``ExtraTrainingArgument``."""

import dataclasses

from paddlenlp.trainer import TrainingArguments as _PaddleNLPTrainingArguments

from ..config.schema import ExtraTrainingArgument

# Built from the paddle-free schema so the key list lives in one place.
TrainingArguments = dataclasses.make_dataclass(
    "TrainingArguments",
    [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
     for f in dataclasses.fields(ExtraTrainingArgument)],
    bases=(_PaddleNLPTrainingArguments,),
)
TrainingArguments.__module__ = __name__
TrainingArguments.__doc__ = "PaddleNLP TrainingArguments plus paddlenlp_ext's own training keys (docs/config.md)."
