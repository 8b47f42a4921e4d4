"""Names, the error type and small helpers shared by every merge module.

Owns: PaddleNLP's checkpoint file names, the markers the merge writes,
``MergeError``, the ``Log`` callback type, ``parse_size`` (``--max_shard_size``)
and ``fmt_bytes`` (log messages).  It imports no other module of the package,
so all of them can depend on it.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

# PaddleNLP file names (paddlenlp.utils.env)
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PADDLE_WEIGHTS_NAME = "model_state.pdparams"
PADDLE_WEIGHTS_INDEX_NAME = "model_state.pdparams.index.json"
MODEL_CONFIG_NAME = "config.json"

VERIFY_FAILED_MARKER = "MERGE_VERIFY_FAILED"
MERGE_INFO_NAME = "merge_info.json"


class MergeError(Exception):
    """A problem with the inputs or the output location (nothing is written)."""


Log = Callable[[str], None]


def parse_size(size) -> int:
    """``"1GB"`` -> 10**9, ``"500MiB"`` -> 500 * 2**20, ints pass through (PaddleNLP's convention)."""
    if isinstance(size, (int, np.integer)):
        return int(size)
    s = str(size).strip().upper().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]I?B|B)?", s)
    if not m:
        raise MergeError(f"max_shard_size: cannot parse {size!r} (examples: 1GB, 500MB, 2GiB, 1000000)")
    num, unit = float(m.group(1)), m.group(2) or "B"
    mult = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    n = int(num * mult)
    if n <= 0:
        raise MergeError(f"max_shard_size must be positive, got {size!r}")
    return n


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024.0
    return f"{n:.1f} TiB"
