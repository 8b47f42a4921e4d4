"""Prompt + completion sequences -> rows for one policy forward (numpy only, never the model).

Sequence ``k`` is ``prompt_k + completion_k``; its completion token ``c`` (at position
``P + c``) is predicted by the logits at ``P + c - 1``.  Packed (``capacity`` given, zero
padding): sequences are laid into rows of ``capacity`` tokens in order
(:func:`~paddlenlp_ext.data.binpack.pack_in_order`), each restarting its positions at 0, with
FlashMask start rows confining attention to the sequence (``start[j]`` = the end of ``j``'s
sequence; padding columns get the first padding row, padding rows see nothing).  Unpacked: one
sequence per row, right-padded to the longest.  Either way every completion token is scored once,
so packed and unpacked give the same log-probs.

Worked example, prompts [11, 12] and [13], completions [21] and [22, 23], capacity 8::

    input_ids  [11, 12, 21, 13, 22, 23, 0, 0]     position_ids [0, 1, 2, 0, 1, 2, 0, 1]
    start rows [3, 3, 3, 6, 6, 6, 6, 6]           logp_index [1, 3, 4]  logp_token [21, 22, 23]
    logp_segment [0, 1, 1]

A multi-turn completion (tool calls, ``completion_masks``) holds tokens the policy did not generate: the
tool results and the template's tokens between turns (mask 0).  They stay in the row as context but are
never scored: with masks [1] and [1, 0] above, ``logp_index`` is [1, 3] and ``logp_token`` [21, 22], so
they have no log-prob, no loss, no gradient and no place in any token count.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from ..data.binpack import pack_in_order
from ..data.packed_row import startend_to_dense_mask

__all__ = ["sequence_rows"]


def sequence_rows(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_token_id: int,
    capacity: Optional[int],
    flash_mask: bool,
    completion_masks: Optional[Sequence[Sequence[int]]] = None,
) -> Dict:
    """The batch for the policy forward.

    Returns ``input_ids``, ``position_ids`` int64 [B, S]; ``attn_mask_startend_row_indices`` int32
    [B, 1, S, 1] (``flash_mask``) or ``attention_mask`` bool [B, 1, S, S]; ``logp_index`` (flat
    ``row * S + position``), ``logp_token``, ``logp_segment`` (the sequence) int64 [T];
    ``num_real_tokens``; ``real_tokens`` int64 [B, S] (1 = a sequence's token, 0 = tail padding: what the MoE
    rows' router aux loss counts).

    >>> b = sequence_rows([[11, 12], [13]], [[21], [22, 23]], 0, capacity=8, flash_mask=True)
    >>> b["input_ids"].tolist(), b["attn_mask_startend_row_indices"][0, 0, :, 0].tolist()
    ([[11, 12, 21, 13, 22, 23, 0, 0]], [3, 3, 3, 6, 6, 6, 6, 6])
    >>> b["logp_index"].tolist(), b["logp_token"].tolist(), b["logp_segment"].tolist()
    ([1, 3, 4], [21, 22, 23], [0, 1, 1])
    >>> b = sequence_rows([[11, 12], [13]], [[21], [22, 23, 24]], 0, 8, True, completion_masks=[[1], [1, 0, 1]])
    >>> b["logp_index"].tolist(), b["logp_token"].tolist(), b["logp_segment"].tolist()
    ([1, 3, 5], [21, 22, 24], [0, 1, 1])
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need one completion per prompt (got {len(prompts)} prompts, {len(completions)} completions)")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    if any(len(c) == 0 or len(p) == 0 for p, c in zip(prompts, completions)):
        raise ValueError("every prompt and completion needs at least one token")
    if capacity is not None:
        packs = pack_in_order(lengths, capacity)
        width = capacity
    else:
        packs = [[k] for k in range(len(prompts))]
        width = max(lengths)
    B = len(packs)
    ids = np.full((B, width), pad_token_id, dtype=np.int64)
    pos = np.empty((B, width), dtype=np.int64)
    start = np.empty((B, width), dtype=np.int32)
    real = np.zeros((B, width), dtype=np.int64)  # 1 = a prompt or completion token, 0 = tail padding
    idx: List[int] = []
    tok: List[int] = []
    seg: List[int] = []
    for b, pack in enumerate(packs):
        off = 0
        for k in pack:
            p, c = list(prompts[k]), list(completions[k])
            end = off + len(p) + len(c)
            ids[b, off:end] = p + c
            pos[b, off:end] = np.arange(end - off)
            start[b, off:end] = end
            keep = range(len(c)) if completion_masks is None else [j for j in range(len(c)) if completion_masks[k][j]]
            idx += [b * width + off + len(p) - 1 + j for j in keep]
            tok += [c[j] for j in keep]
            seg += [k] * len(keep)
            off = end
        real[b, :off] = 1
        pos[b, off:] = np.arange(width - off)
        start[b, off:] = off
    out = {
        "input_ids": ids,
        "position_ids": pos,
        "logp_index": np.asarray(idx, dtype=np.int64),
        "logp_token": np.asarray(tok, dtype=np.int64),
        "logp_segment": np.asarray(seg, dtype=np.int64),
        "num_real_tokens": int(sum(lengths)),
        "real_tokens": real,
    }
    if flash_mask:
        out["attn_mask_startend_row_indices"] = start[:, None, :, None]
    else:
        out["attention_mask"] = np.stack([startend_to_dense_mask(s)[None] for s in start])
    return out
