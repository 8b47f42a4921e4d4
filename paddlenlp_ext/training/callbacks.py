"""Trainer callbacks."""

import time

from paddlenlp.trainer import TrainerCallback


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


def current_rss_bytes() -> int:
    """Resident set size of this process now (not the peak)."""
    import psutil

    return int(psutil.Process().memory_info().rss)
