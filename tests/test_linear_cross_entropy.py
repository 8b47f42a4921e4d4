"""kernels/linear_cross_entropy.py: the chunked lm_head + cross-entropy sum equals F.cross_entropy on the
whole logits (value, row gradient, weight gradient; plain and tied/transposed weight; one chunk and
several), and training/loss.py takes it for plain heads with the same loss and LoRA gradients."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from lora_grads import lora_model, random_batch

from paddlenlp_ext.kernels.linear_cross_entropy import linear_cross_entropy_sum


def _plain(rows, weight, targets, transpose_y):
    logits = paddle.matmul(rows, weight, transpose_y=transpose_y)
    return F.cross_entropy(logits, targets.unsqueeze(-1), reduction="sum")


@pytest.mark.parametrize("transpose_y", [False, True])
@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("train_weight", [False, True])
def test_matches_whole_logits(transpose_y, chunk, train_weight):
    rng = np.random.default_rng(chunk)
    t, h, v = 21, 16, 50
    rows0 = rng.standard_normal((t, h)).astype("float32")
    w0 = rng.standard_normal((v, h) if transpose_y else (h, v)).astype("float32")
    targets = paddle.to_tensor(rng.integers(0, v, t))
    results = []
    for fn in (
        lambda r, w: _plain(r, w, targets, transpose_y),
        lambda r, w: linear_cross_entropy_sum(r, w, targets, transpose_y, chunk=chunk),
    ):
        rows = paddle.to_tensor(rows0, stop_gradient=False)
        weight = paddle.to_tensor(w0, stop_gradient=not train_weight)
        loss = fn(rows, weight)
        (loss * 0.37).backward()  # a non-unit upstream gradient
        results.append((float(loss), rows.grad.numpy(), weight.grad.numpy() if train_weight else None))
    (l0, r0, w0g), (l1, r1, w1g) = results
    assert abs(l1 - l0) <= 1e-5 * abs(l0)
    np.testing.assert_allclose(r1, r0, rtol=1e-4, atol=1e-6)
    if train_weight:
        np.testing.assert_allclose(w1g, w0g, rtol=1e-4, atol=1e-6)
    assert np.abs(r0).max() > 1e-3


def test_no_gradient_when_nothing_is_trained():
    rows, weight = paddle.randn([5, 8]), paddle.randn([8, 11])
    with paddle.no_grad():
        loss = linear_cross_entropy_sum(rows, weight, paddle.to_tensor([0, 3, 10, 2, 2]))
    want = _plain(rows, weight, paddle.to_tensor([0, 3, 10, 2, 2]), False)
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_dir"])
def test_training_loss_takes_the_chunked_head_with_the_same_result(fixture, request, monkeypatch):
    from paddlenlp_ext.models import heads
    from paddlenlp_ext.training import loss as loss_mod

    model_dir = request.getfixturevalue(fixture)
    inputs = random_batch(2, 12, 4)

    def run(chunked):
        if not chunked:
            monkeypatch.setattr(loss_mod, "plain_head_weight", lambda head: None)
        model = lora_model(model_dir)
        assert heads.plain_head_weight(model.lm_head) is not None
        loss = loss_mod.global_token_loss(model, dict(inputs), 16, 1, 1)
        loss.backward()
        monkeypatch.undo()
        return float(loss), {n: p.grad.numpy() for n, p in model.named_parameters() if not p.stop_gradient}

    used = []
    real = loss_mod.linear_cross_entropy_sum
    monkeypatch.setattr(loss_mod, "linear_cross_entropy_sum", lambda *a: used.append(1) or real(*a))
    l1, g1 = run(True)
    assert used
    l0, g0 = run(False)
    assert abs(l1 - l0) <= 1e-6 * abs(l0) and g0.keys() == g1.keys() and g0
    for name in g0:
        np.testing.assert_allclose(g1[name], g0[name], rtol=1e-4, atol=1e-7, err_msg=name)
