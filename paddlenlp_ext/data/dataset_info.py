"""LLaMA-Factory's ``dataset_info.json``: a dataset named in it -> its local files, format and field names.

``dataset_dir`` (LLaMA-Factory's key) holds ``dataset_info.json``; ``dataset_name_or_path`` (fine-tuning) or
``train_dataset_path`` / ``dev_dataset_path`` (DPO, reward models) may then name one of its entries.  An
entry is honoured as LLaMA-Factory reads it, for local files:

* ``file_name``: a file or a directory (every data file in it) under ``dataset_dir``;
* ``formatting``: ``alpaca`` (its default) or ``sharegpt`` (``openai``: the OpenAI messages format);
* ``columns`` (``prompt``, ``query``, ``response``, ``history``, ``messages``, ``system``, ``tools``,
  ``chosen``, ``rejected``, ``kto_tag``) and ``tags`` (``role_tag``, ``content_tag``, ``user_tag``,
  ``assistant_tag``, ``observation_tag``, ``function_tag``, ``system_tag``): our ``dataset_columns`` names;
* ``ranking``: a preference dataset (DPO, reward models); fine-tuning refuses it and DPO needs it.

An entry with only ``hf_hub_url`` / ``ms_hub_url`` / ``om_hub_url`` / ``script_url`` / ``cloud_file_name`` is
refused (local files only), as are image / video / audio columns.  Worked example::

    dataset_info.json: {"my_chat": {"file_name": "chat.json", "formatting": "sharegpt",
                                    "tags": {"role_tag": "role", "content_tag": "content",
                                             "user_tag": "user", "assistant_tag": "assistant"}}}
    lookup("my_chat", "data") -> DatasetEntry(name="my_chat", files=["data/chat.json"], format="sharegpt",
                                              columns={"role_tag": "role", ...}, ranking=False)
"""

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .formats.files import EXTENSIONS
from .reader import DataError, read_utf8_text

INFO_FILE = "dataset_info.json"
FORMATTINGS = {"alpaca": "alpaca", "sharegpt": "sharegpt", "openai": "messages"}
COLUMN_NAMES = (
    "prompt",
    "query",
    "response",
    "history",
    "messages",
    "system",
    "tools",
    "chosen",
    "rejected",
    "kto_tag",
)
TAG_NAMES = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")
MEDIA_COLUMNS = ("images", "videos", "audios")
REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


class DatasetInfoError(ValueError):
    """A dataset_info.json problem; ``str()`` is the whole user-facing message."""


@dataclass
class DatasetEntry:
    name: str
    files: List[str]
    format: str
    columns: Dict[str, str] = field(default_factory=dict)
    ranking: bool = False


def read_info(dataset_dir: str) -> Dict:
    """``dataset_dir/dataset_info.json`` as a dict; DatasetInfoError naming the file when missing or invalid."""
    path = os.path.join(dataset_dir, INFO_FILE)
    if not os.path.isfile(path):
        raise DatasetInfoError(f"dataset_dir {dataset_dir!r} has no {INFO_FILE} (looked for {os.path.abspath(path)})")
    try:
        info = json.loads(read_utf8_text(path))
    except json.JSONDecodeError as e:
        raise DatasetInfoError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(info, dict):
        raise DatasetInfoError(f"{path}: must be a JSON object of dataset names")
    return info


def is_entry(name: str, dataset_dir: Optional[str]) -> bool:
    """Whether ``name`` names an entry of ``dataset_dir``'s dataset_info.json (False without dataset_dir)."""
    if not dataset_dir or not name:
        return False
    try:
        return name in read_info(dataset_dir)
    except DatasetInfoError:
        return False


def _data_files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(EXTENSIONS))


def lookup(name: str, dataset_dir: str) -> DatasetEntry:
    """The entry ``name`` of ``dataset_dir/dataset_info.json`` (see the module doc); DatasetInfoError saying
    what to change when it is not usable here."""
    info = read_info(dataset_dir)
    where = f"{os.path.join(dataset_dir, INFO_FILE)}: {name!r}"
    if name not in info:
        raise DatasetInfoError(f"{where} is not a dataset of it (it has {', '.join(sorted(info)[:12])})")
    e = info[name]
    if not isinstance(e, dict):
        raise DatasetInfoError(f"{where} must be an object with file_name")
    if "file_name" not in e:
        remote = [k for k in REMOTE_KEYS if k in e]
        if remote:
            raise DatasetInfoError(
                f"{where} has only {remote[0]} ({e[remote[0]]!r}); paddlenlp_ext reads local files "
                "only: download the dataset into dataset_dir and give its file_name"
            )
        raise DatasetInfoError(f"{where} has no file_name")
    path = os.path.join(dataset_dir, e["file_name"])
    if not os.path.exists(path):
        raise DatasetInfoError(f"{where}: file_name {e['file_name']!r} not found (looked for {os.path.abspath(path)})")
    files = _data_files(path)
    if not files:
        raise DatasetInfoError(f"{where}: the directory {path!r} holds no {', '.join(EXTENSIONS)} files")
    formatting = e.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise DatasetInfoError(f"{where}: formatting {formatting!r} is not one of {', '.join(FORMATTINGS)}")
    columns: Dict[str, str] = {}
    for group, names in (("columns", COLUMN_NAMES), ("tags", TAG_NAMES)):
        given = e.get(group) or {}
        if not isinstance(given, dict):
            raise DatasetInfoError(f"{where}: {group} must be an object")
        for key, val in given.items():
            if key in MEDIA_COLUMNS:
                raise DatasetInfoError(f"{where}: {group}.{key}: multimodal data is not supported (text models only)")
            if key not in names or not isinstance(val, str):
                raise DatasetInfoError(
                    f"{where}: {group}.{key}: unknown name or not a field name; known: {', '.join(names)}"
                )
            columns[key] = val
    if formatting == "openai":
        columns.setdefault("messages", "conversations")  # LLaMA-Factory's default column, for every formatting
    if formatting == "openai" and any(k in columns for k in TAG_NAMES):
        raise DatasetInfoError(
            f"{where}: formatting openai reads OpenAI's role/content names; remove the tags or use formatting sharegpt"
        )
    return DatasetEntry(
        name=name, files=files, format=FORMATTINGS[formatting], columns=columns, ranking=bool(e.get("ranking", False))
    )


def named_entry(name: str, data_args) -> Optional[DatasetEntry]:
    """The ``dataset_info.json`` entry ``name`` names in ``data_args.dataset_dir``, or None when ``name`` is a path
    (or no ``dataset_dir`` is set); a bad entry is a ``DataError`` (exit 2 with the reason)."""
    dataset_dir = getattr(data_args, "dataset_dir", None)
    if not is_entry(name, dataset_dir):
        return None
    try:
        return lookup(name, dataset_dir)
    except DatasetInfoError as e:
        raise DataError([str(e)]) from None
