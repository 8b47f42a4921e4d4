"""Checkpoints on disk: staged writes, publishing, rotation, run totals and the resume command.

No paddle: plain files, used by :class:`~paddlenlp_ext.training.trainer.FinetuneTrainer`.

A checkpoint is written whole into ``output_dir/.saving-checkpoint-N/checkpoint-N``,
marked complete (``CHECKPOINT_COMPLETE``, last), and only then renamed to
``output_dir/checkpoint-N``.  A run killed or failing while saving leaves the
hidden staging directory (removed by the next run) and every earlier
checkpoint untouched.  ``save_total_limit`` counts complete checkpoints only
and keeps the newest and the best.
"""

import json
import os
import shlex
import shutil
import sys
from typing import Dict, List, Optional

from ..config.checkpoints import (
    REPLACED_PREFIX,
    RUN_TOTALS_NAME,
    STAGING_PREFIX,
    checkpoint_step,
    latest_complete_checkpoint,
    list_checkpoints,
    read_json_file,
)


def last_checkpoint(output_dir: str) -> Optional[str]:
    """The newest *complete* checkpoint (PaddleNLP's get_last_checkpoint would take a half-written one)."""
    from paddlenlp.utils.log import logger  # the trainer's logger (deferred: nothing else here needs paddle)

    latest, skipped = latest_complete_checkpoint(output_dir)
    for path in skipped:
        logger.warning(f"skipping {path}: it has no CHECKPOINT_COMPLETE (cut short while being written)")
    return latest


def staging_root(final: str) -> str:
    """``out/checkpoint-10`` -> ``out/.saving-checkpoint-10`` (hidden: no checkpoint-N pattern matches it)."""
    parent, name = os.path.split(os.path.normpath(final))
    return os.path.join(parent, STAGING_PREFIX + name)


def publish_checkpoint(staged: str, final: str) -> None:
    """Rename the finished ``staged`` checkpoint to ``final``; an existing ``final`` (a run that
    saved this step before) is moved aside first and removed after, so ``final`` names either the
    old or the new complete checkpoint, never a mix."""
    parent, name = os.path.split(os.path.normpath(final))
    replaced = os.path.join(parent, REPLACED_PREFIX + name)
    if os.path.exists(final):
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(staged, final)
    shutil.rmtree(replaced, ignore_errors=True)
    shutil.rmtree(os.path.dirname(staged), ignore_errors=True)


def clean_stale_staging(output_dir: str) -> List[str]:
    """Remove what a killed save left behind (``.saving-*``); put back a ``.replaced-checkpoint-N``
    whose replacement never arrived.  Returns what was done, for the log."""
    done = []
    if not os.path.isdir(output_dir):
        return done
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if name.startswith(STAGING_PREFIX) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path} (a save that did not finish)")
        elif name.startswith(REPLACED_PREFIX) and os.path.isdir(path):
            final = os.path.join(output_dir, name[len(REPLACED_PREFIX) :])
            if os.path.exists(final):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)
                done.append(f"restored {final} (its replacement was not finished)")
    return done


def checkpoints_to_delete(checkpoints: List[str], limit: Optional[int], best: Optional[str] = None) -> List[str]:
    """Which complete checkpoints (oldest first) ``save_total_limit`` removes: the newest and the
    best always stay (as in PaddleNLP, ``limit`` 1 with an older best keeps two).

    >>> checkpoints_to_delete(["c-2", "c-4", "c-6", "c-8"], 2)
    ['c-2', 'c-4']
    >>> checkpoints_to_delete(["c-2", "c-4", "c-6", "c-8"], 2, best="c-2")
    ['c-4', 'c-6']
    >>> checkpoints_to_delete(["c-2"], 1), checkpoints_to_delete(["c-2", "c-4"], None)
    ([], [])
    """
    if not limit or limit <= 0 or len(checkpoints) <= limit:
        return []
    keep = [checkpoints[-1]]
    if best in checkpoints and best not in keep:
        keep.append(best)
    for path in reversed(checkpoints[:-1]):
        if len(keep) >= limit:
            break
        if path not in keep:
            keep.append(path)
    return [p for p in checkpoints if p not in keep]


def rotate_checkpoints(output_dir: str, limit: Optional[int], best: Optional[str] = None) -> List[str]:
    """Apply ``save_total_limit`` to the complete checkpoints of ``output_dir`` (incomplete ones are
    neither counted nor deleted); returns the removed paths."""
    complete = [path for _, path, done in list_checkpoints(output_dir) if done]
    best = os.path.join(output_dir, os.path.basename(os.path.normpath(best))) if best else None
    removed = checkpoints_to_delete(complete, limit, best)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def write_run_totals(checkpoint: str, totals: Dict) -> None:
    """``run_totals.json``: what a resume must continue from that trainer_state.json lacks."""
    with open(os.path.join(checkpoint, RUN_TOTALS_NAME), "w", encoding="utf-8") as f:
        json.dump(totals, f, indent=1)


def read_run_totals(checkpoint: Optional[str]) -> Optional[Dict]:
    """The checkpoint's run totals, or None (no checkpoint, or one from an older paddlenlp_ext)."""
    if not checkpoint:
        return None
    return read_json_file(os.path.join(str(checkpoint), RUN_TOTALS_NAME))


def resume_command(checkpoint: str, argv: Optional[List[str]] = None, python: Optional[str] = None) -> str:
    """The command line that resumes this run from ``checkpoint``: this process's own command with
    ``--resume_from_checkpoint`` replaced.

    >>> resume_command("out/checkpoint-7", ["llm/run_finetune.py", "c.json", "--resume_from_checkpoint=x",
    ...                                     "--lora", "true"], python="python")
    'python llm/run_finetune.py c.json --lora true --resume_from_checkpoint out/checkpoint-7'
    """
    argv = list(sys.argv if argv is None else argv)
    rest, i = [], 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--resume_from_checkpoint":
            i += 1 if i + 1 >= len(argv) or argv[i + 1].startswith("--") else 2
            continue
        if not arg.startswith("--resume_from_checkpoint="):
            rest.append(arg)
        i += 1
    return shlex.join(
        [
            python or sys.executable,
            argv[0] if argv else "llm/run_finetune.py",
            *rest,
            "--resume_from_checkpoint",
            checkpoint,
        ]
    )


def newest_complete(output_dir: str) -> Optional[str]:
    complete = [path for _, path, done in list_checkpoints(output_dir) if done]
    return complete[-1] if complete else None


def save_failure_message(target: str, error: OSError, output_dir: str, is_checkpoint: bool) -> str:
    """What a failed write tells the user: what failed and why, what is intact, what to do."""
    previous = newest_complete(output_dir)
    what = f"checkpoint {target}" if is_checkpoint else f"the final weights into {target}"
    kept = (
        "it was being written in a temporary directory, which was removed"
        if is_checkpoint
        else "the files already there are unchanged"
    )
    step = checkpoint_step(os.path.basename(os.path.normpath(target))) if is_checkpoint else None
    lines = [
        f"could not write {what}: {error.strerror or error} ({type(error).__name__}"
        f"{', errno ' + str(error.errno) if error.errno else ''}{', ' + error.filename if error.filename else ''})"
        f"; {kept}."
    ]
    if previous:
        lines.append(
            f"The previous checkpoint {previous} is complete and intact. Free disk space or fix the "
            f"permissions, then resume with:\n  {resume_command(previous)}"
        )
    else:
        lines.append("No complete checkpoint exists yet; free disk space or fix the permissions and run again.")
    if step is not None:
        lines[0] += f" Training stopped at step {step}."
    return "\n".join(lines)
