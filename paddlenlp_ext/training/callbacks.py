"""Trainer callbacks."""

from paddlenlp.trainer import TrainerCallback


class EpochCallback(TrainerCallback):
    """Tell a packed dataset which epoch starts, so it reshuffles its packs with the seed."""

    def __init__(self, dataset):
        self.dataset = dataset

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.dataset.set_epoch(int(state.epoch or 0))


class StreamCursorCallback(TrainerCallback):
    """Store the lazy stream's position in every checkpoint (``data_state.json``).

    Rows consumed since the stream started = (global_step - resume_step) x
    per-device batch x gradient accumulation x data-parallel ranks (the
    Trainer shards one global stream across ranks).
    """

    def __init__(self, dataset, rows_per_step: int, resume_step: int = 0):
        self.dataset = dataset
        self.rows_per_step = rows_per_step
        self.resume_step = resume_step

    def on_save(self, args, state, control, **kwargs):
        import os

        from ..data.streaming import save_cursor

        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if args.should_save and os.path.isdir(ckpt):
            rows = (state.global_step - self.resume_step) * self.rows_per_step
            save_cursor(self.dataset.position_after(rows), ckpt)
