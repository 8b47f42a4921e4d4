"""integrations/rms_norm.py: the one-node RMSNorm matches PaddleNLP's Llama / Qwen2 RMSNorm (and a
float64 numpy reference) forward and backward, frozen or trained weight, and through whole models."""

import importlib

import numpy as np
import paddle
import pytest

from lora_grads import lora_model, loss_and_lora_grads, random_batch

from paddlenlp_ext.integrations import rms_norm


def _numpy_reference(x, w, g, eps):
    """float64 (y, dL/dx, dL/dw) of y = x / sqrt(mean(x^2) + eps) * w with upstream gradient g."""
    x, w, g = (a.astype(np.float64) for a in (x, w, g))
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    n = x * r
    gn = g * w
    gx = r * (gn - n * (gn * n).mean(-1, keepdims=True))
    return n * w, gx, (g * n).reshape(-1, x.shape[-1]).sum(0)


def _run(fn, x0, w0, g, trained_weight):
    x = paddle.to_tensor(x0, stop_gradient=False)
    w = paddle.to_tensor(w0, stop_gradient=not trained_weight)
    y = fn(x, w)
    (y * paddle.to_tensor(g)).sum().backward()
    return y.numpy(), x.grad.numpy(), (w.grad.numpy() if trained_weight else None)


@pytest.mark.parametrize("trained_weight", [False, True])
def test_function_matches_float64_reference(trained_weight):
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((2, 5, 64)).astype("float32") * 3
    w0 = rng.standard_normal(64).astype("float32")
    g = rng.standard_normal((2, 5, 64)).astype("float32")  # non-uniform upstream gradient
    y, gx, gw = _run(lambda x, w: rms_norm.rms_norm(x, w, 1e-6), x0, w0, g, trained_weight)
    ry, rgx, rgw = _numpy_reference(x0, w0, g, 1e-6)
    np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, rgx, rtol=1e-4, atol=1e-5)
    if trained_weight:
        np.testing.assert_allclose(gw, rgw, rtol=1e-4, atol=1e-5)
    assert np.abs(gx).max() > 0.1  # a real gradient was compared


@pytest.mark.parametrize("module,cls", [("llama", "LlamaRMSNorm"), ("qwen2", "Qwen2RMSNorm")])
def test_patched_layer_matches_paddlenlps(module, cls):
    """The same layer, PaddleNLP's forward vs ours: outputs and both gradients within 1e-6 relative."""
    from paddlenlp.transformers import LlamaConfig

    layer_cls = getattr(importlib.import_module(f"paddlenlp.transformers.{module}.modeling"), cls)
    paddle.seed(1)
    layer = layer_cls(LlamaConfig(hidden_size=48, rms_norm_eps=1e-5))
    layer.weight.set_value(paddle.randn([48]))
    rng = np.random.default_rng(1)
    x0 = rng.standard_normal((3, 7, 48)).astype("float32")
    g = rng.standard_normal((3, 7, 48)).astype("float32")

    def run_layer():
        layer.clear_gradients()
        x = paddle.to_tensor(x0, stop_gradient=False)
        y = layer(x)
        (y * paddle.to_tensor(g)).sum().backward()
        return y.numpy(), x.grad.numpy(), layer.weight.grad.numpy()

    theirs = run_layer()
    with rms_norm.fast_rms_norm():
        assert rms_norm.is_installed()
        ours = run_layer()
    assert not rms_norm.is_installed()
    for t, o in zip(theirs, ours):
        np.testing.assert_allclose(o, t, rtol=1e-5, atol=1e-6)


def test_context_nests_and_restores():
    from paddlenlp.transformers.llama.modeling import LlamaRMSNorm

    before = LlamaRMSNorm.forward
    with rms_norm.fast_rms_norm():
        with rms_norm.fast_rms_norm():  # nested: the inner block restores nothing it did not install
            pass
        assert rms_norm.is_installed()
    assert LlamaRMSNorm.forward is before and not rms_norm.is_installed()


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_dir"])
def test_whole_model_loss_and_lora_gradients_match(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    inputs = random_batch(2, 12, 4)
    loss0, g0 = loss_and_lora_grads(lora_model(model_dir), dict(inputs))
    loss1, g1 = loss_and_lora_grads(lora_model(model_dir), dict(inputs), rms_norm.fast_rms_norm())
    assert abs(loss1 - loss0) <= 1e-6 * abs(loss0)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        np.testing.assert_allclose(g1[name], g0[name], rtol=1e-4, atol=1e-7, err_msg=name)
