"""Records from data files, each with the line it starts on (pure reading; no format knowledge).

* ``.jsonl``: one JSON value per line.
* ``.json``: a JSON array (``[{...}, {...}]``; each record is numbered by the line where it starts)
  or JSON lines (PaddleNLP's ``train.json``), told apart by the first character.
* ``.txt``: one document per non-empty line -> ``{"text": line}`` (the layout of
  ``wiki_demo.txt`` and of Hugging Face ``datasets``' text loader; blank lines are skipped).
* ``.parquet``: one record per row (pyarrow), numbered 1, 2, ... as lines.

:func:`iter_records` yields ``(line, record, problem)``: ``problem`` is None or the reason the
record could not be read (invalid JSON on that line); the caller reports it with ``file:line``.
"""

import json
import os
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from ..reader import MAX_REPORTED, DataError, json_line, read_utf8_lines, read_utf8_text

EXTENSIONS = (".json", ".jsonl", ".txt", ".parquet")


def is_json_array(path: str) -> bool:
    """Whether a ``.json`` file holds one JSON array (vs JSON lines): its first non-blank character is ``[``."""
    if not path.endswith(".json"):
        return False
    for _, line in read_utf8_lines(path):
        s = line.strip()
        if s:
            return s.startswith("[")
    return False


def streamable(path: str) -> bool:
    """Line-based files can be streamed (``lazy: true``); JSON arrays and parquet are read whole."""
    return path.endswith((".jsonl", ".txt")) or (path.endswith(".json") and not is_json_array(path))


def iter_records(path: str) -> Iterator[Tuple[int, Any, Optional[str]]]:
    """``(line, record, problem)`` for every record of ``path``.

    A file ``[\\n {"a": 1},\\n {"a": 2}\\n]`` yields ``(2, {"a": 1}, None)`` and ``(3, {"a": 2}, None)``;
    a JSON-lines file with the line ``{"a": }`` on line 4 yields ``(4, None, "invalid JSON (...)")``.
    """
    ext = os.path.splitext(path)[1]
    if ext not in EXTENSIONS:
        raise DataError(
            [f"{path}: unsupported file type {ext or '(no extension)'}; use one of {', '.join(EXTENSIONS)}"]
        )
    if ext == ".parquet":
        yield from _parquet(path)
    elif ext == ".txt":
        for lineno, line in read_utf8_lines(path):
            text = line.rstrip("\r\n")
            if text.strip():
                yield lineno, {"text": text}, None
    elif is_json_array(path):
        yield from _json_array(path)
    else:
        for lineno, line in read_utf8_lines(path):
            if line.strip():
                yield (lineno, *_loads(line))


def _loads(line: str) -> Tuple[Any, Optional[str]]:
    try:
        return json_line(line), None
    except ValueError as e:
        return None, str(e)


def _json_array(path: str) -> Iterator[Tuple[int, Any, Optional[str]]]:
    """Records of a JSON array with the line each starts on, decoded one element at a time."""
    text = read_utf8_text(path)
    dec = json.JSONDecoder()
    pos, line, counted = text.index("[") + 1, 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            raise DataError([f"{path}: the JSON array is not closed (missing ']' at the end)"])
        if text[pos] == "]":
            return
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError([f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})"]) from None
        yield line, obj, None
        pos = end


def _parquet(path: str) -> Iterator[Tuple[int, Any, Optional[str]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError([f"{path}: cannot read the parquet file: {e}"]) from e
    for i, row in enumerate(table.to_pylist(), 1):
        yield i, row, None


def parse_records(files: Sequence[str], parse: Callable[[Any, str], Any]) -> List[Any]:
    """``parse(record, "file:line")`` for every record of ``files``, in order.

    A ``ValueError`` is a problem ``file:line: reason`` (the prefix is added when the message lacks it);
    all problems are raised together as one DataError (the first MAX_REPORTED listed, the rest counted):
    nothing is dropped silently."""
    out, problems, extra = [], [], 0
    for path in files:
        try:
            for line, record, problem in iter_records(path):
                origin = f"{path}:{line}"
                try:
                    if problem:
                        raise ValueError(problem)
                    out.append(parse(record, origin))
                except ValueError as e:
                    msg = str(e)
                    if len(problems) < MAX_REPORTED:
                        problems.append(msg if msg.startswith(f"{origin}:") else f"{origin}: {msg}")
                    else:
                        extra += 1
        except DataError as e:  # not UTF-8 / unreadable / a broken JSON array: listed with the others
            problems += e.problems
    if problems:
        raise DataError(problems, extra)
    return out
