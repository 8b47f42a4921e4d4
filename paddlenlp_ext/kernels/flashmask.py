"""CPU drop-in for ``paddle.nn.functional.flashmask_attention``.

Paddle ships FlashMask only as a CUDA/XPU kernel.  ``flashmask_attention``
re-implements the same API (signature, ``[batch, seq, heads, head_dim]``
layout, the column-wise ``startend_row_indices`` mask forms, GQA/MQA) with
ordinary Paddle ops so packed-sequence training runs on CPU and in unit tests.
This module checks the arguments the way Paddle does and wires the pieces:
bounds -> row intervals (``bounds``), tile schedule (``schedule``),
block-sparse forward/backward (``blocksparse``).  Packed rows of whole documents
(causal, one start row per column, fp32, no lse asked) take ``varlen`` instead:
dense causal attention per document, sum(n_i^2) scores instead of a tile walk.

The tile schedule is built from host copies of the bounds (``.numpy()``), so
this is a dynamic-graph implementation; it is meant for CPU, not for
``paddle.jit.to_static``.
"""

from __future__ import annotations

import math

import paddle

from .blocksparse import FlashMaskFn
from .bounds import check_bound_count, window_to_startend
from .schedule import BLOCK_SIZE, build_plan
from .varlen import document_segments, varlen_causal_attention

__all__ = ["flashmask_attention", "tiled_flashmask_attention"]

# Paddle's block_mask always describes 128 x 128 blocks, whatever our tile size.
_BLOCK_MASK_EDGE = 128


def flashmask_attention(
    query,
    key,
    value,
    startend_row_indices=None,
    *,
    dropout=0.0,
    causal=False,
    window_size=None,
    return_softmax_lse=False,
    return_seed_offset=False,
    fixed_seed_offset=None,
    rng_name="",
    training=True,
    name=None,
    softmax_scale=None,
    block_mask=None,
):
    r"""CPU implementation of ``paddle.nn.functional.flashmask_attention``.

    ``softmax(Q K^T * scale + M) V`` where M is described column-wise by
    ``startend_row_indices``; rows in ``[start, end)`` of key column j are masked.

    Args:
        query: [batch, seq_q, num_heads, head_dim].
        key, value: [batch, seq_k, k_num_heads, head_dim]; num_heads must be a
            multiple of k_num_heads (GQA/MQA; query head h uses kv head
            h // (num_heads // k_num_heads)).
        startend_row_indices: int tensor [batch, 1 | num_heads | k_num_heads,
            seq_k, {1, 2, 4}] or None.
            * causal, 1 bound  (LTS): rows >= LTS masked (plus the causal mask).
            * causal, 2 bounds (LTS, LTE): rows in [LTS, LTE) masked (plus causal).
            * non-causal, 2 bounds (LTS, UTE): rows >= LTS and rows < UTE masked.
            * non-causal, 4 bounds (LTS, LTE, UTS, UTE): rows in [LTS, LTE)
              and in [UTS, UTE) masked.
            * None: plain (causal or full) attention.
        dropout: only 0 is supported while training (raises NotImplementedError
            otherwise); ignored when ``training=False``, as in Paddle.
        causal: causal masking; for seq_q != seq_k it is bottom-right aligned
            (FlashAttention-2 convention).
        window_size: sliding window, converted to bounds exactly like Paddle.
        return_softmax_lse: also return the log-sum-exp [batch, num_heads,
            seq_q] (fp32, +inf for rows that see no key; not differentiable).
        return_seed_offset: also return a [2] int64 zero tensor (no dropout RNG
            is consumed).
        fixed_seed_offset, rng_name, name: accepted for compatibility; unused.
        softmax_scale: defaults to 1/sqrt(head_dim).
        block_mask: optional int [batch, hb, ceil(seq_q/128), ceil(seq_k/128)],
            1 keeps a 128x128 block, 0 masks it (on top of the bounds).

    Returns:
        out [batch, seq_q, num_heads, head_dim] (dtype of query), followed by
        lse and/or seed_offset if requested, as in Paddle.
    """
    if dropout and training:
        raise NotImplementedError(
            "paddlenlp_ext.kernels.flashmask_attention: dropout > 0 is not implemented on the CPU path; "
            "use dropout=0.0 (or training=False)."
        )
    segments = (
        None
        if return_softmax_lse or block_mask is not None or window_size is not None
        else _document_layout(query, key, value, startend_row_indices, causal)
    )
    if segments is not None:  # packed documents: attention per document (kernels/varlen.py)
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
        out = varlen_causal_attention(query, key, value, segments, scale)
        return out if not return_seed_offset else [out, paddle.zeros([2], dtype="int64")]
    out, lse = tiled_flashmask_attention(
        query,
        key,
        value,
        startend_row_indices,
        causal=causal,
        window_size=window_size,
        softmax_scale=softmax_scale,
        block_mask=block_mask,
    )
    outputs = [out]
    if return_softmax_lse:
        outputs.append(lse)
    if return_seed_offset:
        outputs.append(paddle.zeros([2], dtype="int64"))
    return outputs[0] if len(outputs) == 1 else outputs


def _document_layout(query, key, value, sri, causal):
    """The per-row document segments when the bounds are causal LTS describing packed documents
    (fp32, equal q/k lengths, one bound row for all heads), else None (the block-sparse kernel runs)."""
    if (
        sri is None
        or not causal
        or query.dtype != paddle.float32
        or sri.ndim != 4
        or sri.shape[-1] != 1
        or sri.shape[1] != 1
        or sri.shape[0] != query.shape[0]
        or query.shape[1] != key.shape[1]
        or sri.shape[2] != key.shape[1]
        or sri.dtype not in (paddle.int32, paddle.int64)
    ):
        return None  # not the packed-documents form: the general kernel (and its argument checks) run
    _check_qkv(query, key, value)
    rows = sri[:, 0, :, 0].numpy()  # [b, L]: host copy, as the tile schedule also makes
    segments = [document_segments(r) for r in rows]
    return None if any(s is None for s in segments) else segments


def tiled_flashmask_attention(
    query,
    key,
    value,
    startend_row_indices=None,
    *,
    causal=False,
    window_size=None,
    softmax_scale=None,
    block_mask=None,
    block_q=BLOCK_SIZE,
    block_k=BLOCK_SIZE,
):
    """The computation behind ``flashmask_attention`` (no dropout), with the
    tile edges exposed for tests and benchmarks.

    Returns (out [batch, seq_q, num_heads, head_dim], lse [batch, num_heads, seq_q]).
    """
    _check_qkv(query, key, value)
    batch, seq_q, _, head_dim = query.shape
    if window_size is not None:
        assert startend_row_indices is None, "can't use window_size with startend_row_indices"  # as Paddle
        startend_row_indices = window_to_startend(window_size, causal, batch, seq_q)
    sri = startend_row_indices
    if sri is not None:
        _check_startend(sri, query, key, causal)
    if block_mask is not None:
        _check_block_mask(block_mask, sri, query, key, block_q, block_k)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    plan = build_plan(query, key, sri, causal, scale, block_mask, block_q, block_k)
    return FlashMaskFn.apply(query, key, value, plan)


def _check_qkv(query, key, value):
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError("query/key/value must be 4-D [batch, seq, heads, head_dim]")
    batch, _, hq, head_dim = query.shape
    hk = key.shape[2]
    if list(key.shape) != list(value.shape) or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(
            f"query {query.shape}, key {key.shape}, value {value.shape}: key and value must have the same "
            "shape, and agree with query on batch and head_dim"
        )
    if hq % hk != 0:
        raise ValueError(f"num_heads ({hq}) must be a multiple of k_num_heads ({hk})")


def _check_startend(sri, query, key, causal):
    """sri must be int [batch, 1 | num_heads | k_num_heads, seq_k, nb] with Paddle's nb rule."""
    batch, hq = query.shape[0], query.shape[2]
    seq_k, hk = key.shape[1], key.shape[2]
    if sri.dtype not in (paddle.int32, paddle.int64):
        raise TypeError(f"startend_row_indices must be an integer tensor (int32), got {sri.dtype}")
    if sri.ndim != 4:
        raise ValueError(f"startend_row_indices rank must be 4, but got {sri.shape}")
    if sri.shape[0] != batch:
        raise ValueError(f"startend_row_indices.shape[0] must be batch_size {batch}, got {sri.shape[0]}")
    if sri.shape[2] != seq_k:
        raise ValueError(f"startend_row_indices.shape[2] must be seqlen_k {seq_k}, got {sri.shape[2]}")
    if sri.shape[1] not in (1, hq, hk):
        raise ValueError(
            f"startend_row_indices head_num must be 1 (broadcast), num_heads ({hq}) or k_num_heads ({hk}); "
            f"got {sri.shape[1]}"
        )
    check_bound_count(sri.shape[-1], causal)


def _check_block_mask(block_mask, sri, query, key, block_q, block_k):
    """block_mask must be [batch, bound heads, ceil(seq_q/128), ceil(seq_k/128)]
    and, since one keep/drop flag must cover a whole tile, tiles must be 128 x 128."""
    if sri is None:
        raise ValueError("must provide startend_row_indices when using block_mask")
    edge = _BLOCK_MASK_EDGE
    if block_q != edge or block_k != edge:
        raise ValueError(f"block_mask describes {edge}x{edge} blocks; it needs block_q = block_k = {edge}")
    want = [query.shape[0], sri.shape[1], -(-query.shape[1] // edge), -(-key.shape[1] // edge)]
    if list(block_mask.shape) != want:
        raise ValueError(f"block_mask shape must be {want}, got {block_mask.shape}")
