"""Trainer callbacks: epoch reshuffle, lazy-stream cursor, step timing, heap trim, console progress, loss curve."""

import os
import time
from typing import Callable, Dict, Optional

from paddlenlp.trainer import TrainerCallback

from .console import eta_seconds, format_float, progress_bar, progress_line
from .plot import LOSS_PLOT_NAME, write_loss_plot


class EpochCallback(TrainerCallback):
    """Tell a packed dataset which epoch starts, so it reshuffles its packs with the seed."""

    def __init__(self, dataset):
        self.dataset = dataset

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.dataset.set_epoch(int(state.epoch or 0))


class StreamCursorSaver:
    """Store the lazy stream's position in every checkpoint (``data_state.json``).

    Registered in ``FinetuneTrainer.checkpoint_extras``, so the file is written
    before the checkpoint is marked complete.  Rows consumed since the stream
    started = (global_step - resume_step) x per-device batch x gradient
    accumulation x data-parallel ranks (the Trainer shards one global stream
    across ranks).
    """

    def __init__(self, dataset, rows_per_step: int, resume_step: int = 0):
        self.dataset = dataset
        self.rows_per_step = rows_per_step
        self.resume_step = resume_step

    def __call__(self, checkpoint_dir: str, state) -> None:
        from ..data.streaming import save_cursor

        rows = (state.global_step - self.resume_step) * self.rows_per_step
        save_cursor(self.dataset.position_after(rows), checkpoint_dir)


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step and the process's memory along the run.

    Goes to run_summary.json (``step_times_s``, ``rss_*_bytes``), so benchmarks
    measure the real CLI: load cost, per-step cost and the step overhead on top
    of the loaded model are separable.
    """

    def __init__(self):
        self.step_times = []
        self.rss_after_first_step = None
        self._t0 = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._t0 is not None:
            self.step_times.append(round(time.perf_counter() - self._t0, 4))
        if self.rss_after_first_step is None:
            self.rss_after_first_step = current_rss_bytes()


class HeapTrim(TrainerCallback):
    """Hand the heap's free pages back to the OS after every micro-step and optimizer step
    (``heap.release_free_memory``): within a step freed tensors are reused, between steps they are
    not kept (training/heap.py has the measurements)."""

    def on_substep_end(self, args, state, control, **kwargs):
        from .heap import release_free_memory

        release_free_memory()

    on_step_end = on_substep_end


def attach_step_callbacks(trainer) -> StepTimer:
    """What every training run (fine-tuning, DPO/KTO, GRPO) adds to its Trainer for the steps
    themselves: the step timer (returned: its times go to run_summary.json) and the heap trim."""
    step_timer = StepTimer()
    trainer.add_callback(step_timer)
    trainer.add_callback(HeapTrim())  # freed heap pages back to the OS after every micro-step (training/heap.py)
    return step_timer


def current_rss_bytes() -> int:
    """Resident set size of this process now (not the peak)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


class ConsoleProgress(TrainerCallback):
    """One console line per logging step (and per evaluation during training); on a terminal a live bar.

    ``tokens()`` returns the tokens this process has trained so far; tokens/s is its
    growth over the logging interval times ``data_parallel`` (the ranks share the
    work evenly; run_summary.json has the exact sum over ranks).  ETA: the
    remaining steps at the average pace of the steps done in this process.
    """

    #: log keys every run shows after the learning rate when present (MoE rows); the trainer adds its own
    EXTRA_KEYS = {
        "aux_loss": "aux loss",
        "expert_load_max_over_mean": "expert load max/mean",
    }

    def __init__(
        self,
        console,
        tokens: Callable[[], int],
        data_parallel: int = 1,
        metrics: Optional[Dict[str, str]] = None,
        accuracy_metric: Optional[str] = "accuracy",
    ):
        """``metrics``: the trainer's own log keys -> console labels (``progress_metrics()``, e.g. DPO's
        ``{"rewards/accuracies": "reward acc"}``), shown before EXTRA_KEYS; ``accuracy_metric``: the eval
        metric (without "eval_") the eval line shows as the accuracy (``accuracy_metric()``), or None."""
        self.console = console
        self.tokens = tokens
        self.data_parallel = max(int(data_parallel), 1)
        self.extra_keys = {**(metrics or {}), **self.EXTRA_KEYS}
        self.accuracy_metric = accuracy_metric
        self.training = False
        self._start = self._last_time = 0.0
        self._start_step = self._last_tokens = 0
        self._last_loss: Optional[float] = None

    def _pace(self, state):
        elapsed = time.time() - self._start
        return elapsed, eta_seconds(elapsed, state.global_step - self._start_step, state.max_steps - state.global_step)

    def on_train_begin(self, args, state, control, **kwargs):
        self.training = True
        self._start = self._last_time = time.time()
        self._start_step = state.global_step  # > 0 when resuming
        self._last_tokens = self.tokens()

    def on_step_end(self, args, state, control, **kwargs):
        # the last step always logs (its loss averages the steps since the last logging step), so a run
        # shorter than logging_steps still prints a progress line and puts a point in loss.png
        if (
            state.global_step >= state.max_steps
            and str(getattr(args.logging_strategy, "value", args.logging_strategy)) == "steps"
        ):
            control.should_log = True
        self._draw_bar(state)

    def _draw_bar(self, state):
        if self.console.bar and state.is_world_process_zero:
            elapsed, eta = self._pace(state)
            self.console.show_bar(
                progress_bar(
                    state.global_step,
                    state.max_steps,
                    elapsed,
                    eta,
                    self._last_loss,
                    self.console.columns(),
                    self.console.ascii_only,
                )
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (self.training and state.is_world_process_zero and logs):
            return
        elapsed, eta = self._pace(state)
        if "loss" in logs:
            now, tokens = time.time(), self.tokens()
            rate = (tokens - self._last_tokens) * self.data_parallel / max(now - self._last_time, 1e-9)
            self._last_time, self._last_tokens, self._last_loss = now, tokens, logs["loss"]
            extra = {name: logs[k] for k, name in self.extra_keys.items() if k in logs}
            self.console.line(
                progress_line(
                    state.global_step,
                    state.max_steps,
                    logs["loss"],
                    logs.get("learning_rate"),
                    rate,
                    elapsed,
                    eta,
                    extra,
                )
            )
            self._draw_bar(state)  # on_step_end drew the bar before this step's loss was logged
        elif "eval_loss" in logs:
            accuracy = logs.get(f"eval_{self.accuracy_metric}") if self.accuracy_metric else None
            acc = f"  accuracy {format_float(accuracy)}" if accuracy is not None else ""
            self.console.line(f"eval at step {state.global_step}: loss {format_float(logs['eval_loss'])}{acc}")

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False
        self.console.clear_bar()


class LossCurve(TrainerCallback):
    """Collects the logged train / eval losses and draws ``output_dir/loss.png`` (``training.plot``)
    at every checkpoint save, at the end of training and when the run calls :meth:`write`.

    On resume the checkpoint's ``log_history`` seeds the curve, so it covers the whole run.
    """

    def __init__(self, path: str, title: Optional[str] = None, enabled: bool = True):
        self.path = path
        self.title = title
        self.enabled = enabled  # the process that saves (output_dir is shared by all ranks)
        self.train: Dict[int, float] = {}
        self.evals: Dict[int, float] = {}

    def add(self, logs: dict, step: int) -> None:
        if "loss" in logs:
            self.train[int(step)] = float(logs["loss"])
        if "eval_loss" in logs:
            self.evals[int(step)] = float(logs["eval_loss"])

    def on_train_begin(self, args, state, control, **kwargs):
        for entry in state.log_history or []:
            if "step" in entry:
                self.add(entry, entry["step"])

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.add(logs or {}, state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self.write()

    def on_train_end(self, args, state, control, **kwargs):
        self.write()

    def write(self) -> Optional[str]:
        if not self.enabled:
            return None
        return write_loss_plot(self.path, self.train, self.evals, self.title)


def loss_plot_path(output_dir: str) -> str:
    return os.path.join(output_dir, LOSS_PLOT_NAME)
