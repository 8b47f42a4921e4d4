"""Preference pairs -> rows -> the DPO batch contract (numpy only, never the model).

A tokenized pair is ``{"prompt": [...], "chosen": [...], "rejected": [...]}``
(plus ``"origin": "file:line"``).  It becomes ONE sequence
``prompt + chosen + rejected`` (see the contract in :mod:`paddlenlp_ext.dpo`):

* ``position_ids``: ``0..P-1`` for the prompt, ``P..P+C-1`` for chosen and
  ``P..P+R-1`` again for rejected (it continues the prompt, not chosen).
* FlashMask start rows (causal LTS form, int32: query row ``i`` may see key
  column ``j`` iff ``j <= i < start[j]``): prompt and rejected columns ->
  the end of the pair in the row; chosen columns -> the first rejected row.
  So rejected rows see the prompt and themselves, never chosen.
* logp entries: chosen[k] is predicted at ``P-1+k``; rejected[0] at ``P-1``
  (the last prompt token, scored twice); rejected[k>0] at its own position - 1.

Several pairs may share a row (zero padding); each one restarts its positions
at 0 and its mask is confined to its own span.  Padding columns get the first
padding row as start row (nobody sees them; padding rows see nothing, as in
:mod:`paddlenlp_ext.data.packed_row`) and are never scored.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..data.binpack import (
    DEFAULT_GROUP_SIZE,
    check_capacity,
    greedy_pack,
    pack_in_order,
    padding_ratio,
    shuffle_packs,
)
from ..data.packed_row import new_row, pad_row_tail, startend_to_dense_mask

__all__ = ["pair_length", "build_pair_row", "PreferenceDataset", "PreferenceCollator"]


def pair_length(pair: Mapping, index=None) -> int:
    """``len(prompt) + len(chosen) + len(rejected)``; ValueError if a part is empty.

    >>> pair_length({"prompt": [1, 5, 6], "chosen": [7, 2], "rejected": [8, 2]})
    7
    """
    where = pair.get("origin") or f"pair {index}"
    for key in ("prompt", "chosen", "rejected"):
        if len(pair[key]) < 1:
            raise ValueError(f"{where}: empty {key}; every pair needs at least one token in each part")
    return len(pair["prompt"]) + len(pair["chosen"]) + len(pair["rejected"])


def build_pair_row(pairs: Sequence[Mapping], max_length: Optional[int] = None, pad_token_id: int = 0) -> Dict:
    """Concatenate pairs into one row; returns numpy arrays with ROW-LOCAL logp entries.

    ``input_ids`` / ``position_ids`` int64 [L], ``attn_mask_startend_row_indices``
    int32 [L], ``logp_index`` (position in the row), ``logp_token``,
    ``logp_segment`` (``2 * k + {0 chosen, 1 rejected}`` for the k-th pair of
    the row) int64 [T], ``num_pairs`` and ``length`` (real tokens).  ``L`` is
    ``max_length`` (padded) or, if None, the real length (no padding).

    Worked example: prompt [11, 12, 13], chosen [21, 22], rejected [31, 32], max_length 9, pad 0:

    >>> r = build_pair_row([{"prompt": [11, 12, 13], "chosen": [21, 22], "rejected": [31, 32]}], 9)
    >>> r["input_ids"].tolist(), r["position_ids"].tolist()
    ([11, 12, 13, 21, 22, 31, 32, 0, 0], [0, 1, 2, 3, 4, 3, 4, 0, 1])
    >>> r["attn_mask_startend_row_indices"].tolist()
    [7, 7, 7, 5, 5, 7, 7, 7, 7]
    >>> r["logp_index"].tolist(), r["logp_token"].tolist(), r["logp_segment"].tolist()
    ([2, 3, 2, 5], [21, 22, 31, 32], [0, 0, 1, 1])
    """
    lens = [pair_length(p, k) for k, p in enumerate(pairs)]
    total = sum(lens)
    L = total if max_length is None else check_capacity(max_length)
    if total > L:
        raise ValueError(f"pairs total {total} tokens > max_length {L} (lengths {lens})")
    input_ids, position_ids, start = new_row(L, pad_token_id)
    idx: List[int] = []
    tok: List[int] = []
    seg: List[int] = []
    off = 0
    for k, p in enumerate(pairs):
        P, C, R = len(p["prompt"]), len(p["chosen"]), len(p["rejected"])
        end = off + P + C + R
        input_ids[off:end] = list(p["prompt"]) + list(p["chosen"]) + list(p["rejected"])
        position_ids[off:end] = np.concatenate([np.arange(P + C), np.arange(P, P + R)])
        start[off:end] = end
        start[off + P : off + P + C] = off + P + C  # chosen: hidden from the rejected rows
        # chosen[c] at off+P+c is predicted at off+P+c-1 (c=0: the last prompt token)
        idx += list(range(off + P - 1, off + P + C - 1))
        tok += list(p["chosen"])
        seg += [2 * k] * C
        # rejected[0] is predicted by the last prompt token, rejected[r>0] by the token before it
        idx += [off + P - 1] + list(range(off + P + C, off + P + C + R - 1))
        tok += list(p["rejected"])
        seg += [2 * k + 1] * R
        off = end
    pad_row_tail(position_ids, start, off)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attn_mask_startend_row_indices": start,
        "logp_index": np.asarray(idx, dtype=np.int64),
        "logp_token": np.asarray(tok, dtype=np.int64),
        "logp_segment": np.asarray(seg, dtype=np.int64),
        "num_pairs": len(pairs),
        "length": off,
    }


class PreferenceDataset:
    """Map-style dataset of pair rows: one pair per row, or packed (zero padding).

    ``packing=None``: row ``i`` is pair ``i``, unpadded (the collator pads per
    batch).  ``"in_order"`` (``zero_padding``): :func:`~paddlenlp_ext.data.binpack.pack_in_order`;
    ``"greedy"`` (``greedy_zero_padding``): :func:`~paddlenlp_ext.data.binpack.greedy_pack`
    — the same packers as the SFT pipeline, on pair lengths, rows of
    ``max_length``.  Packed rows are reordered per epoch with
    :meth:`set_epoch` (seeded, like :class:`~paddlenlp_ext.data.packing.PackedDataset`).

    >>> pairs = [{"prompt": [1] * 2, "chosen": [2] * n, "rejected": [3]} for n in (3, 2, 1)]   # lengths 6, 5, 4
    >>> ds = PreferenceDataset(pairs, max_length=10, packing="greedy", shuffle=False)
    >>> ds.packs, len(ds), ds[0]["num_pairs"]
    ([[0, 2], [1]], 2, 2)
    """

    def __init__(
        self,
        pairs: Sequence[Mapping],
        max_length: int,
        packing: Optional[str] = None,
        pad_token_id: int = 0,
        group_size: int = DEFAULT_GROUP_SIZE,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if packing not in (None, "in_order", "greedy"):
            raise ValueError(f"packing must be None, 'in_order' or 'greedy', got {packing!r}")
        self.pairs = pairs
        self.max_length = check_capacity(max_length)
        self.packing = packing
        self.pad_token_id = int(pad_token_id)
        self.seed, self.shuffle = int(seed), bool(shuffle) and packing is not None
        self.lengths = np.asarray([pair_length(p, i) for i, p in enumerate(pairs)], dtype=np.int64)
        too_long = [i for i, n in enumerate(self.lengths.tolist()) if n > self.max_length]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"{pairs[i].get('origin') or f'pair {i}'}: {int(self.lengths[i])} tokens > max_seq_len "
                f"{self.max_length} ({len(too_long)} such pair(s)); truncate before building rows"
            )
        if packing == "greedy":
            self._base = greedy_pack(self.lengths, self.max_length, group_size)
        elif packing == "in_order":
            self._base = pack_in_order(self.lengths, self.max_length)
        else:
            self._base = [[i] for i in range(len(pairs))]
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Reorder packed rows for ``epoch`` (deterministic per seed); unpacked rows keep data order."""
        self.epoch = int(epoch)
        self._packs = (
            shuffle_packs(self._base, self.seed, self.epoch) if self.shuffle else [list(p) for p in self._base]
        )

    @property
    def packs(self) -> List[List[int]]:
        return self._packs

    def __len__(self) -> int:
        return len(self._packs)

    def __getitem__(self, i: int) -> Dict:
        rows_len = self.max_length if self.packing else None
        return build_pair_row([self.pairs[j] for j in self._packs[i]], rows_len, self.pad_token_id)

    def stats(self) -> Dict:
        """``pairs``, ``rows``, ``tokens`` and, when packed, ``padding_ratio`` of the rows."""
        out = {"pairs": len(self.pairs), "rows": len(self._base), "tokens": int(self.lengths.sum())}
        if self.packing:
            out["padding_ratio"] = round(padding_ratio(self._base, self.lengths, self.max_length), 6)
        return out


class PreferenceCollator:
    """Rows (:func:`build_pair_row`) -> the batch contract of :mod:`paddlenlp_ext.dpo` (numpy arrays).

    Rows are right-padded to ``max_length`` if given (packed rows: max_seq_len)
    or to the longest row of the batch.  ``logp_index`` becomes
    ``row * S + position`` and ``logp_segment`` is shifted by ``2 * (pairs in
    earlier rows)``, so pairs are numbered 0..N-1 across the batch.
    ``flash_mask=True`` gives ``attn_mask_startend_row_indices`` int32
    [B, 1, S, 1]; False gives the same mask as a dense bool ``attention_mask``
    [B, 1, S, S] (True = may attend; padding rows all False, as
    :class:`~paddlenlp_ext.data.collate.PackedCollator`).  Numpy out: the
    Trainer's DataLoader makes tensors.

    Example, two unpacked rows (lengths 7 and 4, pad 0):

    >>> a = build_pair_row([{"prompt": [11, 12, 13], "chosen": [21, 22], "rejected": [31, 32]}])
    >>> b = build_pair_row([{"prompt": [41, 42], "chosen": [51], "rejected": [61]}])
    >>> out = PreferenceCollator(pad_token_id=0, flash_mask=True)([a, b])
    >>> out["input_ids"][1].tolist(), out["attn_mask_startend_row_indices"][1, 0, :, 0].tolist()
    ([41, 42, 51, 61, 0, 0, 0], [4, 4, 3, 4, 4, 4, 4])
    >>> out["logp_index"].tolist(), out["logp_segment"].tolist(), out["num_pairs"]
    ([2, 3, 2, 5, 8, 8], [0, 0, 1, 1, 2, 3], 2)
    """

    def __init__(self, pad_token_id: int, flash_mask: bool, max_length: Optional[int] = None):
        self.pad_token_id = int(pad_token_id)
        self.flash_mask = bool(flash_mask)
        self.max_length = max_length

    def __call__(self, rows: Sequence[Mapping]) -> Dict:
        if len(rows) == 0:
            raise ValueError("PreferenceCollator needs at least one row")
        S = self.max_length or max(len(r["input_ids"]) for r in rows)
        B = len(rows)
        ids = np.full((B, S), self.pad_token_id, dtype=np.int64)
        pos = np.empty((B, S), dtype=np.int64)
        start = np.empty((B, S), dtype=np.int32)
        real = np.zeros((B, S), dtype=np.int64)  # 1 = a token of a pair, 0 = tail padding
        idx, tok, seg = [], [], []
        pairs = 0
        for b, r in enumerate(rows):
            n = int(r["length"])
            if len(r["input_ids"]) > S:
                raise ValueError(f"row {b} has {len(r['input_ids'])} tokens > max_length {S}")
            ids[b, :n] = r["input_ids"][:n]
            pos[b, :n] = r["position_ids"][:n]
            start[b, :n] = r["attn_mask_startend_row_indices"][:n]
            pad_row_tail(pos[b], start[b], n)  # views: fills the batch row in place
            real[b, :n] = 1
            idx.append(np.asarray(r["logp_index"], dtype=np.int64) + b * S)
            tok.append(np.asarray(r["logp_token"], dtype=np.int64))
            seg.append(np.asarray(r["logp_segment"], dtype=np.int64) + 2 * pairs)
            pairs += int(r["num_pairs"])
        out = {
            "input_ids": ids,
            "position_ids": pos,
            "logp_index": np.concatenate(idx),
            "logp_token": np.concatenate(tok),
            "logp_segment": np.concatenate(seg),
            "num_pairs": pairs,
            "num_real_tokens": int(sum(int(r["length"]) for r in rows)),  # non-padding tokens of the batch
            "real_tokens": real,  # [B, S]: the MoE rows' router aux loss counts these only (training/moe_aux.py)
        }
        if self.flash_mask:
            out["attn_mask_startend_row_indices"] = start[:, None, :, None]
        else:
            out["attention_mask"] = np.stack([startend_to_dense_mask(s)[None] for s in start])
        return out
