"""Sequence packing ("zero padding"): the map-style dataset of packed rows.

Owns :class:`PackedDataset`, which packs a list of tokenized examples once
and builds each row on demand. The pieces it composes are pure numpy
transforms in two modules (this one never imports paddle either):

* :mod:`.binpack` decides which examples share a row. ``zero_padding``:
  :func:`~.binpack.pack_in_order` fills rows in data order and starts a new
  row when the next example does not fit. ``greedy_zero_padding``:
  :func:`~.binpack.greedy_pack` runs best-fit-decreasing on each consecutive
  window of ``group_size`` examples; order is only shuffled inside a window,
  and rows come out nearly full.
* :mod:`.packed_row` turns one pack into a row of length ``max_length``
  (tokens, labels, position ids restarting per example, and the FlashMask
  start rows that keep the examples from attending to each other), and
  stacks rows into a batch.

Tokenized example format (shared by the whole project)::

    {"input_ids": list[int], "labels": list[int]}   # equal length n, 1 <= n <= max_length

``labels`` are ALREADY shifted: ``labels[i]`` is the target for position
``i``, and ``-100`` means the position is not supervised. Examples longer
than ``max_length`` (or empty) raise ``ValueError`` with the index of the
example. Nothing is dropped silently.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import numpy as np

from .binpack import DEFAULT_GROUP_SIZE, check_capacity, greedy_pack, pack_in_order, shuffle_packs, validate_lengths
from .packed_row import IGNORE_INDEX, build_packed_row, example_length

__all__ = ["PackedDataset"]


class PackedDataset:
    """Map-style dataset of packed rows, built from a list of tokenized examples.

    The packs (lists of example indices) are computed eagerly at construction
    time. Rows are built lazily in ``__getitem__`` with
    :func:`.packed_row.build_packed_row`, which is cheap, so memory stays O(examples). The
    examples are referenced, not copied. It is a plain Python object with
    ``__len__`` and ``__getitem__``, so ``paddle.io.DataLoader`` accepts it
    (use ``collate_fn=packed_row.collate_packed``).

    Args:
        examples: list of ``{"input_ids", "labels"}`` (labels already shifted).
        max_length: row length. An example longer than this raises
            ValueError, naming its index.
        pad_token_id: padding token.
        greedy: True selects ``greedy_zero_padding`` (:func:`.binpack.greedy_pack`).
            False selects ``zero_padding`` (:func:`.binpack.pack_in_order`).
        group_size: greedy window (ignored when ``greedy=False``).
        seed: seed for the per-epoch pack-order shuffle.
        shuffle: when False, packs keep their packing order in every epoch.

    The same ``(examples, max_length, greedy, group_size)`` always gives the
    same packs. The same ``(seed, epoch)`` always gives the same order. The
    dataset starts at epoch 0. Call :meth:`set_epoch` at the start of each
    epoch.

    Example:
        >>> ex = [{"input_ids": [1] * n, "labels": [1] * n} for n in (6, 5, 2, 3)]
        >>> ds = PackedDataset(ex, max_length=8, pad_token_id=0, greedy=True, shuffle=False)
        >>> len(ds), ds.packs
        (2, [[0, 2], [1, 3]])
        >>> ds.stats()["padding_ratio"]
        0.0
    """

    def __init__(
        self,
        examples: Sequence[Mapping],
        max_length: int,
        pad_token_id: int,
        greedy: bool = True,
        group_size: int = DEFAULT_GROUP_SIZE,
        seed: int = 0,
        shuffle: bool = True,
    ):
        self.examples = examples
        self.max_length = check_capacity(max_length)
        self.pad_token_id = int(pad_token_id)
        self.greedy = bool(greedy)
        self.group_size = int(group_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        lengths = np.fromiter(
            (example_length(ex, i) for i, ex in enumerate(examples)), dtype=np.int64, count=len(examples)
        )
        self.lengths = validate_lengths(lengths, self.max_length)  # raises on over-long / empty, naming the index
        if self.greedy:
            self._base_packs = greedy_pack(self.lengths, self.max_length, self.group_size)
        else:
            self._base_packs = pack_in_order(self.lengths, self.max_length)
        self._supervised = int(sum(int(np.count_nonzero(np.asarray(ex["labels"]) != IGNORE_INDEX)) for ex in examples))
        self.epoch = 0
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Reorder the packs for ``epoch``. Deterministic for a given seed; the pack contents never change."""
        self.epoch = int(epoch)
        if self.shuffle:
            self._packs = shuffle_packs(self._base_packs, self.seed, self.epoch)
        else:
            self._packs = [list(p) for p in self._base_packs]

    @property
    def packs(self) -> List[List[int]]:
        """Packs (example indices) in the current epoch's order."""
        return self._packs

    def __len__(self) -> int:
        return len(self._packs)

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        pack = self._packs[idx]
        return build_packed_row([self.examples[i] for i in pack], self.max_length, self.pad_token_id)

    def stats(self) -> Dict[str, float]:
        """Summary numbers.

        * ``examples``: number of examples.
        * ``packs``: number of rows.
        * ``tokens``: real (non-padding) tokens.
        * ``padding_ratio``: ``1 - tokens / (packs * max_length)``.
        * ``supervised_tokens``: labels != -100.
        * ``supervised_fraction``: ``supervised_tokens / tokens``, as a
          fraction of real tokens, not of slots.
        """
        tokens = int(self.lengths.sum())
        n_packs = len(self._base_packs)
        slots = n_packs * self.max_length
        return {
            "examples": int(self.lengths.shape[0]),
            "packs": n_packs,
            "tokens": tokens,
            "padding_ratio": (1.0 - tokens / slots) if slots else 0.0,
            "supervised_tokens": self._supervised,
            "supervised_fraction": (self._supervised / tokens) if tokens else 0.0,
        }
