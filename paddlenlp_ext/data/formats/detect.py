"""Which format a record is, and reading whole files into examples (paddlenlp) / conversations / text docs.

Detection looks at a record's keys, in this order: ``src`` + ``tgt`` -> paddlenlp; ``messages`` (a
list) -> messages; ``conversations`` (a list) -> sharegpt; ``instruction`` + ``output`` -> alpaca;
``text`` (a string) -> text.  A file's format is that of its first record (or ``dataset_format``
when it is not ``auto``), and every record of the file must have it: a record of another shape, or
of none, is a ``file:line`` problem naming the keys it has and the ones expected.  Example:
``detect_format({"instruction": "a", "input": "", "output": "b"})`` -> ``"alpaca"``;
``detect_format({"question": "a"})`` -> ``None``.
"""

import os
from typing import Any, Dict, List, Optional, Tuple

from ..reader import DataError, json_line
from . import alpaca, messages, paddlenlp, sharegpt, text
from .convo import Conversation, check_turns
from .files import parse_records

FORMATS = {"paddlenlp": paddlenlp, "messages": messages, "sharegpt": sharegpt, "alpaca": alpaca, "text": text}
EXPECTED = (
    "paddlenlp {src, tgt}; messages {messages: [{role, content}]}; sharegpt {conversations: [{from, value}]}; "
    "alpaca {instruction, input, output}; text {text}"
)


def detect_format(record: Any, columns: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The first format (in :data:`FORMATS` order) whose keys the record has, or None."""
    for name, mod in FORMATS.items():
        if mod.matches(record) if name == "paddlenlp" else mod.matches(record, columns):
            return name
    return None


def _no_format(record, origin) -> ValueError:
    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
    return ValueError(
        f"{origin}: the record matches no dataset format (it has {keys}); expected one of: {EXPECTED}. "
        "Rename its fields with dataset_columns or convert it"
    )


def parse_record(record: Any, fmt: str, origin: str, columns: Optional[Dict[str, str]] = None, check: bool = True):
    """One record -> ``Example`` (paddlenlp), :class:`Conversation` or :class:`TextDoc`; ``fmt`` may be
    ``auto``.  ``check`` validates the turn order (:func:`~.convo.check_turns`); DPO checks its own.

    ``parse_record({"instruction": "q", "output": "a"}, "auto", "f:1")`` ->
    ``Conversation([user "q", assistant "a"], format="alpaca", origin="f:1")``."""
    name = detect_format(record, columns) if fmt == "auto" else fmt
    mod = FORMATS.get(name)
    if mod is None:
        raise _no_format(record, origin)
    # paddlenlp records go straight to their own checks ("missing key 'tgt'", as PaddleNLP's reader says)
    if name != "paddlenlp" and not mod.matches(record, columns):
        found = detect_format(record, columns)
        if found is None:
            raise _no_format(record, origin)
        raise ValueError(
            f"{origin}: the record is not in the {name} format"
            + (f" (it looks like {found}: set dataset_format to auto or {found})" if found else "")
            + f"; the {name} format is {next(e for e in EXPECTED.split('; ') if e.startswith(name))}"
        )
    try:
        # a ShareGPT prompt (check=False: GRPO) may end with the user's turn: no turn-count rule then
        item = (
            mod.convert(record, origin, columns, ranking=None)
            if name == "sharegpt" and not check
            else mod.convert(record, origin, columns)
        )
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(origin) else f"{origin}: {msg}") from None
    if check and isinstance(item, Conversation):
        check_turns(item.messages, origin)
    return item


def read_items(
    files: List[str], fmt: str = "auto", columns: Optional[Dict[str, str]] = None, check: bool = True
) -> Tuple[List[Any], Dict[str, str]]:
    """Every record of ``files`` parsed; returns ``(items, {file: format})``.

    All bad records are reported together in one :class:`DataError` (the first MAX_REPORTED listed,
    the rest counted), each as ``file:line: reason``: nothing is dropped silently."""
    formats: Dict[str, str] = {}

    def parse(record, origin):
        path = origin.rsplit(":", 1)[0]
        if formats.setdefault(path, fmt) == "auto":  # the file's format is its first record's
            formats[path] = detect_format(record, columns) or "auto"
            if formats[path] == "auto":
                raise _no_format(record, origin)
        return parse_record(record, formats[path], origin, columns, check)

    items = parse_records(files, parse)
    if not items:
        raise DataError([f"{', '.join(files)}: no examples (the file is empty)"])
    return items, {f: formats.get(f, fmt) for f in files}


def parse_stream_line(line: str, origin: str, fmt: str = "auto", columns: Optional[Dict[str, str]] = None):
    """The lazy stream's parser: one line of a ``.txt`` file is a text document, one line of a JSON-lines
    file a record (``origin`` is ``file:line``, so the file type is known)."""
    path = origin.rsplit(":", 1)[0]
    if os.path.splitext(path)[1] == ".txt":
        return parse_record({"text": line.rstrip("\r\n")}, "text", origin, columns)
    return parse_record(json_line(line), fmt, origin, columns)
