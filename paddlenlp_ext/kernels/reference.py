"""Dense references for flashmask attention (tests and bench/attention.py).

Deliberately independent of the kernel modules of this package: the mask is a
literal port of the ``flashmask_to_densemask`` loop in Paddle's
flashmask_attention docstring, and attention is plain
softmax(Q K^T / sqrt(d) + M) V.  O(seq^2) memory: for checking only.
"""

import math

import numpy as np
import paddle

__all__ = ["docstring_dense_mask", "reference_attention"]


def docstring_dense_mask(sri, causal):
    """Port of Paddle's flashmask_to_densemask: bool [b, h, s, s], True = masked."""
    sri = np.asarray(sri)
    bz, num_head, seq_len, bound_num = sri.shape
    m = np.zeros((bz, num_head, seq_len, seq_len), dtype=bool)
    has_end = (causal and bound_num == 2) or ((not causal) and bound_num == 4)
    for bi in range(bz):
        for hi in range(num_head):
            for j in range(seq_len):
                downstart = sri[bi, hi, j, 0]
                if has_end:
                    m[bi, hi, downstart : sri[bi, hi, j, 1], j] = True
                else:
                    m[bi, hi, downstart:, j] = True
                if causal:
                    m[bi, hi, :j, j] = True
                elif has_end:
                    m[bi, hi, sri[bi, hi, j, 2] : sri[bi, hi, j, 3], j] = True
                else:
                    m[bi, hi, : sri[bi, hi, j, 1], j] = True
    return m


def reference_attention(q, k, v, masked):
    """softmax(Q K^T / sqrt(d) + M) V with GQA; rows with no visible key give 0.

    q [b, sq, hq, d], k/v [b, sk, hk, d] -> [b, sq, hq, d].
    masked: bool numpy [b, 1 | hq | hk, sq, sk] (True = masked) or None.
    """
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    g = hq // hk
    qt = q.transpose([0, 2, 1, 3])  # [b, hq, sq, d]
    kt = paddle.repeat_interleave(k, g, axis=2).transpose([0, 2, 1, 3])  # [b, hq, sk, d]
    vt = paddle.repeat_interleave(v, g, axis=2).transpose([0, 2, 1, 3])
    s = paddle.matmul(qt, kt, transpose_y=True) / math.sqrt(d)  # [b, hq, sq, sk]
    if masked is None:
        return paddle.matmul(paddle.nn.functional.softmax(s, -1), vt).transpose([0, 2, 1, 3])
    if masked.shape[1] not in (1, hq):  # per kv-head bounds -> per q head
        masked = np.repeat(masked, g, axis=1)
    visible = paddle.to_tensor(~masked)
    # A finite fill keeps fully masked rows NaN-free; multiplying by `visible`
    # then zeroes them (elsewhere exp(-1e30 - max) is already exactly 0).
    s = paddle.where(visible, s, paddle.full_like(s, -1e30))
    p = paddle.nn.functional.softmax(s, -1) * visible.astype(s.dtype)
    return paddle.matmul(p, vt).transpose([0, 2, 1, 3])
