"""kernels/causal.py: chunked causal attention with O(seq) saved memory equals the dense masked softmax
(float64 numpy reference), outputs and the three gradients, for one chunk and several."""

import numpy as np
import paddle
import pytest

from paddlenlp_ext.kernels.causal import causal_attention


def _reference(q, k, v, g, scale):
    """float64 (out, dq, dk, dv) of causal softmax attention, q/k/v/g [b, h, s, d]."""
    q, k, v, g = (a.astype(np.float64) for a in (q, k, v, g))
    s = q.shape[2]
    scores = q @ k.transpose(0, 1, 3, 2) * scale + np.triu(np.full((s, s), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ v
    dp = g @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    return out, ds @ k, ds.transpose(0, 1, 3, 2) @ q, p.transpose(0, 1, 3, 2) @ g


@pytest.mark.parametrize("s,chunk", [(1, 4), (7, 16), (37, 16), (64, 16), (33, 32)])
def test_matches_float64_reference(s, chunk):
    rng = np.random.default_rng(s)
    q0, k0, v0, g = (rng.standard_normal((2, 3, s, 8)).astype("float32") for _ in range(4))
    q, k, v = (paddle.to_tensor(a, stop_gradient=False) for a in (q0, k0, v0))
    out = causal_attention(q, k, v, 0.35, chunk=chunk)
    (out * paddle.to_tensor(g)).sum().backward()
    got = [out.numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy()]
    for name, w, x in zip(["out", "dq", "dk", "dv"], _reference(q0, k0, v0, g, 0.35), got):
        np.testing.assert_allclose(x, w, rtol=1e-4, atol=1e-5 * max(np.abs(w).max(), 1e-3), err_msg=name)
    assert np.abs(got[3]).max() > 0.1  # a real gradient was compared


def test_keeps_only_linear_memory_for_the_backward():
    """The saved tensors are q * scale, k and v ([b, h, s, d]): no [s, s] term."""
    from paddlenlp_ext.kernels.causal import CausalAttention

    saved = []
    original = CausalAttention.forward

    def spy(ctx, *args):
        out = original(ctx, *args)
        saved.extend(t.shape for t in ctx.saved_tensor())
        return out

    CausalAttention.forward = staticmethod(spy)
    try:
        q = paddle.randn([1, 2, 40, 8])
        q.stop_gradient = False
        causal_attention(q, q, q, 0.3, chunk=16)
    finally:
        CausalAttention.forward = staticmethod(original)
    assert saved and all(shape[2] == 40 and shape[3] in (8, 1) for shape in saved)
