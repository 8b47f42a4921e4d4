"""The decoder's fp32 training attention (``attention._RecomputedProbsAttention``): it keeps q/k/v instead of
the [B, H, Lq, Lk] probabilities and recomputes them in the backward; output and gradients must be those of
autograd through the same dense ops.  And the experts' fused SwiGLU equals ``silu(gate) * up``."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddlenlp_ext.models.decoder.attention import MaskPlan, _repeat_kv, attend
from paddlenlp_ext.models.decoder.moe_experts import SwiGLUExpert


def _reference(q, k, v, plan, scale, window):
    """The dense path by plain autograd: softmax(q k^T * scale + mask) v, [B, Lq, H * D]."""
    b, lq, h, d = q.shape
    rep = h // k.shape[2]
    qt = q.transpose([0, 2, 1, 3])
    kt = _repeat_kv(k, rep).transpose([0, 2, 1, 3])
    vt = _repeat_kv(v, rep).transpose([0, 2, 1, 3])
    probs = F.softmax(paddle.matmul(qt, kt, transpose_y=True) * scale + plan.additive(window), axis=-1)
    return paddle.matmul(probs, vt).transpose([0, 2, 1, 3]).reshape([b, lq, h * d])


def _run(fn, scale=0.125, window=None):
    paddle.seed(0)
    q, k, v = paddle.randn([2, 9, 4, 8]), paddle.randn([2, 9, 2, 8]), paddle.randn([2, 9, 2, 8])  # GQA 4 / 2
    for t in (q, k, v):
        t.stop_gradient = False
    mask = paddle.ones([2, 9], "int64")
    mask[1, :3] = 0  # left padding in the second row
    plan = MaskPlan(2, 9, 0, attention_mask=mask)
    out = fn(q, k, v, plan, scale, window)
    (out * paddle.linspace(-1.0, 1.0, out.shape[-1])).sum().backward()  # a loss that weighs every output
    return [t.numpy() for t in (out, q.grad, k.grad, v.grad)]


@pytest.fixture
def recompute_all(monkeypatch):
    """Every training attention takes the memory-saving paths, however small (the tests' shapes are tiny)."""
    from paddlenlp_ext.models.decoder import attention

    monkeypatch.setattr(attention, "KEEP_PROBS_UP_TO", 0)
    calls = {"recomputed": 0}
    real = attention._RecomputedProbsAttention.apply

    def counted(*a):
        calls["recomputed"] += 1
        return real(*a)

    monkeypatch.setattr(attention._RecomputedProbsAttention, "apply", counted)
    return calls


@pytest.mark.parametrize("window", [None, 4])
def test_recomputed_attention_equals_autograd_through_the_dense_ops(window, recompute_all):
    ours = _run(lambda q, k, v, plan, scale, w: attend(q, k, v, plan, scale, window=w), window=window)
    assert recompute_all["recomputed"] == 1
    ref = _run(_reference, window=window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=name)
    # negative control: another scale changes the gradients far beyond the tolerance
    other = _run(_reference, scale=0.2, window=window)
    assert np.abs(other[1] - ref[1]).max() > 1e-2


@pytest.mark.parametrize("keep", [False, True])
def test_frozen_query_gets_no_gradient(monkeypatch, keep):
    from paddlenlp_ext.models.decoder import attention

    monkeypatch.setattr(attention, "KEEP_PROBS_UP_TO", 2**21 if keep else 0)
    paddle.seed(0)
    q, k, v = paddle.randn([1, 5, 2, 4]), paddle.randn([1, 5, 2, 4]), paddle.randn([1, 5, 2, 4])
    k.stop_gradient = v.stop_gradient = False  # q frozen, k/v trained
    attend(q, k, v, MaskPlan(1, 5, 0), 0.5).sum().backward()
    assert q.grad is None and k.grad is not None and v.grad is not None


def test_fused_swiglu_expert_equals_silu_times_up():
    paddle.seed(0)
    expert = SwiGLUExpert(16, 24)
    assert expert.fused_swiglu
    x = paddle.randn([7, 16])
    plain = expert.down_proj(F.silu(expert.gate_proj(x)) * expert.up_proj(x))
    np.testing.assert_allclose(expert(x).numpy(), plain.numpy(), rtol=0, atol=1e-6)
    assert not SwiGLUExpert(16, 24, act="gelu").fused_swiglu  # other activations keep act(gate) * up


def _run_unpadded(fn, mask):
    paddle.seed(1)
    q, k, v = paddle.randn([2, 300, 4, 8]), paddle.randn([2, 300, 2, 8]), paddle.randn([2, 300, 2, 8])
    for t in (q, k, v):
        t.stop_gradient = False
    plan = MaskPlan(2, 300, 0, attention_mask=mask)
    out = fn(q, k, v, plan, 0.125, None)
    (out * paddle.linspace(-1.0, 1.0, out.shape[-1])).sum().backward()
    return [t.numpy() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("mask", ["none", "ones", "padded"])
def test_unpadded_causal_rows_take_the_chunked_causal_kernel(monkeypatch, mask, recompute_all):
    """No mask, or a padding mask with no padding: kernels.causal (query chunks over their keys only, 300 tokens
    = two chunks) with the dense ops' output and gradients; a padded row keeps the masked dense path."""
    from paddlenlp_ext.models.decoder import attention

    calls = []
    real = attention.causal_attention
    monkeypatch.setattr(attention, "causal_attention", lambda *a: calls.append(1) or real(*a))
    masks = {"none": None, "ones": paddle.ones([2, 300], "int64"), "padded": paddle.ones([2, 300], "int64")}
    if mask == "padded":
        masks[mask][1, :5] = 0
    ours = _run_unpadded(lambda q, k, v, plan, scale, w: attend(q, k, v, plan, scale), masks[mask])
    ref = _run_unpadded(_reference, masks[mask])
    assert len(calls) == (0 if mask == "padded" else 1)
    assert recompute_all["recomputed"] == (1 if mask == "padded" else 0)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("interleaved", [False, True])
def test_lean_rotary_is_bitwise_autograd(interleaved):
    """The lean rotary (expanded tables, one roll, hand-written backward) gives autograd's values bit for bit."""
    from paddlenlp_ext.models.decoder.layers import apply_rotary

    paddle.seed(2)
    angles = paddle.rand([1, 6, 1, 8]) * 10
    cos, sin = angles.cos(), angles.sin()
    results = []
    for lean in (True, False):
        x = paddle.randn([1, 6, 3, 8])
        x.stop_gradient = False
        y = apply_rotary(x, cos, sin, interleaved, lean=lean)
        (y * paddle.linspace(-1.0, 1.0, 8)).sum().backward()
        results.append((y.numpy(), x.grad.numpy()))
        paddle.seed(2)
        paddle.rand([1, 6, 1, 8])  # the same x in both runs
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("trained", [False, True])
def test_lean_rms_norm_matches_autograd(trained):
    """The decoder's one-node RMSNorm (outside recompute) agrees with its autograd form within 1e-6; a frozen
    weight gets no gradient, a trained one the same gradient."""
    from paddlenlp_ext.models.decoder.layers import Norm

    norm = Norm(16, 1e-6)
    norm.weight.set_value(paddle.linspace(0.5, 1.5, 16))
    norm.weight.stop_gradient = not trained
    out = {}
    for lean in (True, False):
        paddle.seed(3)
        x = paddle.randn([2, 5, 16]) * 3
        x.stop_gradient = False
        norm.weight.clear_gradient() if trained else None
        y = norm(x, lean)
        (y * paddle.linspace(-1.0, 1.0, 16)).sum().backward()
        out[lean] = (y.numpy(), x.grad.numpy(), None if not trained else norm.weight.grad.numpy())
    for a, b in zip(out[True], out[False]):
        if a is None:
            assert b is None
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert (norm.weight.grad is None) == (not trained)


def test_small_attention_keeps_its_probabilities_large_recomputes_them(monkeypatch):
    """Below KEEP_PROBS_UP_TO numbers of probabilities, plain autograd (faster: nothing recomputed); above it
    the memory-saving paths; the same output and gradients either way."""
    from paddlenlp_ext.models.decoder import attention

    calls = []
    real = attention._RecomputedProbsAttention.apply
    monkeypatch.setattr(attention._RecomputedProbsAttention, "apply", lambda *a: calls.append(1) or real(*a))
    results = {}
    for limit in (2 * 4 * 9 * 9, 2 * 4 * 9 * 9 - 1):  # the test batch's probabilities: exactly 648 numbers
        monkeypatch.setattr(attention, "KEEP_PROBS_UP_TO", limit)
        results[limit] = _run(lambda q, k, v, plan, scale, w: attend(q, k, v, plan, scale))
    assert calls == [1]  # only the run whose limit is below the 648
    for a, b in zip(*results.values()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
