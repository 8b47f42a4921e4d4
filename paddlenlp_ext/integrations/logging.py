"""PaddleNLP's logger and its console/VisualDL callbacks, routed for a run (docs/logging.md).

PaddleNLP logs through one ``paddlenlp.utils.log.logger``: a ``Logger`` object
whose ``.logger`` is the stdlib logger "PaddleNLP" (level DEBUG) and whose
``.handler`` is the coloured stderr handler every record goes to.  During a
run, :func:`route_paddlenlp_logger` adds our train.log handler to that logger
(every record, DEBUG included) and puts a level and a :class:`ConsoleFilter`
on its console handler; both are removed on exit.

The Trainer adds ``ProgressCallback`` (a tqdm bar, log dicts at INFO) or, with
``disable_tqdm``, ``PrinterCallback`` (log dicts at INFO).  :func:`replace_console_callbacks`
keeps ``PrinterCallback`` only (the dicts go on to train.log) and adds ours.

``VisualDLCallback`` opens its writer in ``on_train_begin`` and closes it in
``on_train_end``: an evaluation before or after training is not recorded.
:class:`RunVisualDL` is given its writer up front and keeps it open until the
run closes it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional, Tuple

from paddlenlp.trainer.integrations import VisualDLCallback
from paddlenlp.trainer.trainer_callback import PrinterCallback, ProgressCallback
from paddlenlp.utils.log import logger as paddlenlp_logger

from .versions import check_versions

check_versions()

#: (object path, attribute, parameter names or None) this module relies on (tests/test_integrations.py).
RELIED_ON = [
    ("paddlenlp.utils.log.logger", "logger", None),
    ("paddlenlp.utils.log.logger", "handler", None),
    ("paddlenlp.trainer.trainer_callback", "ProgressCallback", None),
    ("paddlenlp.trainer.trainer_callback", "PrinterCallback", None),
    ("paddlenlp.trainer.integrations", "VisualDLCallback", ("vdl_writer",)),
    ("paddlenlp.trainer.integrations.VisualDLCallback", "on_train_end", ("self", "args", "state", "control", "kwargs")),
    ("paddlenlp.trainer.Trainer", "pop_callback", ("self", "callback")),
    ("paddlenlp.trainer.Trainer", "add_callback", ("self", "callback")),
]

#: PaddleNLP warnings that are false for our runs: shown only at log_level info/debug (always in train.log).
#: TrainingArguments warns it turned evaluation_strategy "no" into "steps" when do_eval is set;
#: training.training_args.make_training_arguments (integrations.training_args) puts "no" back (evaluate once, after training).
SUPERSEDED_WARNINGS: Tuple[str, ...] = ("evaluation_strategy reset to IntervalStrategy.STEPS for do_eval is True",)


class ConsoleFilter(logging.Filter):
    """What of PaddleNLP's logger reaches the console.

    Records at ``level`` and above, each distinct warning once (repeats are in
    train.log only); the warnings of :data:`SUPERSEDED_WARNINGS` only when
    ``level`` is INFO or lower.  Notices we want shown whatever the level (the
    best-model reload) are our own console lines, not PaddleNLP records.
    """

    def __init__(self, level: int):
        super().__init__()
        self.level = level
        self.seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno < self.level:
            return False
        if self.level > logging.INFO and message.startswith(SUPERSEDED_WARNINGS):
            return False
        if record.levelno < logging.ERROR and self.level > logging.INFO:
            key = (record.levelno, message)
            if key in self.seen:
                return False
            self.seen.add(key)
        return True


#: the filter :func:`quiet_paddlenlp_console` put on PaddleNLP's console handler (a run swaps it for its own)
_POLICY_FILTER: list = []


def quiet_paddlenlp_console(level: int = logging.WARNING) -> None:
    """PaddleNLP's console handler shows what :class:`ConsoleFilter` passes at ``level`` (its INFO
    chatter -- "Loading configuration file", "Model weights saved in", ... -- is no news to a user
    of a tool; a training run routes it to train.log: :func:`route_paddlenlp_logger`)."""
    console = paddlenlp_logger.handler
    for old in _POLICY_FILTER:
        console.removeFilter(old)
    _POLICY_FILTER[:] = [ConsoleFilter(level)]
    console.addFilter(_POLICY_FILTER[0])
    console.setLevel(level)


@contextlib.contextmanager
def route_paddlenlp_logger(file_handler: logging.Handler, console_level: int):
    """Every PaddleNLP record to ``file_handler``; the console handler filtered by :class:`ConsoleFilter`."""
    std, console = paddlenlp_logger.logger, paddlenlp_logger.handler
    old_level, old_console_level = std.level, console.level
    console_filter = ConsoleFilter(console_level)
    policy = list(_POLICY_FILTER)  # the run's filter and level decide while it lasts
    for f in policy:
        console.removeFilter(f)
    std.setLevel(logging.DEBUG)  # train.log gets the DEBUG argument dump whatever the console shows
    std.addHandler(file_handler)
    console.setLevel(console_level)
    console.addFilter(console_filter)
    try:
        yield console_filter
    finally:
        console.removeFilter(console_filter)
        for f in policy:
            console.addFilter(f)
        console.setLevel(old_console_level)
        std.removeHandler(file_handler)
        std.setLevel(old_level)


class RunVisualDL(VisualDLCallback):
    """PaddleNLP's VisualDL callback with its writer open for the whole run (:meth:`close` ends it)."""

    def on_train_end(self, args, state, control, **kwargs):
        if self.vdl_writer is not None:
            self.vdl_writer.flush()  # the final evaluation is logged after training: keep the writer

    def close(self) -> None:
        if self.vdl_writer is not None:
            self.vdl_writer.close()
            self.vdl_writer = None


def replace_console_callbacks(trainer, progress) -> Optional[Callable[[], None]]:
    """PaddleNLP's tqdm bar out, ``PrinterCallback`` (log dicts to train.log) and ``progress`` in;
    a ``VisualDLCallback`` becomes a :class:`RunVisualDL`.  Returns its ``close`` (None without VisualDL)."""
    trainer.pop_callback(ProgressCallback)
    trainer.pop_callback(PrinterCallback)  # exactly one, whichever of the two PaddleNLP added
    trainer.add_callback(PrinterCallback)
    trainer.add_callback(progress)
    if trainer.pop_callback(VisualDLCallback) is None:
        return None
    writer = None
    if trainer.args.process_index == 0:  # VisualDLCallback writes on the world's first process only
        from visualdl import LogWriter

        writer = LogWriter(logdir=trainer.args.logging_dir)
    visualdl = RunVisualDL(vdl_writer=writer)
    trainer.add_callback(visualdl)
    return visualdl.close
