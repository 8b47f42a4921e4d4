"""A config problem that says which check found it.

Every problem ``load_config`` reports is a string (it is printed as is).  The
checks about *this* machine, launch and file system -- the ones a memory plan
for another machine sets aside (``planner/config.py``) -- return a
:class:`Problem`: the same string with a ``kind``, so a reader can tell them
apart without matching the wording.

>>> p = Problem("c.json: fp16=true needs a GPU", "gpu_fp16")
>>> p == "c.json: fp16=true needs a GPU", p.kind, kind_of("c.json: typo")
(True, 'gpu_fp16', None)
"""

from __future__ import annotations

import re
from typing import Iterable, List, Optional

__all__ = ["Problem", "kind_of", "tagged", "KINDS"]

#: the kinds, and the check behind each
KINDS = {
    "launch": "the parallel degrees need more processes than this launch has",
    "gpu_fp16": "fp16=true on a CPU build",
    "gpu_bf16_o2": "bf16=true with fp16_opt_level=O2 on a CPU build",
    "device": "device=gpu on a CPU build",
    "model_dir": "model_name_or_path is not a model directory here",
    "data_dir": "dataset_name_or_path is not a dataset directory here",
    "tokenizer_dir": "tokenizer_name_or_path is not a directory here",
    "chat_template": "the chat_template file is not here",
    "resume": "the resume_from_checkpoint checks (checkpoint directories here)",
    "pipeline": "a method or combination paddlenlp_ext does not run pipeline parallel (PaddleNLP does)",
    "expert_parallel": "expert_parallel_degree > 1, verified by simulation only here (PaddleFormers runs it)",
}


class Problem(str):
    """A problem's text (compares, prints and joins as the text) and the ``kind`` of check that found it."""

    kind: str

    def __new__(cls, text: str, kind: str) -> "Problem":
        if kind not in KINDS:
            raise ValueError(f"unknown problem kind {kind!r}; known: {sorted(KINDS)}")
        obj = super().__new__(cls, text)
        obj.kind = kind
        return obj


def kind_of(problem: str) -> Optional[str]:
    return getattr(problem, "kind", None)


def tagged(problems: Iterable[str], kind: str) -> List[str]:
    """``problems`` as :class:`Problem` s of ``kind``."""
    return [Problem(p, kind) for p in problems]


def blame_command_line(problems: List[str], cli_keys: List[str], path: Optional[str]) -> List[str]:
    """Cross-key problems reported against the config file name the keys given on the command line.

    ``["c.json: src_length (300) must not exceed max_length (256)"]`` with ``--max_length 256`` ->
    ``["c.json: src_length (300) must not exceed max_length (256) [max_length from the command line]"]``.
    """
    if path is None or not cli_keys:
        return problems  # already reported against the command line
    out = []
    for problem in problems:
        named = [k for k in cli_keys if re.search(rf"(?<![\w-]){re.escape(k)}(?!\w)", problem)]
        text = f"{problem} [{', '.join(named)} from the command line]" if named else problem
        out.append(Problem(text, kind_of(problem)) if kind_of(problem) else text)
    return out
