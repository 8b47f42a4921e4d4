"""Which examples share a row: bin packing on example lengths (indices only, numpy only).

Owns the two packing strategies of the config (``zero_padding`` ->
:func:`pack_in_order`, ``greedy_zero_padding`` -> :func:`greedy_pack`, which
runs :func:`best_fit_decreasing` on each window of ``group_size`` examples),
the per-epoch pack-order shuffle, the padding statistics, and the validation
of lengths shared by the packing modules. A pack is a list of indices into
the lengths; turning packs into rows is :mod:`.packed_row`'s job. Examples
longer than the row (or empty) raise ``ValueError`` naming the index of the
example: nothing is dropped silently.
"""

from __future__ import annotations

import bisect
from typing import List, Sequence

import numpy as np

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "pack_in_order",
    "best_fit_decreasing",
    "greedy_pack",
    "shuffle_packs",
    "padding_ratio",
    "batch_padding_ratio",
]

#: Default window for :func:`greedy_pack`. Windows of 2048 examples reach
#: <= 0.5% padding on alpaca-like lengths at max_length 1024 and 2048 (see
#: docs/packing.md). A bigger window changes little and costs data locality.
DEFAULT_GROUP_SIZE = 2048


# --------------------------------------------------------------------------- #
# validation helpers (shared with packed_row.py and packing.py)
# --------------------------------------------------------------------------- #
def check_capacity(capacity) -> int:
    """Return ``capacity`` (a row length) as an int; ValueError unless it is a positive integer.

    Example:
        >>> check_capacity(8.0)
        8
    """
    if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 1:
        raise ValueError(f"capacity/max_length must be a positive integer, got {capacity!r}")
    return int(capacity)


def validate_lengths(lengths, capacity: int) -> np.ndarray:
    """Validate a 1-D sequence of lengths and return it as an int64 array.

    Raises ValueError and names the first bad index when a length is below 1
    or above ``capacity``.

    Example:
        >>> validate_lengths([3, 8], 8).tolist()
        [3, 8]
        >>> validate_lengths([3, 9], 8)
        Traceback (most recent call last):
        ...
        ValueError: example 1 has length 9 > max_length 8 (1 over-long example(s) in total); truncate before packing
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
    capacity = check_capacity(capacity)
    arr = validate_lengths(lengths, capacity)
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
    capacity = check_capacity(capacity)
    arr = validate_lengths(lengths, capacity)
    return _bfd_window(arr, capacity, 0)


def greedy_pack(lengths: Sequence[int], capacity: int, group_size: int = DEFAULT_GROUP_SIZE) -> List[List[int]]:
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
    capacity = check_capacity(capacity)
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    group_size = int(group_size)
    arr = validate_lengths(lengths, capacity)
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
# statistics
# --------------------------------------------------------------------------- #
def padding_ratio(packs: Sequence[Sequence[int]], lengths: Sequence[int], capacity: int) -> float:
    """Padding as a fraction of all slots: ``1 - sum(tokens in packs) / (len(packs) * capacity)``.

    Returns 0.0 when there are no packs.

    Example:
        >>> padding_ratio([[0, 1], [2, 3]], [5, 3, 4, 2], 8)   # 14 tokens in 16 slots
        0.125
    """
    capacity = check_capacity(capacity)
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
