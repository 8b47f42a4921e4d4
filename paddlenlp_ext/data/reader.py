"""Read and validate fine-tuning data files (JSON lines), without paddle.

Format (PaddleNLP's fine-tuning docs), one JSON object per line::

    {"src": "Type#dress*Color#blue", "tgt": "A blue dress ..."}
    {"src": ["hi", "and then?"], "tgt": ["hello", "bye"], "context": {"system": "Be brief."}}

``src``/``tgt`` are strings (one turn) or equally long lists of strings
(multi-turn: one src per tgt).  A malformed line stops the run with
``file:line`` and the reason; nothing is skipped.
"""

import glob
import json
import os
from dataclasses import dataclass
from typing import List, Optional

MAX_REPORTED = 20  # problems listed before the error is raised


@dataclass
class Example:
    src: List[str]
    tgt: List[str]
    system: Optional[str] = None
    origin: str = ""  # "file:line", for messages


class DataError(Exception):
    def __init__(self, problems: List[str], more: int = 0):
        self.problems = problems
        tail = f"\n  ... and {more} more" if more else ""
        super().__init__("invalid data:\n  " + "\n  ".join(problems) + tail)


def find_split_files(dataset_dir: str, split: str) -> List[str]:
    """``train`` -> ``[dir/train.json]`` or sorted ``dir/train/*.json`` (or [])."""
    single = os.path.join(dataset_dir, f"{split}.json")
    if os.path.isfile(single):
        return [single]
    return sorted(glob.glob(os.path.join(dataset_dir, split, "*.json")))


def parse_line(line: str, origin: str) -> Example:
    """Validate one JSON line. Raises ValueError with the reason.

    >>> parse_line('{"src": "a", "tgt": "b"}', "f:1")
    Example(src=['a'], tgt=['b'], system=None, origin='f:1')
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object with 'src' and 'tgt'")
    for key in ("src", "tgt"):
        if key not in obj:
            raise ValueError(f"missing key {key!r}")
    src, tgt = obj["src"], obj["tgt"]
    src = [src] if isinstance(src, str) else src
    tgt = [tgt] if isinstance(tgt, str) else tgt
    for key, val in (("src", src), ("tgt", tgt)):
        if not isinstance(val, list) or not val or not all(isinstance(s, str) for s in val):
            raise ValueError(f"{key!r} must be a string or a non-empty list of strings")
    if len(src) != len(tgt):
        raise ValueError(f"mismatched turns: {len(src)} src and {len(tgt)} tgt (need one src per tgt)")
    for i, t in enumerate(tgt):
        if not t.strip():
            raise ValueError(f"empty target (turn {i + 1}): there is nothing to learn from this line")
    system = None
    context = obj.get("context")
    if context is not None:
        if not isinstance(context, dict):
            raise ValueError("'context' must be an object such as {\"system\": \"...\"}")
        system = context.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError("'context.system' must be a string")
    return Example(src=src, tgt=tgt, system=system, origin=origin)


def read_examples(files: List[str]) -> List[Example]:
    """Read every line of ``files``; reports up to MAX_REPORTED bad lines at once.

    A file ``f`` with the lines ``{"src": "a", "tgt": "b"}``, an empty line, and ``{"src": "a"}``
    raises ``DataError`` with ``f:3: missing key 'tgt'`` (empty lines are skipped, nothing else is);
    without line 3 it returns ``[Example(src=['a'], tgt=['b'], system=None, origin='f:1')]``.
    """
    examples, problems, extra = [], [], 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    examples.append(parse_line(line, f"{path}:{lineno}"))
                except ValueError as e:
                    if len(problems) < MAX_REPORTED:
                        problems.append(f"{path}:{lineno}: {e}")
                    else:
                        extra += 1
    if problems:
        raise DataError(problems, extra)
    if not examples:
        raise DataError([f"{', '.join(files)}: no examples (the file is empty)"])
    return examples
