"""Trainer callbacks."""

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
