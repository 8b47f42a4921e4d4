"""Read and validate fine-tuning data files (JSON lines), without paddle.

Format (PaddleNLP's fine-tuning docs), one JSON object per line::

    {"src": "Type#dress*Color#blue", "tgt": "A blue dress ..."}
    {"src": ["hi", "and then?"], "tgt": ["hello", "bye"], "context": {"system": "Be brief."}}

``src``/``tgt`` are strings (one turn) or equally long lists of strings
(multi-turn: one src per tgt).  A malformed line stops the run with
``file:line`` and the reason; nothing is skipped.

Files are UTF-8 (a leading byte-order mark is accepted and dropped).  Every
text file a run reads goes through :func:`read_utf8_lines` /
:func:`read_utf8_text` (also the DPO reader, the predictor's input and the
config), so another encoding is one clear :class:`DataError` naming the file,
line and byte offset and the ``iconv`` command that converts it.
"""

import codecs
import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

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


UTF8_BOM = codecs.BOM_UTF8
# UTF-16/32 files start with one of these; they are refused with a conversion hint, not misread.
OTHER_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


class EncodingProblem(ValueError):
    """A file that is not UTF-8; ``str()`` is the whole user-facing message."""


def _guess_encoding(raw: bytes) -> str:
    """The ``iconv -f`` name to suggest for bytes that are not UTF-8.

    GBK is tried first (the common case: Chinese data saved on Windows); bytes that are not
    valid GBK either are most likely latin-1 / cp1252.

    >>> _guess_encoding("你好".encode("gbk")), _guess_encoding("café".encode("latin-1"))
    ('gbk', 'latin1')
    """
    try:
        raw.decode("gbk")
    except UnicodeDecodeError:
        return "latin1"
    return "gbk"


def decode_utf8(raw: bytes, path: str, lineno: int, offset: int) -> str:
    """One line's bytes (starting at byte ``offset`` of ``path``) -> text.

    A UTF-8 byte-order mark at the start of the file is dropped; bytes that are not UTF-8 raise
    :class:`EncodingProblem` naming ``path:lineno``, the byte offset in the file and how to convert.

    >>> decode_utf8(b"\\xef\\xbb\\xbf{}\\n", "f.json", 1, 0)
    '{}\\n'
    >>> decode_utf8("é".encode("latin-1"), "f.json", 3, 10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    paddlenlp_ext.data.reader.EncodingProblem: f.json:3: not UTF-8: byte 0xe9 at byte offset 10 of the file ...
    """
    if offset == 0:
        for bom, name in OTHER_BOMS:
            if raw.startswith(bom):
                raise EncodingProblem(
                    f"{path}:1: the file is {name.upper()} (it starts with a {name} byte-order mark); training data "
                    f"must be UTF-8. Convert it: {_iconv(name, path)}"
                )
        if raw.startswith(UTF8_BOM):
            raw, offset = raw[len(UTF8_BOM) :], len(UTF8_BOM)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        guess = _guess_encoding(raw)
        raise EncodingProblem(
            f"{path}:{lineno}: not UTF-8: byte 0x{raw[e.start]:02x} at byte offset {offset + e.start} of the file "
            f"(column {len(raw[: e.start].decode('utf-8', 'replace')) + 1} of the line) cannot be decoded. The file "
            f"seems to be in another encoding ({'GBK' if guess == 'gbk' else 'latin-1'}?). Convert it to UTF-8 "
            f"in place: {_iconv(guess, path)}"
        ) from None


def _iconv(encoding: str, path: str) -> str:
    """The conversion command, in place.  The temporary name ends in ``.utf8`` so that a
    ``train/*.json`` split never picks it up twice:

    >>> _iconv("gbk", "d/train.json")
    'iconv -f gbk -t utf-8 d/train.json > d/train.json.utf8 && mv d/train.json.utf8 d/train.json'
    """
    return f"iconv -f {encoding} -t utf-8 {path} > {path}.utf8 && mv {path}.utf8 {path}"


def read_utf8_lines(path: str) -> Iterator[Tuple[int, str]]:
    """``(line number, text)`` for every line of ``path``, decoded as UTF-8 (BOM dropped).

    The shared reader of line-based inputs (SFT and preference data, predictor inputs).  Not
    UTF-8 -> :class:`DataError` with ``path:line``, the byte offset and the ``iconv`` command;
    a missing or unreadable file -> :class:`DataError` naming it.  A file with the bytes
    ``EF BB BF {"a": 1} \\n {"a": 2}`` yields ``(1, '{"a": 1}\\n')`` then ``(2, '{"a": 2}')``.
    """
    try:
        with open(path, "rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, 1):
                try:
                    yield lineno, decode_utf8(raw, path, lineno, offset)
                except EncodingProblem as e:
                    raise DataError([str(e)]) from None
                offset += len(raw)
    except OSError as e:
        raise DataError([f"{path}: cannot read the file: {e.strerror or e}"]) from e


def read_utf8_text(path: str) -> str:
    """The whole of ``path`` as UTF-8 text (BOM dropped); errors as :func:`read_utf8_lines`."""
    return "".join(text for _, text in read_utf8_lines(path))


def find_split_files(dataset_dir: str, split: str) -> List[str]:
    """``train`` -> ``[dir/train.json]`` or sorted ``dir/train/*.json`` (or []).

    Other data files are found the same way when there is no ``.json``: ``dir/train.jsonl``,
    ``dir/train.parquet``, ``dir/train.txt``, then ``dir/train/*.{json,jsonl,parquet,txt}``.
    """
    for ext in SPLIT_EXTENSIONS:
        single = os.path.join(dataset_dir, f"{split}{ext}")
        if os.path.isfile(single):
            return [single]
    return sorted(f for ext in SPLIT_EXTENSIONS for f in glob.glob(os.path.join(dataset_dir, split, f"*{ext}")))


SPLIT_EXTENSIONS = (".json", ".jsonl", ".parquet", ".txt")


def dataset_files(path: str, split: str) -> List[str]:
    """The files of ``split`` for ``dataset_name_or_path``: a directory as :func:`find_split_files`;
    a single data file is the train split (``[path]``) and has no dev split (``[]``)."""
    if os.path.isfile(path):
        return [path] if split == "train" else []
    return find_split_files(path, split)


def context_system(obj: dict):
    """The optional system prompt of a data line: ``{"context": {"system": "..."}}`` -> ``"..."``, else None."""
    context = obj.get("context")
    if context is None:
        return None
    if not isinstance(context, dict):
        raise ValueError('\'context\' must be an object such as {"system": "..."}')
    system = context.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'context.system' must be a string")
    return system


def parse_line(line: str, origin: str) -> Example:
    """Validate one JSON line. Raises ValueError with the reason.

    >>> parse_line('{"src": "a", "tgt": "b"}', "f:1")
    Example(src=['a'], tgt=['b'], system=None, origin='f:1')
    """
    return example_from_obj(json_line(line), origin)


def json_line(line: str) -> Any:
    """One JSON-lines record, or ValueError saying where the JSON breaks (the caller adds ``file:line``).

    ``json_line('{"a": 1}')`` -> ``{'a': 1}``; ``json_line('{"a": }')`` -> ValueError
    ``invalid JSON (Expecting value at column 7)``.
    """
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None


def example_from_obj(obj, origin: str) -> Example:
    """:func:`parse_line` after JSON decoding: ``{"src": "a", "tgt": "b"}`` -> ``Example(['a'], ['b'])``."""
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
    system = context_system(obj)
    return Example(src=src, tgt=tgt, system=system, origin=origin)


def parse_json_lines(files: Sequence[str], parse: Callable[[str, str], Any]) -> List[Any]:
    """``parse(line, "file:line")`` for every non-empty line of ``files``, in order.

    A ``ValueError`` from ``parse`` is a problem ``file:line: message``; a file that is not UTF-8 or
    cannot be read is one problem for that file.  All problems are raised together as one DataError
    (the first MAX_REPORTED listed, the rest counted): nothing is dropped silently.
    """
    parsed, problems, extra = [], [], 0
    for path in files:
        try:
            for lineno, line in read_utf8_lines(path):
                if not line.strip():
                    continue
                try:
                    parsed.append(parse(line, f"{path}:{lineno}"))
                except ValueError as e:
                    if len(problems) < MAX_REPORTED:
                        problems.append(f"{path}:{lineno}: {e}")
                    else:
                        extra += 1
        except DataError as e:  # not UTF-8 / unreadable: one problem for the file, listed with the others
            problems += e.problems
    if problems:
        raise DataError(problems, extra)
    return parsed


def read_examples(files: List[str]) -> List[Example]:
    """Read every line of ``files``; reports up to MAX_REPORTED bad lines at once.

    A file ``f`` with the lines ``{"src": "a", "tgt": "b"}``, an empty line, and ``{"src": "a"}``
    raises ``DataError`` with ``f:3: missing key 'tgt'`` (empty lines are skipped, nothing else is);
    without line 3 it returns ``[Example(src=['a'], tgt=['b'], system=None, origin='f:1')]``.
    """
    examples = parse_json_lines(files, parse_line)
    if not examples:
        raise DataError([f"{', '.join(files)}: no examples (the file is empty)"])
    return examples
