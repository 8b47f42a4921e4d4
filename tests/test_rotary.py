"""integrations/rotary.py: the faster rotary embedding is bit-identical to PaddleNLP's, forward and
backward, on the function and through whole Llama / Qwen2 models (loss and LoRA gradients)."""

import numpy as np
import paddle
import pytest

from lora_grads import lora_model, loss_and_lora_grads, random_batch

from paddlenlp_ext.integrations import rotary


def _grads(fn, q0, k0, cos, sin, position_ids):
    q, k = q0.clone(), k0.clone()
    q.stop_gradient = k.stop_gradient = False
    qe, ke = fn(q, k, cos, sin, position_ids)
    ((qe * q0).sum() + (ke * k0 * 3.0).sum()).backward()  # non-uniform upstream gradients
    return [t.numpy() for t in (qe, ke, q.grad, k.grad)]


@pytest.mark.parametrize("module", ["llama", "qwen2"])
@pytest.mark.parametrize("positions", ["ids", "packed", "none"])
def test_function_is_bitwise_equal_with_gradients(module, positions):
    import importlib

    theirs = importlib.import_module(f"paddlenlp.transformers.{module}.modeling").apply_rotary_pos_emb
    paddle.seed(3)
    b, s, h, kvh, d = 2, 7, 4, 2, 16  # GQA: k has fewer heads
    q0, k0 = paddle.randn([b, s, h, d]), paddle.randn([b, s, kvh, d])
    cos, sin = paddle.randn([1, 32, 1, d]), paddle.randn([1, 32, 1, d])  # [1, max_pos, 1, d] cache
    if positions == "ids":
        position_ids = paddle.arange(s).unsqueeze(0).expand([b, s]) + 5
    elif positions == "packed":  # positions restart inside the row
        position_ids = paddle.to_tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]])
    else:
        position_ids = None
    want = _grads(theirs, q0, k0, cos, sin, position_ids)
    got = _grads(rotary.apply_rotary_pos_emb, q0, k0, cos, sin, position_ids)
    for w, g in zip(want, got):
        assert np.array_equal(w, g)
    assert np.abs(want[2]).max() > 0  # the comparison saw real gradients


def test_context_installs_and_restores():
    from paddlenlp.transformers.llama import modeling as llama

    before = llama.apply_rotary_pos_emb
    with rotary.fast_rotary():
        assert rotary.is_installed()
        with rotary.fast_rotary():  # nested: the inner block restores nothing it did not install
            pass
        assert rotary.is_installed()
    assert llama.apply_rotary_pos_emb is before and not rotary.is_installed()


def _loss_and_grads(model_dir, patched):
    model = lora_model(model_dir)
    inputs = {
        **random_batch(2, 12, 4),
        "position_ids": paddle.to_tensor([list(range(12)), list(range(5)) + list(range(7))]),
    }
    return loss_and_lora_grads(model, inputs, rotary.fast_rotary() if patched else None)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_dir"])
def test_whole_model_loss_and_lora_gradients_are_bitwise_equal(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    loss0, g0 = _loss_and_grads(model_dir, patched=False)
    loss1, g1 = _loss_and_grads(model_dir, patched=True)
    assert loss0 == loss1
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        assert np.array_equal(g0[name], g1[name]), name
