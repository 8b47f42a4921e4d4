"""RMSNorm as one autograd node with a hand-written backward (fp32, CPU-friendly), for our decoder and for
PaddleNLP's Llama/Qwen2 norms (``integrations.rms_norm`` routes those here).

Autograd of ``x.pow(2).mean(-1)`` ... ``* weight`` costs more than it should on Paddle's CPU kernels:
``pow(2)`` and its gradient are ~200x slower than ``x * x``, and the gradient of a multiply whose operand
broadcasts (``* weight``) is ~10x slower than the same product on one shape.  :class:`RMSNormFunction`::

    n = x * r,  r = rsqrt(mean(x * x) + eps),  y = n * w
    dL/dx = r * (g*w - n * mean(g*w * n))        (all [b, s, h], means over h)
    dL/dw = sum over b, s of g * n                (only when w is trained)

Within 1e-6 relative of the autograd form (``tests/test_rms_norm.py``).  Not for Paddle's non-reentrant
recompute, which gives wrong gradients through PyLayers: callers under recompute use plain autograd.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

__all__ = ["RMSNormFunction", "rms_norm"]


class RMSNormFunction(PyLayer):
    """``y = x * rsqrt(mean(x * x, -1) + eps) * weight`` with a hand-written backward (see the module)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        r = paddle.rsqrt((x * x).mean(-1, keepdim=True) + eps)  # [b, s, 1]
        n = x * r  # [b, s, h]
        ctx.save_for_backward(n, r, weight)
        return n * weight  # [b, s, h]

    @staticmethod
    def backward(ctx, g):
        n, r, weight = ctx.saved_tensor()
        gn = g * weight  # [b, s, h]
        gx = (gn - n * (gn * n).mean(-1, keepdim=True)) * r  # [b, s, h]
        if weight.stop_gradient:  # a frozen norm (LoRA, QLoRA): no weight gradient to reduce
            return gx, None
        gw = (g * n).reshape([-1, n.shape[-1]]).sum(0)  # [h]
        return gx, gw


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """RMSNorm of ``x`` [..., h] with ``weight`` [h] (fp32), through :class:`RMSNormFunction`."""
    return RMSNormFunction.apply(x, weight, float(eps))
