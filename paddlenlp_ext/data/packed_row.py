"""One packed row from a pack of examples: tokens, labels, position ids and the FlashMask start rows.

Owns the packed row format and its mask (numpy only, never paddle):
:func:`build_packed_row` concatenates the examples of one pack,
:func:`collate_packed` stacks rows into the batch layout of
``paddle.nn.functional.flashmask_attention``, and
:func:`startend_to_dense_mask` expands the start-row vector into the dense
boolean mask it stands for. Which examples share a row is :mod:`.binpack`'s
job.

Packed row format, each array of length ``L = max_length``:

* ``input_ids`` int64: the tokens of the examples, then ``pad_token_id``.
* ``labels`` int64: the labels of the examples, then ``-100``. Labels are
  ALREADY shifted inside each example (``labels[i]`` is the target of
  position ``i``), so concatenation never makes a label cross an example
  boundary.
* ``position_ids`` int64: restart at 0 for each example. The padding tail is
  numbered as one more sequence ``0, 1, 2, ...``, so every id stays below
  ``L``. Padding positions are fully masked, so their values have no effect.
* ``attn_mask_startend_row_indices`` int32: the causal single-bound form (LTS)
  of ``flashmask_attention``. Query row ``i`` may attend to key column ``j``
  iff ``j <= i < start[j]``. A column in an example that ends at row ``e``
  (exclusive) gets ``start[j] = e``. A padding column gets ``start[j] = p``,
  where ``p`` is the first padding row. So no row, real or padding, ever sees
  a padding key, and padding query rows see nothing. That matches
  PaddleNLP's own right-padding convention for this tensor.
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

import numpy as np

from .binpack import check_capacity
from .tokenize import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "build_packed_row",
    "startend_to_dense_mask",
    "collate_packed",
]


def example_length(ex: Mapping, index) -> int:
    """Token count of a tokenized example; ValueError naming ``index`` if it is malformed.

    Example:
        >>> example_length({"input_ids": [5, 6, 7], "labels": [6, 7, 2]}, 0)
        3
        >>> example_length({"input_ids": [5, 6], "labels": [6]}, 4)
        Traceback (most recent call last):
        ...
        ValueError: example 4: len(input_ids)=2 != len(labels)=1
    """
    try:
        n = len(ex["input_ids"])
        m = len(ex["labels"])
    except (KeyError, TypeError) as e:
        # a missing key or a non-sized value: re-raised as the same ValueError as every other malformed example
        raise ValueError(f"example {index} must be a dict with 'input_ids' and 'labels' ({e})") from None
    if n != m:
        raise ValueError(f"example {index}: len(input_ids)={n} != len(labels)={m}")
    return n


def build_packed_row(examples: Sequence[Mapping], max_length: int, pad_token_id: int) -> Dict[str, np.ndarray]:
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
    L = check_capacity(max_length)
    lens = []
    for k, ex in enumerate(examples):
        n = example_length(ex, k)
        if n < 1:
            raise ValueError(f"example {k} in the pack is empty")
        lens.append(n)
    total = sum(lens)
    if total > L:
        raise ValueError(f"packed examples total {total} tokens > max_length {L} (lengths {lens})")
    input_ids, position_ids, start = new_row(L, pad_token_id)
    labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
    off = 0
    for ex, n in zip(examples, lens):
        end = off + n
        input_ids[off:end] = ex["input_ids"]
        labels[off:end] = ex["labels"]
        position_ids[off:end] = np.arange(n)
        start[off:end] = end
        off = end
    pad_row_tail(position_ids, start, off)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "attn_mask_startend_row_indices": start,
    }


def new_row(length: int, pad_token_id: int):
    """The buffers of one packed row: ``(input_ids, position_ids, start_rows)``.

    ``input_ids`` int64 is all ``pad_token_id``; ``position_ids`` int64 and the FlashMask
    start rows int32 are left for the caller to fill (then :func:`pad_row_tail`).
    Shared by SFT packing (:func:`build_packed_row`) and the preference rows (``dpo/pair_rows.py``).

    Example: ``new_row(4, 0)[0].tolist()`` -> ``[0, 0, 0, 0]``; the others have shape ``(4,)``.
    """
    return (
        np.full(length, pad_token_id, dtype=np.int64),
        np.empty(length, dtype=np.int64),
        np.empty(length, dtype=np.int32),
    )


def pad_row_tail(position_ids: np.ndarray, start: np.ndarray, off: int) -> None:
    """Fill the padding tail ``[off:]`` of one row's position ids and start rows, in place.

    Padding positions count from 0 again (as PaddleNLP's packed rows do); every padding
    column's start row is ``off``, the first padding row: no real row attends to padding,
    and a padding row attends to nothing (``j <= i < start[j]`` never holds for it).

    Example: position_ids ``[0, 1, 2, x, x]``, start ``[3, 3, 3, x, x]``, off 3
    -> position_ids ``[0, 1, 2, 0, 1]``, start ``[3, 3, 3, 3, 3]``.
    """
    position_ids[off:] = np.arange(len(position_ids) - off)
    start[off:] = off


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
        k: np.stack([np.asarray(r[k], dtype=np.int64) for r in rows]) for k in ("input_ids", "labels", "position_ids")
    }
    se = np.stack([np.asarray(r["attn_mask_startend_row_indices"], dtype=np.int32) for r in rows])
    out["attn_mask_startend_row_indices"] = se[:, None, :, None]
    return out
