"""Collators: pad examples into a batch, or stack packed rows.

Numpy in, numpy out; the Trainer's DataLoader makes tensors.
"""

from typing import Dict, List, Optional

import numpy as np

from .packed_row import collate_packed, startend_to_dense_mask
from .tokenize import IGNORE_INDEX


def pad_length(lengths: List[int], pad_to_multiple_of: Optional[int], max_length: Optional[int]) -> int:
    """Target length of a batch.

    ``pad_length([5, 7], None, None) == 7``; ``pad_length([5, 7], 4, None) == 8``;
    ``pad_length([5, 7], None, 16) == 16`` (pad_to_max_length).
    """
    if max_length is not None:
        return max_length
    n = max(lengths)
    if pad_to_multiple_of:
        n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
    return n


class PaddingCollator:
    """Right-pad ``input_ids`` with pad_token_id and ``labels`` with -100.

    Example (pad 0): ``[{"input_ids": [1, 5], "labels": [5, 2]}, {"input_ids": [1], "labels": [2]}]`` ->
    ``input_ids [[1, 5], [1, 0]]``, ``labels [[5, 2], [2, -100]]``,
    ``real_tokens [[1, 1], [1, 0]]`` (1 = a token of an example, 0 = padding;
    the trainer pops it before the forward pass and uses it for token counts
    and NEFTune lengths).

    No attention mask is produced: with right padding and causal attention a
    real token never attends to a later (padding) position, so the outputs at
    real positions are exactly those of the unpadded example and padding
    positions carry no loss.  This keeps every attention kernel on its
    mask-free causal path.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: Optional[int] = None, max_length: Optional[int] = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_length = max_length

    def __call__(self, features: List[Dict]) -> Dict[str, np.ndarray]:
        n = pad_length([len(f["input_ids"]) for f in features], self.pad_to_multiple_of, self.max_length)
        ids = np.full((len(features), n), self.pad_token_id, dtype="int64")
        labels = np.full((len(features), n), IGNORE_INDEX, dtype="int64")
        real = np.zeros((len(features), n), dtype="int64")
        for i, f in enumerate(features):
            ids[i, : len(f["input_ids"])] = f["input_ids"]
            labels[i, : len(f["labels"])] = f["labels"]
            real[i, : len(f["input_ids"])] = 1
        return {"input_ids": ids, "labels": labels, "real_tokens": real}


class PackedCollator:
    """Stack packed rows (``packed_row.build_packed_row``) into a batch.

    ``flash_mask=True``: the batch carries ``attn_mask_startend_row_indices``
    int32 [B, 1, L, 1] (O(L) per row).  ``flash_mask=False``: the same mask as
    a dense bool ``attention_mask`` [B, 1, L, L], for models/attention paths
    that need it.  Both add ``real_tokens`` [B, L] (1 = example token): a
    column is padding exactly when its start row is <= its own index.

    Example (one row of L=4: an example of 2 tokens, one of 1, one padding slot):

    >>> from paddlenlp_ext.data.packed_row import build_packed_row
    >>> row = build_packed_row([{"input_ids": [1, 2], "labels": [2, 3]}, {"input_ids": [4], "labels": [5]}], 4, 0)
    >>> fm = PackedCollator(flash_mask=True)([row])
    >>> fm["attn_mask_startend_row_indices"][:, 0, :, 0].tolist(), fm["real_tokens"].tolist()
    ([[2, 2, 3, 3]], [[1, 1, 1, 0]])
    >>> PackedCollator(flash_mask=False)([row])["attention_mask"][0, 0].astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    """

    def __init__(self, flash_mask: bool):
        self.flash_mask = flash_mask

    def __call__(self, rows: List[Dict]) -> Dict[str, np.ndarray]:
        batch = collate_packed(rows)
        start = batch["attn_mask_startend_row_indices"][:, 0, :, 0]  # [B, L]
        batch["real_tokens"] = (start > np.arange(start.shape[1])[None, :]).astype("int64")
        if not self.flash_mask:
            del batch["attn_mask_startend_row_indices"]
            batch["attention_mask"] = np.stack([startend_to_dense_mask(s)[None] for s in start])  # [B,1,L,L]
        return batch
