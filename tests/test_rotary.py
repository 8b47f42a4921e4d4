"""integrations/rotary.py: the faster rotary embedding is bit-identical to PaddleNLP's, forward and
backward, on the function and through whole Llama / Qwen2 models (loss and LoRA gradients)."""

import numpy as np
import paddle
import pytest

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
    from paddlenlp.transformers import AutoModelForCausalLM

    from paddlenlp_ext.adapters.api import apply_adapters
    from paddlenlp_ext.adapters.config import AdapterConfig
    from paddlenlp_ext.training.loss import global_token_loss

    paddle.seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    apply_adapters(model, AdapterConfig(method="lora", r=4, alpha=8))
    for name, p in model.named_parameters():  # B != 0 so that A's gradient is not trivially 0
        if name.endswith("lora_B"):
            p.set_value(paddle.full(p.shape, 0.01, p.dtype))
    model.train()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 200, (2, 12)))
    labels = ids.clone()
    labels[:, :4] = -100
    inputs = {"input_ids": ids, "labels": labels, "position_ids": paddle.to_tensor([list(range(12)),
                                                                                    list(range(5)) + list(range(7))])}
    if patched:
        with rotary.fast_rotary():
            loss = global_token_loss(model, inputs, 16, 1, 1)
    else:
        loss = global_token_loss(model, inputs, 16, 1, 1)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if not p.stop_gradient}
    return float(loss), grads


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_dir"])
def test_whole_model_loss_and_lora_gradients_are_bitwise_equal(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    loss0, g0 = _loss_and_grads(model_dir, patched=False)
    loss1, g1 = _loss_and_grads(model_dir, patched=True)
    assert loss0 == loss1
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        assert np.array_equal(g0[name], g1[name]), name
