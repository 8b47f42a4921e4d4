"""Per-document causal attention for packed rows (the "varlen" path of ``flashmask_attention``).

A packed row of L tokens holding documents of n_1, n_2, ... tokens needs attention only inside each
document: sum(n_i^2) scores instead of the L^2 a dense mask (or a tile schedule that still visits
every partially masked tile) pays.  When the FlashMask bounds describe exactly that layout -- causal,
one bound per key column (LTS), every column's start row equal to the end of its own document, or
at most its own index for padding nobody may see -- :func:`varlen_causal_attention` runs plain dense
causal attention per document with ordinary Paddle ops (autograd gives the backward), and writes 0
for padding rows, which see no key (FlashAttention-2's convention, as the block-sparse kernel).

Per document the arithmetic is the one of an unpacked example: ``softmax(q k^T / sqrt(d) + causal)
v`` over that document's rows only, so the result equals the dense masked path up to fp32 rounding
(the masked scores are exact zeros after the softmax; only the summation order of the row sums can
differ): ``tests/test_varlen.py`` pins <= 1e-6 against the dense reference, outputs and gradients.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import paddle
import paddle.nn.functional as F

__all__ = ["document_segments", "varlen_causal_attention"]

#: (start, end, is_document) of one contiguous run of columns of a packed row
Segment = Tuple[int, int, bool]


def document_segments(start_rows) -> Optional[List[Segment]]:
    """Split one packed row's causal LTS bounds into documents and dead (padding) runs, or None.

    ``start_rows[j]`` is the first query row that must not see key column j (causal: rows < j do not
    either).  Documents: runs ``[s, e)`` whose columns all have start row ``e``.  Dead runs: columns
    with start row <= their own index (seen by no row).  Any other layout (a column visible beyond
    its run, overlapping windows, ...) returns None, and the caller keeps the general kernel.

    >>> document_segments(np.array([2, 2, 3, 3]))      # doc [0, 2), doc [2, 3), dead [3, 4)
    [(0, 2, True), (2, 3, True), (3, 4, False)]
    >>> document_segments(np.array([4, 4, 4, 4]))      # one document: plain causal attention
    [(0, 4, True)]
    >>> document_segments(np.array([3, 3, 3, 3]))      # doc [0, 3); column 3: start row 3 <= 3, seen by none
    [(0, 3, True), (3, 4, False)]
    >>> document_segments(np.array([2, 3, 3])) is None      # column 0 seen by row 1 only: not a document layout
    True
    """
    sr = np.asarray(start_rows, dtype=np.int64)
    n = sr.shape[0]
    out: List[Segment] = []
    j = 0
    while j < n:
        e = int(sr[j])
        if e <= j:  # dead column: merge consecutive ones
            k = j + 1
            while k < n and sr[k] <= k:
                k += 1
            out.append((j, k, False))
            j = k
            continue
        if e > n or not np.all(sr[j:e] == e):
            return None
        out.append((j, e, True))
        j = e
    return out


_CAUSAL_CACHE: dict = {}


def _causal_bias(n: int, dtype) -> paddle.Tensor:
    """[n, n] additive causal mask (0 on and below the diagonal, -inf above), cached per (n, dtype)."""
    key = (n, str(dtype))
    bias = _CAUSAL_CACHE.get(key)
    if bias is None:
        upper = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
        bias = paddle.to_tensor(upper).astype(dtype)
        bias.stop_gradient = True
        if len(_CAUSAL_CACHE) > 4096:  # a bounded cache: packed rows have few distinct document lengths
            _CAUSAL_CACHE.clear()
        _CAUSAL_CACHE[key] = bias
    return bias


def _split(x, lengths: List[int]):
    """x [1, h, L, d] cut along L into pieces of ``lengths`` (all of x when there is one piece)."""
    return [x] if len(lengths) == 1 else paddle.split(x, lengths, axis=2)


def varlen_causal_attention(query, key, value, segments: List[List[Segment]], scale: float):
    """Causal attention inside each document of each row.

    query [b, L, hq, d], key/value [b, L, hk, d] (hq a multiple of hk: GQA), ``segments[i]`` the
    :func:`document_segments` of row i.  Returns [b, L, hq, d]; rows of dead runs are 0.
    """
    b, seq, hq, d = query.shape
    hk = key.shape[2]
    if hk != hq:  # GQA: query head h reads kv head h // (hq // hk)
        key = paddle.repeat_interleave(key, hq // hk, axis=2)
        value = paddle.repeat_interleave(value, hq // hk, axis=2)
    q = paddle.transpose(query * scale, [0, 2, 1, 3])  # [b, hq, L, d]
    k = paddle.transpose(key, [0, 2, 1, 3])  # [b, hq, L, d]
    v = paddle.transpose(value, [0, 2, 1, 3])  # [b, hq, L, d]
    rows = []
    for i in range(b):
        parts = []
        lengths = [e - s for s, e, _ in segments[i]]
        # one split per row, not a slice per document: each slice's gradient zero-fills a whole [1, hq, L, d]
        q_docs, k_docs, v_docs = (_split(t[i : i + 1] if b > 1 else t, lengths) for t in (q, k, v))
        for (s, e, is_doc), qs, ks, vs in zip(segments[i], q_docs, k_docs, v_docs):  # [1, hq, n, d] each
            if not is_doc:
                parts.append(paddle.zeros([1, hq, e - s, d], dtype=query.dtype))  # no visible key: 0
                continue
            scores = paddle.matmul(qs, ks, transpose_y=True)  # [1, hq, n, n]
            # the bias expanded first: Paddle's CPU add is ~2x slower when one operand broadcasts
            scores = scores + _causal_bias(e - s, query.dtype).expand(scores.shape)
            parts.append(paddle.matmul(F.softmax(scores, axis=-1), vs))  # [1, hq, n, d]
        rows.append(parts[0] if len(parts) == 1 else paddle.concat(parts, axis=2))
    out = rows[0] if b == 1 else paddle.concat(rows, axis=0)  # [b, hq, L, d]
    return paddle.transpose(out, [0, 2, 1, 3])  # [b, L, hq, d]
