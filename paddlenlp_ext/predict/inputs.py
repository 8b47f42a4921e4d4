"""Prompt files for prediction: JSON lines read with ``file:line`` errors (no paddle).

The training format (``data/reader.py``), with the answer to predict left out::

    {"src": "type#dress*color#blue"}                                   one turn
    {"src": "type#dress*color#blue", "tgt": "This blue dress ..."}     + reference answer
    {"src": ["Hi", "And then?"], "tgt": ["Hello!"]}                    multi-turn: one answer per earlier turn
    {"src": ["Hi", "And then?"], "tgt": ["Hello!", "Bye."]}            ... + the reference of the last turn
    {"src": "...", "context": {"system": "Be brief."}}                 system prompt, as in training

So a train/dev file of run_finetune.py is a valid prompt file: the model
answers the last ``src`` and the last ``tgt`` (if any) is kept as the reference.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, List, Optional

MAX_REPORTED = 20  # bad lines listed before giving up (the rest are counted)


class PredictInputError(ValueError):
    """Bad input to the predictor (file, line, flag or adapter); the message says what to do. Exit code 2."""


@dataclass
class PromptRecord:
    """One prompt: ``src`` turns (the last is answered), the answers to the earlier turns, the reference."""

    src: List[str]
    history: List[str]  # answers to src[:-1]
    reference: Optional[str] = None  # the expected answer to src[-1], when the line has one
    system: Optional[str] = None
    origin: str = ""  # "file:line" (or "chat") for messages
    raw: Any = None  # the line's JSON object, for the output file


def _strings(value: Any, key: str) -> List[str]:
    vals = [value] if isinstance(value, str) else value
    if not isinstance(vals, list) or not vals or not all(isinstance(s, str) for s in vals):
        raise ValueError(f"{key!r} must be a string or a non-empty list of strings")
    return vals


def parse_prompt(obj: Any) -> PromptRecord:
    """Validate one decoded line; ValueError with the reason.

    >>> parse_prompt({"src": ["a", "b"], "tgt": ["x"]}).history
    ['x']
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object with 'src', got {type(obj).__name__}")
    if "src" not in obj:
        raise ValueError('missing key \'src\' (the prompt to answer); add "src": "..."')
    src = _strings(obj["src"], "src")
    tgt = _strings(obj["tgt"], "tgt") if obj.get("tgt") is not None else []
    if len(tgt) == len(src):
        history, reference = tgt[:-1], tgt[-1]
    elif len(tgt) == len(src) - 1:
        history, reference = tgt, None
    else:
        raise ValueError(
            f"{len(src)} src turn(s) and {len(tgt)} tgt answer(s): give one answer per earlier turn "
            f"({len(src) - 1}), optionally followed by the reference answer of the last turn "
            f"({len(src)})"
        )
    from ..data.reader import context_system  # lazily, as read_prompts: flag errors come before any heavy import

    system = context_system(obj)
    return PromptRecord(src=src, history=history, reference=reference, system=system, raw=obj)


def read_prompts(path: str) -> List[PromptRecord]:
    """Every non-empty line of ``path``; PredictInputError listing up to MAX_REPORTED bad lines as ``file:line``."""
    if not os.path.isfile(path):
        raise PredictInputError(
            f'--data_file {path}: no such file (give a JSON-lines file of {{"src": ...}} '
            "objects, e.g. llm/data/demo_prompts.json)"
        )
    from ..data.reader import DataError, read_utf8_lines

    records, problems, extra = [], [], 0
    try:
        for lineno, line in read_utf8_lines(path):  # the training data's reader: UTF-8, BOM dropped
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"invalid JSON ({e.msg} at column {e.colno}); each line must be one JSON object")
                rec = parse_prompt(obj)
            except ValueError as e:
                if len(problems) < MAX_REPORTED:
                    problems.append(f"{where}: {e}")
                else:
                    extra += 1
                continue
            rec.origin = where
            records.append(rec)
    except DataError as e:  # not UTF-8 (file:line, byte offset, the iconv command) or unreadable
        problems += e.problems
    if problems:
        more = f"\n  ... and {extra} more bad line(s)" if extra else ""
        raise PredictInputError("invalid prompt file:\n  " + "\n  ".join(problems) + more)
    if not records:
        raise PredictInputError(f"--data_file {path}: no prompts (the file is empty)")
    return records
