"""lm_head + cross-entropy summed over tokens, in chunks of tokens, never holding the [T, V] logits.

The plain way, ``F.cross_entropy(rows @ W, targets, reduction="sum")``, keeps the softmax ``[T, V]``
for the backward and then allocates its gradient ``[T, V]`` beside it: at 600 supervised tokens and
a 32k vocabulary that is 77 MB each in fp32 (5x that for Qwen's 152k), on top of every layer's
activations, at the very moment they peak (the start of the backward).  :class:`LinearCrossEntropy`
walks the tokens in chunks of ``chunk`` rows and, since the loss is a sum, computes each chunk's
gradient right away (the fused linear cross-entropy of Liger-Kernel, with Paddle ops)::

    logits_c = rows_c @ W                     [c, V]
    loss    += sum(logsumexp(logits_c) - logits_c[target])
    dlogit_c = softmax(logits_c) - onehot(target)
    drows_c  = dlogit_c @ W^T                 [c, H]   (kept: T x H in all)
    dW      += rows_c^T @ dlogit_c            (only when W is trained)

The backward multiplies the kept gradients by the upstream scalar.  FLOPs are those of the plain
way (one [T, H] x [H, V] product forward, one per gradient), and only ``chunk x V`` floats are alive
at a time.  Results equal ``F.cross_entropy`` within fp32 rounding (``tests/test_linear_cross_entropy.py``).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

__all__ = ["LinearCrossEntropy", "linear_cross_entropy_sum", "DEFAULT_CHUNK"]

#: token rows per chunk: the transient logits are chunk x vocab floats (16 MB at a 32k vocabulary)
DEFAULT_CHUNK = 128


class LinearCrossEntropy(PyLayer):
    """Sum over tokens of cross_entropy(rows @ W (or W^T), targets): rows [T, H], W [H, V] ([V, H] with
    ``transpose_y``), targets [T] int64 -> [] (see the module)."""

    @staticmethod
    def forward(ctx, rows, weight, targets, transpose_y: bool, chunk: int):
        need_rows, need_weight = not rows.stop_gradient, not weight.stop_gradient
        total = paddle.zeros([], dtype=paddle.float32)
        drows, dweight = [], None
        for lo in range(0, rows.shape[0], chunk):
            hi = min(lo + chunk, rows.shape[0])
            rows_c, target_c = rows[lo:hi], targets[lo:hi]
            logits = paddle.matmul(rows_c, weight, transpose_y=transpose_y).astype("float32")  # [c, V]
            lse = paddle.logsumexp(logits, axis=-1)  # [c]
            picked = paddle.take_along_axis(logits, target_c.unsqueeze(-1), axis=-1).squeeze(-1)  # [c]
            total = total + (lse - picked).sum()
            if not (need_rows or need_weight):
                continue
            dlogits = F.softmax(logits, axis=-1)  # [c, V]
            del logits  # at most two [c, V] tensors alive
            # softmax - onehot(target): subtract 1 at each row's target, in place
            dlogits.put_along_axis_(
                target_c.unsqueeze(-1), paddle.to_tensor(-1.0, dtype=dlogits.dtype), -1, reduce="add"
            )
            dlogits = dlogits.astype(rows.dtype)
            if need_rows:  # [c, H]
                drows.append(paddle.matmul(dlogits, weight, transpose_y=not transpose_y))
            if need_weight:  # [H, V] (or [V, H])
                part = (
                    paddle.matmul(dlogits, rows_c, transpose_x=True)
                    if transpose_y
                    else paddle.matmul(rows_c, dlogits, transpose_x=True)
                )
                dweight = part if dweight is None else dweight + part
        ctx.grads = (paddle.concat(drows, axis=0) if drows else None, dweight)
        return total

    @staticmethod
    def backward(ctx, g):
        drows, dweight = ctx.grads
        ctx.grads = None  # the kept gradients are used once
        scale = g.astype("float32")
        return (
            None if drows is None else drows * scale.astype(drows.dtype),
            None if dweight is None else dweight * scale.astype(dweight.dtype),
            None,
        )


def linear_cross_entropy_sum(
    rows, weight, targets, transpose_y: bool = False, chunk: int = DEFAULT_CHUNK
) -> paddle.Tensor:
    """Sum of the cross-entropies of ``rows @ weight`` at ``targets`` (float32 []), chunked (see the module)."""
    return LinearCrossEntropy.apply(rows, weight, targets, bool(transpose_y), int(chunk))
