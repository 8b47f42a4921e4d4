"""Trainer callbacks."""

from paddlenlp.trainer import TrainerCallback


class EpochCallback(TrainerCallback):
    """Tell a packed dataset which epoch starts, so it reshuffles its packs with the seed."""

    def __init__(self, dataset):
        self.dataset = dataset

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.dataset.set_epoch(int(state.epoch or 0))
