"""SIGTERM / SIGINT during training: finish the step, save a checkpoint, stop with the resume command.

Installed by ``FinetuneTrainer.train`` (so fine-tuning and DPO both get it) for
the duration of training only; the previous handlers are restored afterwards.

* first signal: the handler only records it.  At the end of the current
  optimizer step :class:`InterruptCallback` asks the Trainer to save a
  checkpoint and stop; if a checkpoint is being written when the signal
  arrives, that one is used and no second one is written.  ``train`` then
  raises :class:`~paddlenlp_ext.training.errors.TrainingInterrupted` carrying
  the exact command that resumes (exit code 128 + signal).
* second signal: exit at once (``os._exit``).  A checkpoint being written then
  is left in its hidden staging directory; every complete one stays intact.

With several processes the request is agreed over all ranks at each step (a
1-element all-reduce), so every rank saves and stops at the same step.
"""

import contextlib
import os
import signal
import sys
import threading
from typing import Optional

from paddlenlp.trainer import TrainerCallback

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The first signal received (``signum``) and the step whose checkpoint answers it."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.saved_step: Optional[int] = None

    def __bool__(self):
        return self.signum is not None


def _handler(request: StopRequest):
    def handle(signum, frame):
        name = signal.Signals(signum).name
        if request.signum is not None:
            # os._exit: no cleanup that could hang; staged writes keep every complete checkpoint intact
            print(
                f"\n[paddlenlp_ext] second {name}: exiting now without saving (the complete checkpoints in "
                "output_dir are intact)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)
        request.signum = signum
        print(
            f"\n[paddlenlp_ext] {name} received: finishing the current step, saving a checkpoint, then stopping "
            f"(send {name} again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    return handle


@contextlib.contextmanager
def stop_on_signals(request: StopRequest, signals=HANDLED):
    """Route ``signals`` to ``request`` inside the block; the previous handlers come back after it.

    Python only delivers signals to the main thread: elsewhere (a trainer run in a worker thread)
    nothing is installed and the process keeps its handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.getsignal(s) for s in signals}
    handle = _handler(request)
    try:
        for s in signals:
            signal.signal(s, handle)
        yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def agreed(flag: bool) -> bool:
    """``flag`` of any rank (max over data-parallel ranks; unchanged in a single process)."""
    import paddle

    if paddle.distributed.get_world_size() <= 1:
        return flag
    t = paddle.to_tensor([int(flag)], dtype="int32")
    paddle.distributed.all_reduce(t, op=paddle.distributed.ReduceOp.MAX)
    return bool(int(t.numpy()[0]))


class InterruptCallback(TrainerCallback):
    """Turns a :class:`StopRequest` into a checkpoint at the current step and a stop."""

    def __init__(self, request: StopRequest):
        self.request = request

    def _agreed(self) -> bool:
        if agreed(bool(self.request)) and self.request.signum is None:
            self.request.signum = signal.SIGTERM  # another rank was signalled: stop together
        return bool(self.request)

    def on_step_end(self, args, state, control, **kwargs):
        if self._agreed():
            control.should_save = True  # written right after this step's log/eval
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        # a save of this step, forced above or already due (the signal came while it was written)
        if self._agreed():
            self.request.saved_step = state.global_step
            control.should_training_stop = True
        return control
