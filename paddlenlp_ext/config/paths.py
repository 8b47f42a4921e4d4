"""Where a config's relative paths point, and what a path message says (no paddle).

The rule (docs/config.md, "Relative paths"): a relative path resolves against the
current directory, as in PaddleNLP.  The shipped configs (``llm/config/...``) are
written from the repository root; PaddleNLP users run them from ``llm/``
(``cd llm && python run_finetune.py ./config/...``).  So when an *input* path of a
config file under ``<root>/llm/config/`` does not exist from the current directory
but does from ``<root>``, the root's one is used, said as a derived setting.
Outputs (``output_dir``) always follow the current directory (``llm/output/`` from
``llm/``, as PaddleNLP writes ``llm/checkpoints/``).

Every path message names the absolute path it tried.
"""

import os
import re
from typing import Dict, Optional

#: config keys naming files or directories the run reads
INPUT_PATH_KEYS = (
    "model_name_or_path",
    "tokenizer_name_or_path",
    "lora_path",
    "lokr_path",
    "prefix_path",
    "dataset_name_or_path",
    "chat_template",
    "train_dataset_path",
    "dev_dataset_path",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def repo_root_of(config_path: Optional[str]) -> Optional[str]:
    """The directory holding ``llm/config/`` of a config file inside it, else None.

    >>> repo_root_of("/src/pnx/llm/config/tiny/lora_argument.json"), repo_root_of("/tmp/my.json")
    ('/src/pnx', None)
    """
    if not config_path:
        return None
    parts = os.path.abspath(config_path).split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "llm" and parts[i + 1] == "config":
            return os.sep.join(parts[:i]) or os.sep
    return None


def resolve_from_root(
    values: Dict[str, object], config_path: Optional[str], cwd: Optional[str] = None
) -> Dict[str, str]:
    """The input paths to take from the repository root instead: ``{key: absolute path}``.

    Run from ``/src/pnx/llm`` with ``/src/pnx/llm/config/tiny/sft_argument.json`` holding
    ``model_name_or_path: "build/tiny-llama"`` (absent from ``/src/pnx/llm``, present in ``/src/pnx``)
    -> ``{"model_name_or_path": "/src/pnx/build/tiny-llama"}``.
    """
    root = repo_root_of(config_path)
    cwd = cwd or os.getcwd()
    if root is None or os.path.abspath(root) == os.path.abspath(cwd):
        return {}
    out = {}
    for key in INPUT_PATH_KEYS:
        value = values.get(key)
        if not isinstance(value, str) or not value or os.path.isabs(value):
            continue
        if not os.path.exists(os.path.join(cwd, value)) and os.path.exists(os.path.join(root, value)):
            out[key] = os.path.join(root, value)
    return out


def missing_path_text(key: str, value: str) -> str:
    """What to say about a path that does not exist; a hub id gets the download hint.

    >>> missing_path_text("model_name_or_path", "meta-llama/Llama-2-7b").split("; ", 1)[1]
    'models are never downloaded; download it first (e.g. `huggingface-cli download meta-llama/Llama-2-7b --local-dir Llama-2-7b`) and give that directory'
    """
    text = f"{key} {value!r} does not exist (looked for {os.path.abspath(value)})"
    if (
        key in ("model_name_or_path", "tokenizer_name_or_path")
        and _HUB_ID.match(value)
        and not value.startswith((".", "~"))
    ):
        local = value.split("/")[-1]
        text += (
            f"; models are never downloaded; download it first (e.g. `huggingface-cli download {value} "
            f"--local-dir {local}`) and give that directory"
        )
    return text


def model_dir_text(key: str, value: str) -> Optional[str]:
    """None when ``value`` is a model directory (has config.json), else what is wrong with it."""
    if not os.path.exists(value):
        return missing_path_text(key, value)
    if not os.path.isfile(os.path.join(value, "config.json")):
        return (
            f"{key} {value!r} is not a model directory: {os.path.abspath(value)} has no config.json; point it "
            "at a local directory with config.json, weights and tokenizer files"
        )
    return None
