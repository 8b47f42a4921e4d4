"""Field specs for every config key, without importing paddle.

Our own groups are dataclasses (``schema.py``).  PaddleNLP's
``TrainingArguments`` has ~150 fields; importing it costs seconds (paddle,
paddlenlp), which would make a typo take seconds to report.  So its fields
are read from the installed source file with ``ast`` (the module is located
with ``importlib.util.find_spec``, which does not execute it).  A unit test
checks that the result matches the real dataclass.
"""

import ast
import dataclasses
import importlib.util
import os
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, Optional, Tuple

from .schema import GROUPS, ExtraTrainingArgument

_MISSING = object()


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
    """Map an annotation AST (or a typing object) to (kind, optional)."""
    text = ast.unparse(node) if isinstance(node, ast.AST) else _typing_text(node)
    text = text.replace("typing.", "")
    optional = text.startswith("Optional[") or "None" in text
    inner = text[len("Optional["):-1] if text.startswith("Optional[") else text
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


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return _MISSING


def _parse_training_source(path: str) -> Dict[str, FieldSpec]:
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainingArguments")
    specs = {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        kind, optional = _kind_of_annotation(stmt.annotation)
        default, help_text = None, ""
        value = stmt.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
            for kw in value.keywords:
                if kw.arg == "default":
                    default = _literal(kw.value)
                elif kw.arg == "default_factory":
                    default = _MISSING
                elif kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
                    for k, v in zip(kw.value.keys, kw.value.values):
                        if _literal(k) == "help":
                            h = _literal(v)
                            help_text = h if isinstance(h, str) else ""
        elif value is not None:
            default = _literal(value)
        if default is _MISSING:
            default = None
        if default is None:
            optional = True
        lo, gt = TRAINING_BOUNDS.get(name, (None, None))
        specs[name] = FieldSpec(
            name, "training", kind, optional, default, " ".join(help_text.split()),
            choices=TRAINING_CHOICES.get(name), min=lo, gt=gt,
        )
    return specs


def paddlenlp_training_args_path() -> str:
    spec = importlib.util.find_spec("paddlenlp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("paddlenlp is not installed: run `make setup` (see README).")
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "training_args.py")


def _dataclass_specs(cls, group) -> Dict[str, FieldSpec]:
    hints = typing.get_type_hints(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        kind, optional = _kind_of_annotation(hints[f.name])
        m = f.metadata
        specs[f.name] = FieldSpec(
            f.name, group, kind, optional or f.default is None, f.default, m.get("help", ""),
            choices=m.get("choices"), min=m.get("min"), gt=m.get("gt"),
            unsupported=m.get("unsupported"), required=m.get("required", False),
        )
    return specs


@lru_cache(maxsize=1)
def all_fields() -> Dict[str, FieldSpec]:
    """Every accepted key -> its FieldSpec (model, data, generate, training)."""
    specs: Dict[str, FieldSpec] = {}
    for group, cls in GROUPS.items():
        specs.update(_dataclass_specs(cls, group))
    training = _parse_training_source(paddlenlp_training_args_path())
    training.update(_dataclass_specs(ExtraTrainingArgument, "training"))
    for name, spec in training.items():
        if name in specs:  # our groups take precedence over a same-named training key
            continue
        specs[name] = spec
    # Our defaults for PaddleNLP training keys where PaddleNLP's own default
    # does not suit fine-tuning from a JSON config.
    specs["output_dir"].required = True
    return specs
