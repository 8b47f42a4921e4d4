"""Shared CLI plumbing: config loading and the exit codes of every script.

Exit codes (docs/reliability.md):

* ``0`` success;
* ``1`` internal failure (a bug, or a write that failed: disk full, permission), with a message;
* ``2`` bad input: config, data (``file:line``), paths, before or during the run;
* ``128 + signal`` (130 SIGINT, 143 SIGTERM): interrupted; a checkpoint was saved and the
  message prints the command that resumes.
"""

import sys
from typing import List, Optional, Tuple

from ..config.modes import MODES
from ..config.parse import ConfigError, RunConfig, load_config
from ..data.reader import DataError
from ..training.errors import SaveError, TrainingInterrupted

EXIT_OK = 0
EXIT_INTERNAL_ERROR = 1
EXIT_INPUT_ERROR = 2
EXIT_CONFIG_ERROR = EXIT_INPUT_ERROR  # the older name


def str2bool(v) -> bool:
    """argparse type for PaddleNLP-style boolean flags: ``--flag true`` / ``--flag 0`` / ``--flag yes``."""
    import argparse

    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "t", "yes", "y", "on"):
        return True
    if s in ("0", "false", "f", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


def split_argv(argv: List[str]) -> Tuple[Optional[str], List[str]]:
    """``["cfg.json", "--lora", "true"]`` -> ``("cfg.json", ["--lora", "true"])``."""
    if argv and not argv[0].startswith("--"):
        return argv[0], argv[1:]
    return None, argv


def config_or_exit(argv: List[str], usage: str, mode: str = "sft") -> RunConfig:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        doc = MODES[mode].doc  # the mode's own keys (config/modes.py)
        print("Every key is documented in docs/config.md" + (f" and {doc}." if doc != "docs/config.md" else "."))
        sys.exit(0 if argv else EXIT_CONFIG_ERROR)
    path, overrides = split_argv(argv)
    try:
        return load_config(path, overrides, mode=mode)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)


def pop_tool_args(argv: List[str], spec: dict) -> Tuple[dict, List[str]]:
    """Take a tool's own ``--name value`` options out of argv (the rest are config overrides).

    ``pop_tool_args(["c.json", "--tolerance", "1e-4", "--lora", "true"], {"tolerance": float})``
    -> ``({"tolerance": 1e-4}, ["c.json", "--lora", "true"])``.
    """
    found, rest, i = {}, [], 0
    while i < len(argv):
        name = argv[i][2:].split("=", 1)[0] if argv[i].startswith("--") else None
        if name in spec:
            if "=" in argv[i]:
                raw, i = argv[i].split("=", 1)[1], i + 1
            elif i + 1 < len(argv):
                raw, i = argv[i + 1], i + 2
            else:
                print(f"--{name} needs a value", file=sys.stderr)
                sys.exit(EXIT_CONFIG_ERROR)
            try:
                found[name] = spec[name](raw)
            except ValueError:
                print(f"--{name}: invalid value {raw!r}", file=sys.stderr)
                sys.exit(EXIT_CONFIG_ERROR)
        else:
            rest.append(argv[i])
            i += 1
    return found, rest


def run_or_exit_code(run, *args) -> int:
    """``run(*args)`` -> the script's exit code, with a message instead of a traceback for the
    expected failures.  A run that returns an int (a tool's own verdict, e.g. check_packing's
    0/1) passes it through; anything else that returns is success.

    ConfigError / DataError -> 2; SaveError -> 1; TrainingInterrupted -> 128 + signal.
    Other exceptions are bugs: they propagate with their traceback (Python exits 1).
    """
    try:
        result = run(*args)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        return EXIT_INPUT_ERROR
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except SaveError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INTERNAL_ERROR
    except TrainingInterrupted as e:
        print(f"[paddlenlp_ext] {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return result if isinstance(result, int) and not isinstance(result, bool) else EXIT_OK


def run_config_script(argv: List[str], usage: str, mode: str, runner: str) -> int:
    """The whole ``main`` of a config-driven training script (run_finetune, run_dpo, run_kto, run_grpo, run_reward).

    The config is loaded and validated first (exit 2 on any problem, before paddle loads);
    only then is ``runner`` (the mode's recipe: a module with ``run(cfg)``, e.g. ``"paddlenlp_ext.dpo.run"``,
    as ``config.modes.MODES[mode].recipe`` records it: tests/test_modes.py) imported, so a config error never pays for the heavy
    imports.  -> the exit code.
    """
    import importlib

    cfg = config_or_exit(argv, usage, mode=mode)
    code = run_or_exit_code(importlib.import_module(runner).run, cfg)
    if launched_processes() > 1:
        exit_without_teardown(code)
    return code


def launched_processes() -> int:
    """How many processes ``paddle.distributed.launch`` started for this job (1 when not launched)."""
    import os

    try:
        return int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    except ValueError:
        return 1


def exit_without_teardown(code: int) -> None:
    """End a launched worker at once with ``code``, after flushing its output.

    Every file of the run is written and closed by now, and the ranks met at a final barrier
    (``training.rank_counts.finish_together``).  What is skipped is the interpreter's teardown of
    paddle's C++ state (gloo process groups and their threads), which on CPU data parallel could
    abort a complete run at exit (SIGABRT, exit 250 from the launcher) now and then.
    """
    import logging
    import os

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to flush
            pass
    os._exit(code)
