"""Sequence packing ("zero padding") as pure data transforms.

This module never imports paddle (numpy only), so it is fast to import and
trivially testable. It turns a list of tokenized examples into fixed-length
rows that hold several examples back to back, plus the masks that keep the
examples from attending to each other.

Two strategies, matching the two config keys:

* ``zero_padding``: :func:`pack_in_order` fills rows in data order and starts
  a new row when the next example does not fit.
* ``greedy_zero_padding``: :func:`greedy_pack` runs best-fit-decreasing
  (:func:`best_fit_decreasing`) on each consecutive window of ``group_size``
  examples. Order is only shuffled inside a window, and rows come out nearly
  full.

Tokenized example format (shared by the whole project)::

    {"input_ids": list[int], "labels": list[int]}   # equal length n, 1 <= n <= max_length

``labels`` are ALREADY shifted: ``labels[i]`` is the target for position
``i``, and ``-100`` means the position is not supervised. Because the shift
happens inside each example, concatenation never makes a label cross an
example boundary. Examples longer than ``max_length`` (or empty) raise
``ValueError`` with the index of the example. Nothing is dropped silently.

Packed row format (:func:`build_packed_row`), each array of length ``L = max_length``:

* ``input_ids`` int64: the tokens of the examples, then ``pad_token_id``.
* ``labels`` int64: the labels of the examples, then ``-100``.
* ``position_ids`` int64: restart at 0 for each example. The padding tail is
  numbered as one more sequence ``0, 1, 2, ...``, so every id stays below
  ``L``. Padding positions are fully masked, so their values have no effect.
* ``attn_mask_startend_row_indices`` int32: the causal single-bound form (LTS)
  of ``paddle.nn.functional.flashmask_attention``. Query row ``i`` may attend
  to key column ``j`` iff ``j <= i < start[j]``. A column in an example that
  ends at row ``e`` (exclusive) gets ``start[j] = e``. A padding column gets
  ``start[j] = p``, where ``p`` is the first padding row. So no row, real or
  padding, ever sees a padding key, and padding query rows see nothing. That
  matches PaddleNLP's own right-padding convention for this tensor. See
  :func:`startend_to_dense_mask`.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "IGNORE_INDEX",
    "pack_in_order",
    "best_fit_decreasing",
    "greedy_pack",
    "shuffle_packs",
    "build_packed_row",
    "startend_to_dense_mask",
    "collate_packed",
    "padding_ratio",
    "batch_padding_ratio",
    "PackedDataset",
]

#: Default window for :func:`greedy_pack`. Windows of 2048 examples reach
#: <= 0.5% padding on alpaca-like lengths at max_length 1024 and 2048 (see
#: docs/packing.md). A bigger window changes little and costs data locality.
DEFAULT_GROUP_SIZE = 2048

#: Label value that marks a position as not supervised.
IGNORE_INDEX = -100


# --------------------------------------------------------------------------- #
# validation helpers
# --------------------------------------------------------------------------- #
def _check_capacity(capacity) -> int:
    if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 1:
        raise ValueError(f"capacity/max_length must be a positive integer, got {capacity!r}")
    return int(capacity)


def _as_lengths(lengths, capacity: int) -> np.ndarray:
    """Validate a 1-D sequence of lengths and return it as an int64 array.

    Raises ValueError and names the first bad index when a length is below 1
    or above ``capacity``.
    """
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError("lengths must be integers")
    arr = arr.astype(np.int64)
    too_long = np.flatnonzero(arr > capacity)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"example {i} has length {int(arr[i])} > max_length {capacity} "
            f"({too_long.size} over-long example(s) in total); truncate before packing"
        )
    empty = np.flatnonzero(arr < 1)
    if empty.size:
        i = int(empty[0])
        raise ValueError(f"example {i} has length {int(arr[i])}; every example needs at least 1 token")
    return arr


def _example_length(ex: Mapping, index) -> int:
    try:
        n = len(ex["input_ids"])
        m = len(ex["labels"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"example {index} must be a dict with 'input_ids' and 'labels' ({e})") from None
    if n != m:
        raise ValueError(f"example {index}: len(input_ids)={n} != len(labels)={m}")
    return n


# --------------------------------------------------------------------------- #
# packing algorithms (indices only)
# --------------------------------------------------------------------------- #
def pack_in_order(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Zero padding in data order: fill a row, then start a new one when the next example doesn't fit.

    Args:
        lengths: token count of each example, each in ``[1, capacity]``.
        capacity: row length (max_length).

    Returns:
        Packs, as lists of indices into ``lengths``, in data order.

    Raises:
        ValueError: an example is longer than ``capacity`` or empty. The
            message names its index.

    Example:
        >>> pack_in_order([5, 3, 4, 2], 8)
        [[0, 1], [2, 3]]
        >>> pack_in_order([6, 5, 2, 3], 8)      # 3 rows; BFD needs only 2
        [[0], [1, 2], [3]]
    """
    capacity = _check_capacity(capacity)
    arr = _as_lengths(lengths, capacity)
    packs: List[List[int]] = []
    cur: List[int] = []
    used = 0
    for i, n in enumerate(arr.tolist()):
        if used + n > capacity:
            packs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        packs.append(cur)
    return packs


def _bfd_window(lens: np.ndarray, capacity: int, offset: int) -> List[List[int]]:
    """Best-fit-decreasing on one window. Does not validate its input.

    Each open bin with room left is stored as one integer key,
    ``remaining * scale + bin_id``, in a sorted Python list. ``bisect_left``
    on ``length * scale`` then finds the bin with the least room that still
    fits (the "fullest" bin). Among bins with equal room it finds the oldest
    one, which makes tie-breaks deterministic. Each item costs one bisect
    plus one pop/insort on a short list: O(n log n) overall (the sort of the
    window dominates).
    """
    n = lens.shape[0]
    if n == 0:
        return []
    # stable sort by length descending; ties keep data order
    order = np.argsort(-lens, kind="stable")
    sorted_lens = lens[order].tolist()
    order_l = (order + offset).tolist()
    scale = n + 1  # more than the largest possible bin id
    keys: List[int] = []  # sorted keys of bins that still have room
    bins: List[List[int]] = []
    bl = bisect.bisect_left
    ins = bisect.insort
    for idx, ln in zip(order_l, sorted_lens):
        pos = bl(keys, ln * scale)
        if pos < len(keys):
            key = keys.pop(pos)
            rem, b = divmod(key, scale)
            bins[b].append(idx)
            rem -= ln
            if rem:
                ins(keys, rem * scale + b)
        else:
            b = len(bins)
            bins.append([idx])
            rem = capacity - ln
            if rem:
                ins(keys, rem * scale + b)
    for b in bins:
        b.sort()
    bins.sort(key=lambda p: p[0])
    return bins


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Best-fit-decreasing bin packing of ``lengths`` into rows of ``capacity``.

    Examples go in by length, longest first (ties in data order). Each one
    goes into the fullest open row it fits in (ties go to the oldest row). If
    none fits, a new row is opened. Runs in O(n log n) with bisect over a
    sorted list of remaining capacities. The result is deterministic: indices
    inside a pack are ascending, and packs are ordered by their smallest
    index.

    Args:
        lengths: token count of each example, each in ``[1, capacity]``.
        capacity: row length (max_length).

    Returns:
        Packs, as lists of indices into ``lengths``. Every index appears
        exactly once, and no pack's total length exceeds ``capacity``.

    Raises:
        ValueError: an example is longer than ``capacity`` or empty (its
            index is named).

    Example:
        >>> best_fit_decreasing([5, 3, 4, 2], 8)
        [[0, 1], [2, 3]]
        >>> best_fit_decreasing([6, 5, 2, 3], 8)   # in-order packing needs 3 rows
        [[0, 2], [1, 3]]
    """
    capacity = _check_capacity(capacity)
    arr = _as_lengths(lengths, capacity)
    return _bfd_window(arr, capacity, 0)


def greedy_pack(
    lengths: Sequence[int], capacity: int, group_size: int = DEFAULT_GROUP_SIZE
) -> List[List[int]]:
    """Greedy zero padding: best-fit-decreasing on each consecutive window of ``group_size`` examples.

    Packs never mix examples from different windows, so data order is kept
    at window scale (an example moves at most ``group_size`` places). Within
    a window, packs are ordered by their smallest index.

    Args:
        lengths: token count of each example, each in ``[1, capacity]``.
        capacity: row length (max_length).
        group_size: window size in examples (>= 1). Default
            :data:`DEFAULT_GROUP_SIZE` (2048).

    Returns:
        Packs, as lists of indices into the ORIGINAL ``lengths``.

    Raises:
        ValueError: an example is longer than ``capacity`` or empty (its
            index is named), or ``group_size < 1``.

    Example:
        >>> greedy_pack([6, 5, 2, 3], 8)                  # one window = BFD
        [[0, 2], [1, 3]]
        >>> greedy_pack([6, 5, 2, 3], 8, group_size=2)   # windows [6,5] and [2,3]
        [[0], [1], [2, 3]]
    """
    capacity = _check_capacity(capacity)
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    group_size = int(group_size)
    arr = _as_lengths(lengths, capacity)
    packs: List[List[int]] = []
    for start in range(0, arr.shape[0], group_size):
        packs.extend(_bfd_window(arr[start : start + group_size], capacity, start))
    return packs


def shuffle_packs(packs: Sequence[Sequence[int]], seed: int, epoch: int = 0) -> List[List[int]]:
    """Shuffle the order of packs, deterministically for each epoch.

    The permutation comes from ``numpy.random.default_rng([seed, epoch])``.
    The same ``(seed, epoch)`` always gives the same order, and different
    epochs give different orders. The packs are not changed, only reordered.
    The result is a new list.

    Example:
        >>> shuffle_packs([[0], [1], [2], [3]], seed=0, epoch=0)
        [[2], [0], [1], [3]]
        >>> shuffle_packs([[0], [1], [2], [3]], seed=0, epoch=0) == shuffle_packs([[0], [1], [2], [3]], 0, 0)
        True
    """
    if int(seed) < 0 or int(epoch) < 0:
        raise ValueError(f"seed and epoch must be non-negative, got seed={seed}, epoch={epoch}")
    rng = np.random.default_rng([int(seed), int(epoch)])
    perm = rng.permutation(len(packs))
    return [list(packs[i]) for i in perm.tolist()]


# --------------------------------------------------------------------------- #
# rows and masks
# --------------------------------------------------------------------------- #
def build_packed_row(
    examples: Sequence[Mapping], max_length: int, pad_token_id: int
) -> Dict[str, np.ndarray]:
    """Concatenate examples into one row of length ``max_length`` (a numpy dict).

    Args:
        examples: tokenized examples ``{"input_ids", "labels"}``. Labels are
            already shifted. The total length must be ``<= max_length``.
        max_length: row length ``L``.
        pad_token_id: token used in the padding tail.

    Returns:
        ``input_ids`` int64 [L], ``labels`` int64 [L] (-100 on padding),
        ``position_ids`` int64 [L] (restart at 0 for each example; the padding
        tail is numbered 0, 1, 2, ... like one more sequence), and
        ``attn_mask_startend_row_indices`` int32 [L]. The last one is the
        FlashMask causal LTS start row: row ``i`` may attend to column ``j``
        iff ``j <= i < start[j]``. A column of an example that ends at ``e``
        (exclusive) gets ``e``. A padding column gets the first padding row.

    Raises:
        ValueError: malformed or empty example, or total length > max_length.

    Example:
        >>> r = build_packed_row([{"input_ids": [11, 12, 13], "labels": [12, 13, 2]},
        ...                       {"input_ids": [21, 22], "labels": [-100, 2]}], 8, 0)
        >>> r["input_ids"].tolist()
        [11, 12, 13, 21, 22, 0, 0, 0]
        >>> r["labels"].tolist()
        [12, 13, 2, -100, 2, -100, -100, -100]
        >>> r["position_ids"].tolist()
        [0, 1, 2, 0, 1, 0, 1, 2]
        >>> r["attn_mask_startend_row_indices"].tolist()
        [3, 3, 3, 5, 5, 5, 5, 5]
    """
    L = _check_capacity(max_length)
    lens = []
    for k, ex in enumerate(examples):
        n = _example_length(ex, k)
        if n < 1:
            raise ValueError(f"example {k} in the pack is empty")
        lens.append(n)
    total = sum(lens)
    if total > L:
        raise ValueError(f"packed examples total {total} tokens > max_length {L} (lengths {lens})")
    input_ids = np.full(L, pad_token_id, dtype=np.int64)
    labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty(L, dtype=np.int64)
    start = np.empty(L, dtype=np.int32)
    off = 0
    for ex, n in zip(examples, lens):
        end = off + n
        input_ids[off:end] = ex["input_ids"]
        labels[off:end] = ex["labels"]
        position_ids[off:end] = np.arange(n)
        start[off:end] = end
        off = end
    if off < L:
        position_ids[off:] = np.arange(L - off)
        start[off:] = off
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "attn_mask_startend_row_indices": start,
    }


def startend_to_dense_mask(start_rows) -> np.ndarray:
    """Expand a FlashMask causal LTS start-row vector into a dense boolean mask.

    ``mask[i, j]`` is True (may attend) iff ``j <= i < start_rows[j]``.
    ``start_rows`` can have shape ``[L]`` or any shape that squeezes to
    ``[L]``, such as ``[1, L, 1]``. For a packed row this gives a
    block-diagonal causal mask. Padding query rows come out all False, so a
    dense-mask consumer must use a finite large negative bias (or guard
    all-masked rows) to avoid NaN in softmax.

    Example:
        >>> startend_to_dense_mask([2, 2, 3, 3]).astype(int).tolist()   # examples [0,2) and [2,3); pad row 3
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    """
    s = np.asarray(start_rows)
    if s.ndim != 1:
        s = s.reshape(-1)
    L = s.shape[0]
    rows = np.arange(L)[:, None]
    cols = np.arange(L)[None, :]
    return (cols <= rows) & (rows < s[None, :])


def collate_packed(rows: Sequence[Mapping[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Stack packed rows (from :func:`build_packed_row`) into a batch of numpy arrays.

    Returns ``input_ids`` / ``labels`` / ``position_ids`` int64 [B, L], and
    ``attn_mask_startend_row_indices`` int32 [B, 1, L, 1], the layout
    ``flashmask_attention`` expects (the head dim is 1, so it broadcasts).

    Example:
        >>> a = build_packed_row([{"input_ids": [1, 2], "labels": [2, 3]}], 4, 0)
        >>> b = collate_packed([a, a])
        >>> b["input_ids"].shape, b["attn_mask_startend_row_indices"].shape
        ((2, 4), (2, 1, 4, 1))
        >>> b["attn_mask_startend_row_indices"][0, 0, :, 0].tolist()
        [2, 2, 2, 2]
    """
    if len(rows) == 0:
        raise ValueError("collate_packed needs at least one row")
    lens = {len(r["input_ids"]) for r in rows}
    if len(lens) != 1:
        raise ValueError(f"all packed rows must have the same length, got {sorted(lens)}")
    out = {
        k: np.stack([np.asarray(r[k], dtype=np.int64) for r in rows])
        for k in ("input_ids", "labels", "position_ids")
    }
    se = np.stack([np.asarray(r["attn_mask_startend_row_indices"], dtype=np.int32) for r in rows])
    out["attn_mask_startend_row_indices"] = se[:, None, :, None]
    return out


# --------------------------------------------------------------------------- #
# statistics
# --------------------------------------------------------------------------- #
def padding_ratio(packs: Sequence[Sequence[int]], lengths: Sequence[int], capacity: int) -> float:
    """Padding as a fraction of all slots: ``1 - sum(tokens in packs) / (len(packs) * capacity)``.

    Returns 0.0 when there are no packs.

    Example:
        >>> padding_ratio([[0, 1], [2, 3]], [5, 3, 4, 2], 8)   # 14 tokens in 16 slots
        0.125
    """
    capacity = _check_capacity(capacity)
    if len(packs) == 0:
        return 0.0
    arr = np.asarray(lengths, dtype=np.int64)
    used = int(sum(int(arr[list(p)].sum()) for p in packs if len(p)))
    return 1.0 - used / (len(packs) * capacity)


def batch_padding_ratio(lengths: Sequence[int], batch_size: int) -> float:
    """Padding fraction without packing: each batch of consecutive examples is padded to its longest example.

    The last batch may be smaller and is padded to its own size only.

    Example:
        >>> batch_padding_ratio([5, 3, 4, 2], 2)   # batches (5,3)->10 slots, (4,2)->8 slots; 14/18 used
        0.2222222222222222
    """
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return 0.0
    n = arr.shape[0]
    nb = -(-n // batch_size)
    padded = np.zeros(nb * batch_size, dtype=np.int64)
    padded[:n] = arr
    mx = padded.reshape(nb, batch_size).max(axis=1)
    sizes = np.full(nb, batch_size, dtype=np.int64)
    sizes[-1] = n - (nb - 1) * batch_size
    slots = int((mx * sizes).sum())
    return 1.0 - int(arr.sum()) / slots


# --------------------------------------------------------------------------- #
# dataset
# --------------------------------------------------------------------------- #
class PackedDataset:
    """Map-style dataset of packed rows, built from a list of tokenized examples.

    The packs (lists of example indices) are computed eagerly at construction
    time. Rows are built lazily in ``__getitem__`` with
    :func:`build_packed_row`, which is cheap, so memory stays O(examples). The
    examples are referenced, not copied. It is a plain Python object with
    ``__len__`` and ``__getitem__``, so ``paddle.io.DataLoader`` accepts it
    (use ``collate_fn=collate_packed``).

    Args:
        examples: list of ``{"input_ids", "labels"}`` (labels already shifted).
        max_length: row length. An example longer than this raises
            ValueError, naming its index.
        pad_token_id: padding token.
        greedy: True selects ``greedy_zero_padding`` (:func:`greedy_pack`).
            False selects ``zero_padding`` (:func:`pack_in_order`).
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
        self.max_length = _check_capacity(max_length)
        self.pad_token_id = int(pad_token_id)
        self.greedy = bool(greedy)
        self.group_size = int(group_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        lengths = np.fromiter(
            (_example_length(ex, i) for i, ex in enumerate(examples)), dtype=np.int64, count=len(examples)
        )
        self.lengths = _as_lengths(lengths, self.max_length)  # raises on over-long / empty, naming the index
        if self.greedy:
            self._base_packs = greedy_pack(self.lengths, self.max_length, self.group_size)
        else:
            self._base_packs = pack_in_order(self.lengths, self.max_length)
        self._supervised = int(
            sum(int(np.count_nonzero(np.asarray(ex["labels"]) != IGNORE_INDEX)) for ex in examples)
        )
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
