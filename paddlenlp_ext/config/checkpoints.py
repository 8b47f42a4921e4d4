"""Checkpoint directories as files on disk, without paddle.

The config check (``resume_from_checkpoint: true``, settings compared before
anything loads), the trainer (which writes the marker and rotates) and the
run builder share these facts, so they live where every one of them may
import them (``config/`` never imports paddle).

A checkpoint is ``output_dir/checkpoint-N``; it is *complete* when it holds
``CHECKPOINT_COMPLETE``, written last (a directory without it was cut short
while being written, or was not written by paddlenlp_ext).  Checkpoints are
written under ``output_dir/.saving-checkpoint-N/`` and renamed into place, so
a half-written one normally never carries the ``checkpoint-N`` name at all.
"""

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

CHECKPOINT_COMPLETE_NAME = "CHECKPOINT_COMPLETE"
# The run's resolved config (training.run writes it into output_dir; the trainer copies it into
# every checkpoint, so a resume can compare the settings it was trained with).
RESOLVED_CONFIG_NAME = "resolved_config.json"
# Run totals that PaddleNLP's trainer_state.json does not keep (loss sum, token counters, train time).
RUN_TOTALS_NAME = "run_totals.json"
STAGING_PREFIX = ".saving-"
REPLACED_PREFIX = ".replaced-"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(name: str) -> Optional[int]:
    """``"checkpoint-12"`` -> 12; anything else -> None.

    >>> checkpoint_step("checkpoint-12"), checkpoint_step(".saving-checkpoint-12"), checkpoint_step("x")
    (12, None, None)
    """
    m = _CHECKPOINT_RE.match(name)
    return int(m.group(1)) if m else None


def is_complete(checkpoint: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint, CHECKPOINT_COMPLETE_NAME))


def list_checkpoints(output_dir: str) -> List[Tuple[int, str, bool]]:
    """``[(step, path, complete), ...]`` of ``output_dir``'s ``checkpoint-N`` directories, by step."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        step = checkpoint_step(name)
        path = os.path.join(output_dir, name)
        if step is not None and os.path.isdir(path):
            found.append((step, path, is_complete(path)))
    return sorted(found)


def latest_complete_checkpoint(output_dir: str) -> Tuple[Optional[str], List[str]]:
    """(the newest complete checkpoint or None, the newer incomplete ones that were skipped).

    ``checkpoint-10`` complete and ``checkpoint-15`` without the marker ->
    ``("out/checkpoint-10", ["out/checkpoint-15"])``.
    """
    skipped = []
    for _, path, complete in reversed(list_checkpoints(output_dir)):
        if complete:
            return path, skipped
        skipped.append(path)
    return None, skipped


def read_json_file(path: str) -> Optional[Dict[str, Any]]:
    """A small JSON file written by paddlenlp_ext, or None when absent; unreadable -> ValueError naming it."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: JSON and UTF-8 decoding
        raise ValueError(f"{path}: cannot read it ({e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return obj
