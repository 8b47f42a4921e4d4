"""Training into an output_dir that already holds a run: one rule, checked before anything loads (no paddle).

PaddleNLP's ``llm/run_finetune.py`` silently resumes from the last ``checkpoint-*``
unless ``overwrite_output_dir``; transformers' example scripts refuse a non-empty
output_dir without ``--overwrite_output_dir``.  We keep PaddleNLP's key names and
make the choice explicit: a training run whose output_dir holds an earlier run
(a ``checkpoint-N`` directory or ``run_summary.json``) is refused (exit 2) unless
it says what it wants:

* ``resume_from_checkpoint: true`` (or a path) continues the earlier run;
* ``overwrite_output_dir: true`` starts over: :func:`earlier_run_entries` lists what
  the run removes before it trains (every ``checkpoint-*`` and, in a directory
  written by paddlenlp_ext, the earlier results), said on the console.

With both keys the resume wins, as in PaddleNLP (whose ``overwrite_output_dir`` only
turns off finding the last checkpoint): nothing is removed, said as a derived setting
(:func:`resume_overrides_overwrite`), so the resume command printed after a SIGTERM
works with a config that sets ``overwrite_output_dir: true``.

Evaluation-only runs (``do_train: false``) read the directory and are never refused.
"""

import os
from typing import List, Optional

from .checkpoints import REPLACED_PREFIX, RESOLVED_CONFIG_NAME, STAGING_PREFIX, list_checkpoints

RUN_SUMMARY_NAME = "run_summary.json"


def _describe_checkpoints(output_dir: str) -> List[str]:
    """``["checkpoint-20", "checkpoint-25 (incomplete)"]`` of output_dir, oldest first."""
    return [
        os.path.basename(path) + ("" if complete else " (incomplete)")
        for _, path, complete in list_checkpoints(output_dir)
    ]


def earlier_run_problems(training: dict, where: str) -> List[str]:
    """The refusal of a training run into a directory holding an earlier run (empty when allowed).

    ``output_dir: out`` holding ``out/checkpoint-20`` and ``out/run_summary.json``, no resume or
    overwrite key -> ``["cfg.json: output_dir 'out' (/abs/out) already holds a run (checkpoint-20,
    run_summary.json); set resume_from_checkpoint: true to continue from checkpoint-20, or
    overwrite_output_dir: true to start over ..."]``.
    """
    out = training.get("output_dir")
    if not out or not training.get("do_train", False) or not os.path.isdir(out):
        return []
    resume, overwrite = training.get("resume_from_checkpoint"), training.get("overwrite_output_dir", False)
    if overwrite or resume is not None:
        return []  # with both, the resume wins (as in PaddleNLP): resume_overrides_overwrite
    found = _describe_checkpoints(out)
    if os.path.isfile(os.path.join(out, RUN_SUMMARY_NAME)):
        found.append(RUN_SUMMARY_NAME)
    if not found:
        return []
    complete = [c for c in found if c.startswith("checkpoint-") and not c.endswith("(incomplete)")]
    cont = (
        f"set resume_from_checkpoint: true to continue from {complete[-1]}"
        if complete
        else "(it holds no complete checkpoint to continue from)"
    )
    return [
        f"{where}: output_dir {out!r} ({os.path.abspath(out)}) already holds a run ({', '.join(found)}); "
        f"{cont}, or overwrite_output_dir: true to start over (removes the earlier checkpoints and results "
        "first), or choose another output_dir"
    ]


def resume_overrides_overwrite(cfg) -> None:
    """``overwrite_output_dir`` and ``resume_from_checkpoint`` both set: turn the overwrite off (nothing of the
    run being resumed is removed) and note it as a derived setting."""
    t = cfg.training
    if t.get("overwrite_output_dir") and t.get("resume_from_checkpoint") is not None and t.get("do_train"):
        t["overwrite_output_dir"] = False
        cfg.derived["overwrite_output_dir"] = (
            "False (resume_from_checkpoint continues the earlier run; nothing in output_dir is removed)"
        )


def earlier_run_entries(output_dir: Optional[str]) -> List[str]:
    """What ``overwrite_output_dir: true`` removes from ``output_dir``, as names.

    Every ``checkpoint-N`` and half-written ``.saving-*`` / ``.replaced-*`` directory; when the
    directory was written by paddlenlp_ext (it holds resolved_config.json or run_summary.json),
    everything in it, since all of it is the earlier run's output.  A directory that is not ours
    keeps its other files.

    ``out/`` = {checkpoint-5/, run_summary.json, resolved_config.json, loss.png} ->
    ``["checkpoint-5", "loss.png", "resolved_config.json", "run_summary.json"]``;
    ``out/`` = {checkpoint-5/, notes.txt} -> ``["checkpoint-5"]``.
    """
    if not output_dir or not os.path.isdir(output_dir):
        return []
    names = sorted(os.listdir(output_dir))
    ours = RESOLVED_CONFIG_NAME in names or RUN_SUMMARY_NAME in names
    if ours:
        return names
    return [
        n
        for n in names
        if n.startswith(("checkpoint-", STAGING_PREFIX, REPLACED_PREFIX)) and os.path.isdir(os.path.join(output_dir, n))
    ]
