"""One global order of training batches and one loss normalization, whatever the layout.

Owns the order in which a map-style training set is consumed and the label-token
count every micro-batch's loss is normalized by, so that a run gives the same
per-step losses and weights with 1 process or N data-parallel / sharding ranks,
and with batch 4 or batch 2 x 2 accumulation steps.

PaddleNLP's Trainer shuffles with ``paddle.io.BatchSampler`` on one process and
``DistributedBatchSampler`` (another order) on several, and each rank's loss is
the mean over its own micro-batch's tokens, so the gradient is a mean of means.
Here instead:

* **Order.** Epoch ``e``'s permutation of the ``n`` examples is
  ``RandomState(seed + e).permutation(n)``; it is cut into global batches of
  ``G = per_device x accumulation x data ranks`` examples (the last one padded
  from the start of the permutation, as PaddleNLP's sampler pads, unless
  ``drop_last``).  Global batch ``g`` is the same set for every layout with the
  same ``G``; micro-step ``a`` of rank ``r`` takes its slice
  ``(a * ranks + r) * per_device`` of it.
* **Normalization.** Every index the sampler yields carries ``N``, the label
  tokens of its whole global batch (counted once from the dataset, no
  communication).  The trainer scales the micro-batch's summed token loss by
  ``ranks x accumulation / N``: after PaddleNLP divides by the accumulation steps
  and data parallel averages over ranks, the gradient is (sum over every label
  token of the global batch) / N -- the single-process value.

This module never touches a model; the sampler is a ``paddle.io`` class only so
that PaddleNLP's Trainer calls its ``set_epoch``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import numpy as np
import paddle

IGNORE_INDEX = -100
GLOBAL_TOKENS_KEY = "global_label_tokens"


def global_batches(n: int, global_batch: int, seed: int, epoch: int, drop_last: bool) -> List[List[int]]:
    """Epoch ``epoch``'s global batches of example indices.

    >>> global_batches(5, 2, seed=0, epoch=0, drop_last=False)
    [[2, 0], [1, 3], [4, 2]]
    >>> global_batches(5, 2, seed=0, epoch=0, drop_last=True)
    [[2, 0], [1, 3]]
    """
    if n <= 0 or global_batch <= 0:
        raise ValueError(f"need examples and a positive global batch (n={n}, global batch={global_batch})")
    order = np.random.RandomState(seed + epoch).permutation(n).tolist()
    count = n // global_batch if drop_last else -(-n // global_batch)
    if count == 0:
        raise ValueError(
            f"{n} training examples do not fill one global batch of {global_batch} with "
            "dataloader_drop_last=true; lower the batch size or set dataloader_drop_last=false"
        )
    padded = order + order[: count * global_batch - n] if count * global_batch > n else order
    while len(padded) < count * global_batch:  # fewer examples than one global batch: wrap again
        padded += order[: count * global_batch - len(padded)]
    return [padded[g * global_batch : (g + 1) * global_batch] for g in range(count)]


def rank_micro_batches(
    batch: Sequence[int], per_device: int, accumulation: int, ranks: int, rank: int
) -> List[List[int]]:
    """This rank's micro-batches (in accumulation order) of one global batch.

    >>> rank_micro_batches([10, 11, 12, 13, 14, 15, 16, 17], per_device=2, accumulation=2, ranks=2, rank=1)
    [[12, 13], [16, 17]]
    """
    if len(batch) != per_device * accumulation * ranks:
        raise ValueError(f"global batch of {len(batch)} != {per_device} x {accumulation} x {ranks}")
    out = []
    for a in range(accumulation):
        start = (a * ranks + rank) * per_device
        out.append(list(batch[start : start + per_device]))
    return out


def label_token_counts(dataset) -> np.ndarray:
    """Supervised tokens (labels != -100) of every item, read once.

    >>> label_token_counts([{"labels": [-100, 5, 6]}, {"labels": [7, -100]}]).tolist()
    [2, 1]
    """
    counts = np.zeros(len(dataset), dtype=np.int64)
    for i in range(len(dataset)):
        counts[i] = int((np.asarray(dataset[i]["labels"]) != IGNORE_INDEX).sum())
    return counts


class TaggedIndex(int):
    """An example index that also carries its global batch's count ``N`` (an int, or a tuple of k counts)."""

    def __new__(cls, index: int, global_label_tokens=None):
        obj = super().__new__(cls, index)
        obj.global_label_tokens = global_label_tokens
        return obj

    def __reduce__(self):
        # DataLoader workers (dataloader_num_workers > 0) receive indices pickled
        return TaggedIndex, (int(self), self.global_label_tokens)


class GlobalTokensView:
    """The training set, with ``N`` of the global batch added to every item read through a TaggedIndex.

    Other attributes (``set_epoch``, ``report``, ...) are the wrapped dataset's.
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx) -> Dict:
        item = dict(self.dataset[int(idx)])
        if isinstance(idx, TaggedIndex):
            item[GLOBAL_TOKENS_KEY] = idx.global_label_tokens
        return item

    def __getattr__(self, name):
        return getattr(self.dataset, name)


class GlobalBatchSampler(paddle.io.DistributedBatchSampler):
    """Yields this rank's micro-batches in the global order, each index tagged with its global batch's N.

    ``len()`` is the number of micro-batches of one epoch on this rank
    (global batches x accumulation), as the Trainer expects from a batch sampler.
    """

    def __init__(
        self,
        dataset,
        per_device: int,
        accumulation: int,
        ranks: int,
        rank: int,
        seed: int,
        drop_last: bool,
        counts: Callable[[], np.ndarray] = None,
    ):
        super().__init__(
            dataset, batch_size=per_device, num_replicas=ranks, rank=rank, shuffle=False, drop_last=drop_last
        )
        self.per_device, self.accumulation, self.ranks, self.rank = per_device, accumulation, ranks, rank
        self.seed, self.drop_last = seed, drop_last
        self.global_batch = per_device * accumulation * ranks
        self.n = len(dataset)
        self._counts = counts or (lambda: label_token_counts(dataset))
        self.epoch = 0

    def set_epoch(self, epoch: int = 0, consumed_samples: int = 0) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        count = self.n // self.global_batch if self.drop_last else -(-self.n // self.global_batch)
        return count * self.accumulation

    def __iter__(self):
        # counted again every epoch: a packed dataset reorders its packs in its own set_epoch (called by
        # EpochCallback at epoch start, before the Trainer starts iterating), which moves the counts
        counts = self._counts()
        for batch in global_batches(self.n, self.global_batch, self.seed, self.epoch, self.drop_last):
            # [n] counts give one N per global batch; [n, k] counts (e.g. DPO's pairs and chosen tokens) give k
            summed = np.asarray(counts)[batch].sum(axis=0)
            total = int(summed) if np.ndim(summed) == 0 else tuple(int(x) for x in summed)
            for micro in rank_micro_batches(batch, self.per_device, self.accumulation, self.ranks, self.rank):
                yield [TaggedIndex(i, total) for i in micro]


class GlobalTokensCollator:
    """Wraps a collator: takes ``N`` out of the items and puts it in the batch as an int64 array (0-d, or [k]).

    >>> inner = lambda items: {"n_items": len(items)}
    >>> GlobalTokensCollator(inner)([{"a": 1, GLOBAL_TOKENS_KEY: 9}, {"a": 2, GLOBAL_TOKENS_KEY: 9}])
    {'n_items': 2, 'global_label_tokens': array(9)}
    """

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, items):
        values = {item.get(GLOBAL_TOKENS_KEY) for item in items}
        plain = [{k: v for k, v in item.items() if k != GLOBAL_TOKENS_KEY} for item in items]
        batch = self.collator(plain)
        if values != {None}:
            if len(values) != 1:
                raise ValueError(f"one micro-batch mixes global batches (label-token counts {sorted(values)})")
            batch[GLOBAL_TOKENS_KEY] = np.asarray(values.pop(), dtype=np.int64)
        return batch
