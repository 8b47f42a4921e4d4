"""Preference records -> :class:`PreferenceExample` s: PaddleNLP's ``src/tgt/response/sort`` lines and the
LLaMA-Factory / OpenAI pair forms (:mod:`paddlenlp_ext.data.formats.preference`), validated with ``file:line``;
and where a split's files are (a file, a directory, or a ``dataset_info.json`` entry).  Tokenizing the pairs
and building the datasets is :mod:`.data`'s job."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..data.dataset_info import named_entry
from ..data.formats import preference
from ..data.formats.files import parse_records
from ..data.reader import DataError, find_split_files, json_line


@dataclass
class PreferenceExample:
    src: List[str]  # n turns, the last one is the prompt
    tgt: List[str]  # n - 1 history answers
    chosen: str
    rejected: str
    system: Optional[str] = None
    origin: str = ""  # "file:line"
    # a pair with tool calls / tool results / tools (rendered by a jinja template): the prompt conversation
    # and the (chosen, rejected) assistant messages; src / tgt then hold only the texts, for reports
    conversation: Optional[Any] = field(default=None, repr=False)
    answers: Optional[Tuple[Any, Any]] = field(default=None, repr=False)


def _problems_of(obj, origin: str = "", columns=None) -> Tuple[List[str], Optional[PreferenceExample]]:
    if preference.matches(obj, columns):  # LLaMA-Factory / OpenAI forms: conversations or messages + chosen / rejected
        try:
            conv, chosen, rejected = preference.convert_pair(obj, origin, columns)
        except ValueError as e:
            return [str(e)[len(origin) + 2 :] if str(e).startswith(f"{origin}: ") else str(e)], None
        plain = preference.plain_turns(conv, chosen, rejected)
        if plain is None:  # tool calls and friends: the jinja template renders the conversation
            users = [m.content for m in conv.messages if m.role == "user"]
            return [], PreferenceExample(
                src=users,
                tgt=[],
                chosen=chosen.content,
                rejected=rejected.content,
                conversation=conv,
                answers=(chosen, rejected),
            )
        system, src, tgt, c, r = plain
        return [], PreferenceExample(src=src, tgt=tgt, chosen=c, rejected=r, system=system)
    if not isinstance(obj, dict):
        return ["expected a JSON object with 'src', 'tgt', 'response' and 'sort'"], None
    missing = [k for k in ("src", "tgt", "response", "sort") if k not in obj]
    if missing:
        hint = ' (use "tgt": [] for a one-turn prompt)' if "tgt" in missing else ""
        return [f"missing key(s) {', '.join(map(repr, missing))}{hint}"], None
    p: List[str] = []
    src = [obj["src"]] if isinstance(obj["src"], str) else obj["src"]
    tgt = [obj["tgt"]] if isinstance(obj["tgt"], str) else obj["tgt"]
    if not isinstance(src, list) or not src or not all(isinstance(s, str) for s in src):
        p.append("'src' must be a string or a non-empty list of strings")
    if not isinstance(tgt, list) or not all(isinstance(s, str) for s in tgt):
        p.append("'tgt' must be a string or a list of strings ([] for a one-turn prompt)")
    if not p and len(src) != len(tgt) + 1:
        p.append(
            f"mismatched turns: {len(src)} src and {len(tgt)} tgt; a preference line needs exactly one more "
            f"src than tgt (the last src is the prompt both responses answer)"
        )
    resp, sort = obj["response"], obj["sort"]
    if not isinstance(resp, list) or len(resp) != 2:
        n = len(resp) if isinstance(resp, list) else type(resp).__name__
        p.append(f"'response' must be a list of exactly 2 strings (got {n}): the two answers to compare")
        resp = None
    else:
        for i, r in enumerate(resp):
            if not isinstance(r, str) or not r.strip():
                p.append(f"response {i} is empty or not a string: both answers need text")
    if (
        not isinstance(sort, list)
        or len(sort) != 2
        or not all(isinstance(s, Real) and not isinstance(s, bool) for s in sort)
    ):
        p.append("'sort' must be a list of exactly 2 numbers, one score per response (higher = chosen)")
    elif sort[0] == sort[1]:
        p.append(
            f"sort values tie ({sort[0]} == {sort[1]}): cannot tell which response is chosen; "
            f"give the preferred response the higher score or drop the line"
        )
    system = None
    ctx = obj.get("context")
    if ctx is not None:
        if not isinstance(ctx, dict) or not isinstance(ctx.get("system") or "", str):
            p.append('\'context\' must be an object such as {"system": "..."}')
        else:
            system = ctx.get("system")
    if p:
        return p, None
    hi = 0 if sort[0] > sort[1] else 1
    return [], PreferenceExample(
        src=[s.strip() for s in src],
        tgt=[t.strip() for t in tgt],
        chosen=resp[hi].strip(),
        rejected=resp[1 - hi].strip(),
        system=system,
    )


def parse_preference_line(line: str, origin: str) -> PreferenceExample:
    """Validate one JSON line; ValueError listing every problem of the line ("; "-joined).

    The higher ``sort`` wins; texts are stripped (as PaddleNLP does):

    >>> parse_preference_line('{"src": " q ", "tgt": [], "response": ["a", "b"], "sort": [0, 1]}', "f:1")
    PreferenceExample(src=['q'], tgt=[], chosen='b', rejected='a', system=None, origin='f:1')
    """
    return preference_from_obj(json_line(line), origin)


def preference_from_obj(obj, origin: str, columns=None) -> PreferenceExample:
    """:func:`parse_preference_line` after JSON decoding (any record of a JSON array, JSON lines or parquet);
    ``columns``: renamed fields / role tags (a ``dataset_info.json`` entry's ``columns`` and ``tags``)."""
    problems, ex = _problems_of(obj, origin, columns)
    if problems:
        raise ValueError("; ".join(problems))
    ex.origin = origin
    return ex


def read_preference_files(files: Sequence[str], columns=None) -> List[PreferenceExample]:
    """Read every non-empty line of ``files``; all bad lines are raised together as DataError.

    A file ``f`` whose line 2 is ``{"src": "q", "tgt": [], "response": ["a", "b"], "sort": [1, 1]}``
    raises ``DataError`` with ``f:2: sort values tie (1 == 1): ...`` (plus every other bad
    line; the first MAX_REPORTED are listed and the rest counted).  No files or no lines -> DataError.
    """
    if not files:
        raise DataError(["no preference data files found"])
    # .json (array or lines), .jsonl, .parquet: each record with its line, every bad one listed
    out: List[PreferenceExample] = parse_records(files, lambda obj, origin: preference_from_obj(obj, origin, columns))
    if not out:
        raise DataError([f"{', '.join(files)}: no preference pairs (the file is empty)"])
    return out


def resolve_split_files(path: str, split: str) -> List[str]:
    """PaddleNLP passes a file (``train_dataset_path: data/train.jsonl``); a directory is also
    accepted and searched like the SFT data (``dir/train.json`` or ``dir/train/*.json``).

    ``resolve_split_files("llm/data/dpo_tiny", "dev") == ["llm/data/dpo_tiny/dev.json"]``.
    """
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = find_split_files(path, split)
        if files:
            return files
        raise DataError([f"{path}: no {split}.json or {split}/*.json in this directory"])
    raise DataError([f"{path}: no such file or directory ({split}_dataset_path)"])


def source_files(path: str, split: str, data_args: Any) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """``(files, columns)`` of ``train_dataset_path`` / ``dev_dataset_path``: a file or directory (columns
    None), or the name of a ``ranking`` entry of ``dataset_dir``'s ``dataset_info.json`` (its files and its
    columns / tags, :mod:`paddlenlp_ext.data.dataset_info`)."""
    dataset_dir = getattr(data_args, "dataset_dir", None)
    entry = named_entry(path, data_args)
    if entry is not None:
        if not entry.ranking:
            raise DataError(
                [
                    f'{dataset_dir}/dataset_info.json: {path!r} is not a preference dataset (no "ranking": '
                    "true); DPO and reward models train on chosen / rejected pairs"
                ]
            )
        return entry.files, entry.columns
    return resolve_split_files(path, split), None
