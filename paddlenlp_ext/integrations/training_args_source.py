"""PaddleNLP's ``TrainingArguments`` fields, read from its source without importing it.

Importing ``paddlenlp.trainer`` costs seconds (paddle, paddlenlp); config
validation must answer a typo in well under a second.  So the field list is
read from the installed ``paddlenlp/trainer/training_args.py`` with ``ast``
(the file is located with ``importlib.util.find_spec``, which runs nothing).
This relies on the class being a dataclass named ``TrainingArguments`` whose
fields are annotated assignments with ``field(default=..., metadata={"help":
...})``; ``tests/test_integrations.py`` checks the result against the real
dataclass, so a PaddleNLP release that changes this fails ``make test``.

Never imports paddle.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, List

#: What this module relies on (checked by tests/test_integrations.py).
RELIED_ON = [("paddlenlp/trainer/training_args.py", "class TrainingArguments (dataclass fields with field(...))")]

_MISSING = object()


@dataclass
class SourceField:
    name: str
    annotation: str  # source text, e.g. "Optional[int]"
    default: Any  # None when the default is not a literal or comes from default_factory
    help: str


def paddlenlp_training_args_path() -> str:
    spec = importlib.util.find_spec("paddlenlp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("paddlenlp is not installed: run `make setup` (see README).")
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "training_args.py")


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return _MISSING


def read_training_fields(path: str = None) -> List[SourceField]:
    """Every annotated field of PaddleNLP's ``TrainingArguments``, in source order."""
    path = path or paddlenlp_training_args_path()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainingArguments"]
    if not classes:
        raise RuntimeError(f"{path}: no class TrainingArguments; this paddlenlp release is not supported")
    out = []
    for stmt in classes[0].body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
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
        out.append(SourceField(stmt.target.id, ast.unparse(stmt.annotation), default, " ".join(help_text.split())))
    return out
