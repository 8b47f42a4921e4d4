"""``output_dir/train.log`` and what reaches the console during a run (docs/logging.md).

:func:`run_logging` wraps a whole run (fine-tuning and DPO):

* ``output_dir/train.log`` (appended, so a resumed run continues the file)
  receives every record of PaddleNLP's logger (its DEBUG argument dump, INFO
  chatter, warnings), every Python warning, our console lines and, if the run
  fails, the traceback.  Process ``k > 0`` of a multi-process run writes
  ``train.rank{k}.log``.
* The console shows PaddleNLP records at ``log_level`` (default ``warning``,
  each distinct warning once), other libraries' log records at that level
  (``import paddle`` installs a root handler at INFO) and Python warnings
  raised outside installed libraries; ``log_level info`` / ``debug`` shows
  everything as PaddleNLP does.
* The active :class:`~paddlenlp_ext.training.console.Console` prints the
  configuration line, progress and final table (``training.reporting``).

Everything is undone on exit (handlers, filters, ``warnings.showwarning``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import warnings
from typing import List

from ..runtime.console_policy import is_library_file  # noqa: F401 (tests import it from here)
from ..config.parse import ConfigError
from .console import FILE_LOGGER_NAME, Console, activate, deactivate

LOG_NAME = "train.log"
FILE_FORMAT = "[%(asctime)s] [%(levelname)8s] %(name)s - %(message)s"
#: ``log_level`` values -> stdlib levels (PaddleNLP's logger level names)
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
DEFAULT_LEVEL = "warning"


def log_file_name(rank: int) -> str:
    return LOG_NAME if rank == 0 else f"train.rank{rank}.log"


def process_rank() -> int:
    """This process's rank as set by ``paddle.distributed.launch`` (0 when run directly), read without paddle."""
    return int(os.environ.get("PADDLE_TRAINER_ID") or 0)


def console_level(cfg) -> int:
    """The console's level from the ``log_level`` key (``warning`` when unset)."""
    value = cfg.training.get("log_level") or DEFAULT_LEVEL
    if str(value).lower() not in LEVELS:
        raise ConfigError([f"{cfg.source or 'config'}: log_level {value!r}: expected one of {', '.join(LEVELS)}"])
    return LEVELS[str(value).lower()]


@contextlib.contextmanager
def warnings_to_log(file_logger: logging.Logger, show_library: bool):
    """Python warnings into train.log; on the console too unless raised in library code (``show_library`` False)."""
    # under runtime.console_policy's filter (it hides library warnings), show with the one it wraps
    original = getattr(warnings.showwarning, "__wrapped__", warnings.showwarning)
    previous = warnings.showwarning
    warnings_logger = file_logger.getChild("warnings")  # propagates to file_logger's train.log handler

    def showwarning(message, category, filename, lineno, file=None, line=None):
        warnings_logger.warning(warnings.formatwarning(message, category, filename, lineno, line).rstrip())
        if show_library or not is_library_file(filename):
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    try:
        yield
    finally:
        warnings.showwarning = previous


class BelowLevel(logging.Filter):
    """Lets records at ``level`` and above through (a handler filter: propagated records are checked too)."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


@contextlib.contextmanager
def route_root_logger(file_handler: logging.Handler, console_level: int):
    """Records that reach the root logger (libraries' own loggers: matplotlib, visualdl, paddle) go to
    train.log at INFO and above; its console handlers (``runtime.console_policy.install_root_handler``, or
    paddle's) keep ``console_level`` and above."""
    root = logging.getLogger()
    console_filter = BelowLevel(console_level)
    handlers = list(root.handlers)
    for h in handlers:
        h.addFilter(console_filter)
    old_level = root.level
    root.setLevel(min(old_level or logging.INFO, logging.INFO, console_level))  # the policy leaves it at WARNING
    root.addHandler(file_handler)
    try:
        yield
    finally:
        root.removeHandler(file_handler)
        root.setLevel(old_level)
        for h in handlers:
            h.removeFilter(console_filter)


def clear_earlier_run(cfg, rank: int) -> List[str]:
    """``overwrite_output_dir: true`` on a training run: remove the earlier run's checkpoints and results
    (``config.output_dir.earlier_run_entries``) before this run writes anything, on the main process;
    returns the names removed (the other processes return [])."""
    from ..config.output_dir import earlier_run_entries

    t = cfg.training
    if rank != 0 or not (t.get("do_train") and t.get("overwrite_output_dir")) or t.get("resume_from_checkpoint"):
        return []
    out = t.get("output_dir")
    names = earlier_run_entries(out)
    for name in names:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return names


@contextlib.contextmanager
def run_logging(cfg, stream=None):
    """train.log, the console level and the active Console for the block (yields the Console)."""
    output_dir = cfg.training.get("output_dir") or "."
    level = console_level(cfg)
    rank = process_rank()
    removed = clear_earlier_run(cfg, rank)
    os.makedirs(output_dir, exist_ok=True)
    handler = logging.FileHandler(os.path.join(output_dir, log_file_name(rank)), mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    file_logger = logging.getLogger(FILE_LOGGER_NAME)
    file_logger.setLevel(logging.DEBUG)
    file_logger.propagate = False  # console lines are printed by the Console, not by a root handler
    file_logger.addHandler(handler)
    console = Console(stream=stream, main=rank == 0, file_logger=file_logger)
    file_logger.info(f"===== run started: {' '.join(sys.argv)} (log_level {logging.getLevelName(level).lower()})")
    activate(console)
    if removed:
        checkpoints = [n for n in removed if n.startswith("checkpoint-")]
        rest = len(removed) - len(checkpoints)
        what = checkpoints + ([f"{rest} other file{'s' if rest > 1 else ''} of it"] if rest else [])
        console.line(
            f"overwrite_output_dir: removed the earlier run from {os.path.abspath(output_dir)}: "
            f"{', '.join(what)} (train.log lists them)"
        )
        logging.getLogger(FILE_LOGGER_NAME).info(f"overwrite_output_dir removed: {', '.join(removed)}")
    try:
        with warnings_to_log(file_logger, show_library=level <= logging.INFO):
            # imports paddlenlp (and paddle): after the warnings hook, so import-time warnings land in train.log,
            # and before the root logger is routed, so the handler paddle's basicConfig adds is there
            from ..integrations.logging import route_paddlenlp_logger

            with route_paddlenlp_logger(handler, level), route_root_logger(handler, level):
                try:
                    yield console
                finally:
                    console.close()
    except BaseException as e:
        file_logger.error(f"run stopped: {type(e).__name__}: {e}", exc_info=True)
        raise
    finally:
        deactivate(console)
        file_logger.removeHandler(handler)
        handler.close()
