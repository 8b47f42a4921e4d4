"""Field specs for every config key, without importing paddle.

Our own groups are dataclasses (``schema.py``).  PaddleNLP's
``TrainingArguments`` has ~150 fields; importing it costs seconds, so its
fields come from ``integrations.training_args_source``, which reads them from
the installed source without importing it.
"""

import dataclasses
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, Optional, Tuple

from ..integrations.training_args_source import read_training_fields
from .modes import MODES
from .schema import GROUPS, ExtraTrainingArgument


@dataclass
class FieldSpec:
    name: str
    group: str  # model | data | generate | training
    kind: str  # bool | int | float | str | list | dict | any
    optional: bool
    default: Any
    help: str = ""
    choices: Optional[Tuple] = None
    min: Optional[float] = None
    gt: Optional[float] = None
    unsupported: Optional[str] = None
    required: bool = False
    # PaddleNLP "llm meta" key: model_config (copied into the model config), gpu_fusion (GPU-only
    # kernel, same results), gpt_only (read by PaddleNLP's GPT models only)
    llm_meta: Optional[str] = None


#: keys whose command-line ``none`` is PaddleNLP's value "none", not null: ``--report_to none`` is no
#: integration, while a null report_to is PaddleNLP's default (VisualDL).
NONE_IS_A_VALUE = frozenset({"report_to"})
# Allowed values of PaddleNLP training keys whose type is a plain str/enum.
TRAINING_CHOICES = {
    "evaluation_strategy": ("no", "steps", "epoch"),
    "save_strategy": ("no", "steps", "epoch"),
    "logging_strategy": ("no", "steps", "epoch"),
    "lr_scheduler_type": ("linear", "cosine", "constant", "constant_with_warmup", "polynomial"),
    "fp16_opt_level": ("O0", "O1", "O2"),
}
# Numeric lower bounds of PaddleNLP training keys: (min inclusive, gt exclusive).
TRAINING_BOUNDS = {
    "per_device_train_batch_size": (None, 0),
    "per_device_eval_batch_size": (None, 0),
    "gradient_accumulation_steps": (None, 0),
    "learning_rate": (0.0, None),
    "weight_decay": (0.0, None),
    "warmup_steps": (0, None),
    "warmup_ratio": (0.0, None),
    "logging_steps": (None, 0),
    "save_steps": (None, 0),
    "eval_steps": (None, 0),
    "tensor_parallel_degree": (None, 0),
    "pipeline_parallel_degree": (None, 0),
    "sharding_parallel_degree": (None, 0),
    "max_grad_norm": (0.0, None),
}


def _kind_of_annotation(node) -> Tuple[str, bool]:
    """Map an annotation (source text or a typing object) to (kind, optional)."""
    text = node if isinstance(node, str) else _typing_text(node)
    text = text.replace("typing.", "")
    optional = text.startswith("Optional[") or "None" in text
    inner = text[len("Optional[") : -1] if text.startswith("Optional[") else text
    for prefix, kind in (("bool", "bool"), ("int", "int"), ("float", "float"), ("str", "str")):
        if inner == prefix:
            return kind, optional
    if inner.startswith(("List", "list", "Tuple", "tuple")):
        return "list", optional
    if inner.startswith(("Dict", "dict")):
        return "dict", optional
    return "any", optional


def _typing_text(tp) -> str:
    if tp in (bool, int, float, str):
        return tp.__name__
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return "Optional[" + _typing_text(rest[0]) + "]" if len(rest) == 1 else "Any"
    if origin in (list, tuple):
        return "List"
    if origin is dict:
        return "Dict"
    return "Any"


def _training_specs() -> Dict[str, FieldSpec]:
    """PaddleNLP's training keys as FieldSpecs (read from its source: integrations.training_args_source)."""
    specs = {}
    for f in read_training_fields():
        kind, optional = _kind_of_annotation(f.annotation)
        lo, gt = TRAINING_BOUNDS.get(f.name, (None, None))
        specs[f.name] = FieldSpec(
            f.name,
            "training",
            kind,
            optional or f.default is None,
            f.default,
            f.help,
            choices=TRAINING_CHOICES.get(f.name),
            min=lo,
            gt=gt,
        )
    return specs


def _dataclass_specs(cls, group) -> Dict[str, FieldSpec]:
    hints = typing.get_type_hints(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        kind, optional = _kind_of_annotation(hints[f.name])
        m = f.metadata
        specs[f.name] = FieldSpec(
            f.name,
            group,
            kind,
            optional or f.default is None,
            f.default,
            m.get("help", ""),
            choices=m.get("choices"),
            min=m.get("min"),
            gt=m.get("gt"),
            unsupported=m.get("unsupported"),
            required=m.get("required", False),
            llm_meta=m.get("llm_meta"),
        )
    return specs


@lru_cache(maxsize=4)
def all_fields(mode: str = "sft") -> Dict[str, FieldSpec]:
    """Every accepted key -> its FieldSpec (model, data, generate, training; with an alignment mode also
    its ``alignment`` group, e.g. DPOArgument's keys for llm/run_dpo.py: config/modes.py)."""
    specs: Dict[str, FieldSpec] = {}
    for group, cls in GROUPS.items():
        specs.update(_dataclass_specs(cls, group))
    arguments = MODES[mode].arguments
    if arguments is not None:  # the mode's own key group (RunConfig.alignment; config/modes.py)
        specs.update(_dataclass_specs(arguments, "alignment"))
    training = _training_specs()
    training.update(_dataclass_specs(ExtraTrainingArgument, "training"))
    for name, spec in training.items():
        if name in specs:  # our groups take precedence over a same-named training key
            continue
        specs[name] = spec
    # Our defaults for PaddleNLP training keys where PaddleNLP's own default
    # does not suit fine-tuning from a JSON config.
    specs["output_dir"].required = True
    return specs
