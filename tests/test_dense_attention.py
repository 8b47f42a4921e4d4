"""integrations/dense_attention.py: Llama's dense-mask attention without the broadcast add and the
``* 1`` pass gives bitwise the same outputs and gradients as PaddleNLP's (packed / padded masks); an
unpadded causal mask goes to kernels/causal.py (within 1e-5); every other call defers to PaddleNLP."""

import contextlib
from unittest import mock

import numpy as np
import paddle
import pytest

from lora_grads import lora_model, loss_and_lora_grads, random_batch

from paddlenlp_ext.integrations import dense_attention


def _config(**kw):
    from paddlenlp.transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, **kw)


def _masks(kind, b, s):
    from paddlenlp.transformers.llama.modeling import LlamaModel

    if kind == "causal":
        return LlamaModel._prepare_decoder_attention_mask(paddle.ones([b, s], dtype="int64"), (b, s), 0, "float32")
    keep = np.zeros([b, 1, s, s], dtype=bool)  # packed rows: block-diagonal lower triangles
    for row, cuts in enumerate([[0, 3, 7, s], [0, s]][:b]):
        for lo, hi in zip(cuts, cuts[1:]):
            keep[row, 0, lo:hi, lo:hi] = np.tril(np.ones([hi - lo, hi - lo], dtype=bool))
    return LlamaModel._prepare_decoder_attention_mask(paddle.to_tensor(keep), (b, s), 0, "float32")


def _run(fn, q0, k0, v0, mask, config):
    q, k, v = q0.clone(), k0.clone(), v0.clone()
    for t in (q, k, v):
        t.stop_gradient = False
    out = fn(q, config, k, v, mask, False)
    (out * paddle.arange(out.size, dtype="float32").reshape(out.shape).sin()).sum().backward()
    return [t.numpy() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("kind", ["causal", "packed"])
def test_equal_to_paddlenlp_forward_and_backward(kind, monkeypatch):
    """Packed masks: bitwise.  The unpadded causal mask: the O(seq)-memory kernel, within 1e-5 relative."""
    from paddlenlp.transformers.llama import modeling

    from paddlenlp_ext.kernels import causal

    paddle.seed(1)
    b, s, h, d = 2, 11, 4, 16
    q0, k0, v0 = (paddle.randn([b, s, h, d]) for _ in range(3))
    mask = _masks(kind, b, s)
    config = _config()
    want = _run(modeling.scaled_dot_product_attention, q0, k0, v0, mask, config)
    used = []
    monkeypatch.setattr(dense_attention, "CAUSAL_KERNEL_FROM", 2)
    monkeypatch.setattr(
        dense_attention, "causal_attention", lambda *a: used.append(1) or causal.causal_attention(*a, chunk=4)
    )  # chunks of 4 rows: the multi-chunk backward is exercised
    with dense_attention.fast_dense_attention():
        got = _run(dense_attention.scaled_dot_product_attention, q0, k0, v0, mask, config)
    assert bool(used) == (kind == "causal")
    for w, g in zip(want, got):
        assert w.shape == g.shape
        if kind == "causal":
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
        else:
            assert np.array_equal(w, g)
    assert np.abs(want[1]).max() > 0


def test_short_causal_rows_keep_the_dense_path():
    from paddlenlp.transformers.llama import modeling

    paddle.seed(2)
    q0, k0, v0 = (paddle.randn([1, 9, 4, 16]) for _ in range(3))
    mask, config = _masks("causal", 1, 9), _config()
    want = _run(modeling.scaled_dot_product_attention, q0, k0, v0, mask, config)
    with dense_attention.fast_dense_attention():
        got = _run(dense_attention.scaled_dot_product_attention, q0, k0, v0, mask, config)
    assert dense_attention.CAUSAL_KERNEL_FROM > 9 and all(np.array_equal(w, g) for w, g in zip(want, got))


def test_plain_causal_check():
    assert dense_attention.is_plain_causal(_masks("causal", 2, 9))
    assert not dense_attention.is_plain_causal(_masks("packed", 2, 11))
    from paddlenlp.transformers.llama.modeling import LlamaModel

    padded = paddle.to_tensor([[1, 1, 1, 1, 0, 0]])  # a right-padded row is not plain causal
    assert not dense_attention.is_plain_causal(LlamaModel._prepare_decoder_attention_mask(padded, (1, 6), 0, "float32"))


def test_other_calls_go_to_paddlenlp(monkeypatch):
    calls = []
    with dense_attention.fast_dense_attention():
        monkeypatch.setitem(dense_attention._STATE, "original", lambda *a, **k: calls.append(a) or "theirs")
        q = paddle.randn([1, 5, 4, 16])
        assert dense_attention.scaled_dot_product_attention(q, _config(), q, q, None, False) == "theirs"  # no mask
        mask = _masks("causal", 1, 5)
        assert dense_attention.scaled_dot_product_attention(q, _config(), q, q, mask, True) == "theirs"  # weights
        assert (
            dense_attention.scaled_dot_product_attention(q.astype("bfloat16"), _config(), q, q, mask, False) == "theirs"
        )
    assert len(calls) == 3 and not dense_attention.is_installed()


def test_whole_model_loss_and_lora_gradients_are_bitwise_equal(tiny_model_dir):
    def loss_and_grads(patched):
        with dense_attention.fast_dense_attention() if patched else contextlib.nullcontext():
            model = lora_model(tiny_model_dir)
        inputs = {
            **random_batch(2, 11, 3),
            "attention_mask": _masks("packed", 2, 11) == 0,
            "position_ids": paddle.to_tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3], list(range(11))]),
        }
        return loss_and_lora_grads(model, inputs)

    calls = []
    original = dense_attention.scaled_dot_product_attention

    def counting(*a, **k):
        calls.append(1)
        return original(*a, **k)

    loss0, g0 = loss_and_grads(False)
    with mock.patch.object(dense_attention, "scaled_dot_product_attention", counting):
        loss1, g1 = loss_and_grads(True)
    assert calls, "the model did not call the patched attention"
    assert loss0 == loss1 and g0.keys() == g1.keys() and g0
    for name in g0:
        assert np.array_equal(g0[name], g1[name]), name
