"""Packed-row training through PaddleNLP Llama/Qwen2 with the CPU FlashMask.

A packed row of 3 examples (+ padding) with restarting position ids and
startend indices must give the same token-mean loss and parameter gradients
as the 3 examples run one by one through the plain (non-flash) attention path.
"""

import numpy as np
import paddle
import pytest

from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from paddlenlp_ext.integrations import flashmask as flashmask_patch
from paddlenlp_ext.integrations.flashmask import (
    cpu_flashmask,
    install_cpu_flashmask,
    is_installed,
    native_flashmask_available,
    uninstall_cpu_flashmask,
)

VOCAB = 128
LENGTHS = (7, 12, 9)
PAD = 4
SEQ = sum(LENGTHS) + PAD


def tiny_config(kind, **overrides):
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        use_flash_attention=True,
    )
    common.update(overrides)
    return LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)


def build_models(kind, **overrides):
    """Same weights twice: flash (packed) and plain attention (reference)."""
    cls = LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM
    paddle.seed(1234)
    model = cls(tiny_config(kind, **overrides))
    ref = cls(tiny_config(kind, use_flash_attention=False))
    ref.set_state_dict(model.state_dict())
    model.train()
    ref.train()
    return model, ref


def make_examples(seed=0):
    rng = np.random.default_rng(seed)
    examples = []
    for n in LENGTHS:
        ids = rng.integers(1, VOCAB, size=n)
        labels = np.concatenate([ids[1:], [-100]])  # next token; none after the last
        examples.append((ids, labels))
    return examples


def pack(examples):
    """One packed row: ids, labels, position ids, startend [1, 1, SEQ] int32."""
    ids, labels, pos, lts = [], [], [], []
    start = 0
    for e_ids, e_labels in examples:
        n = len(e_ids)
        ids += list(e_ids)
        labels += list(e_labels)
        pos += list(range(n))
        lts += [start + n] * n  # columns of this example are masked from its end on
        start += n
    for j in range(PAD):  # padding: ignored labels, each pad token its own example
        ids.append(0)
        labels.append(-100)
        pos.append(j)
        lts.append(start + j + 1)
    as_t = lambda x, dt: paddle.to_tensor(np.array([x], dtype=dt))  # noqa: E731
    return (
        as_t(ids, "int64"),
        as_t(labels, "int64"),
        as_t(pos, "int64"),
        paddle.to_tensor(np.array(lts, dtype=np.int32).reshape(1, 1, -1)),
    )


def grads_of(model):
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def packed_loss_and_grads(model, examples, sri_shape=None):
    ids, labels, pos, sri = pack(examples)
    if sri_shape is not None:
        sri = sri.reshape(sri_shape)
    model.clear_gradients()
    loss = model(ids, position_ids=pos, labels=labels, attn_mask_startend_row_indices=sri)[0]
    loss.backward()
    return float(loss), grads_of(model)


def separate_loss_and_grads(ref, examples):
    """Token-mean loss over the examples run one at a time."""
    ref.clear_gradients()
    count = 0
    losses = []
    for e_ids, e_labels in examples:
        n_tok = int((e_labels != -100).sum())
        ids = paddle.to_tensor(e_ids[None])
        labels = paddle.to_tensor(e_labels[None])
        loss = ref(ids, labels=labels)[0]
        losses.append(loss * n_tok)
        count += n_tok
    total = paddle.add_n(losses) / count
    total.backward()
    return float(total), grads_of(ref)


@pytest.fixture(autouse=True)
def patched():
    with cpu_flashmask():
        yield


def assert_match(packed, separate):
    (loss_p, g_p), (loss_s, g_s) = packed, separate
    assert abs(loss_p - loss_s) <= 1e-5, (loss_p, loss_s)
    assert g_p.keys() == g_s.keys() and len(g_p) > 0
    for name in g_p:
        np.testing.assert_allclose(g_p[name], g_s[name], atol=1e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_row_matches_separate_examples(kind):
    model, ref = build_models(kind)
    examples = make_examples()
    assert_match(packed_loss_and_grads(model, examples), separate_loss_and_grads(ref, examples))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", [[1, -1], [1, 1, -1, 1]])
def test_startend_shapes_accepted(kind, shape):
    """[batch, seq] (native to fusion_ops) and the 4-D Paddle form [batch, 1, seq, 1]."""
    model, ref = build_models(kind)
    examples = make_examples(1)
    assert_match(packed_loss_and_grads(model, examples, shape), separate_loss_and_grads(ref, examples))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("granularity,reentrant", [("full", False), ("full", True), ("core_attn", False)])
def test_recompute(kind, granularity, reentrant):
    model, ref = build_models(
        kind, recompute=True, recompute_granularity=granularity, recompute_use_reentrant=reentrant
    )
    model.recompute_enable()
    examples = make_examples(2)
    assert_match(packed_loss_and_grads(model, examples), separate_loss_and_grads(ref, examples))


def test_packing_actually_isolates_examples():
    """Sanity check of the test itself: without startend indices the packed row
    attends across examples and the loss differs."""
    model, ref = build_models("llama")
    examples = make_examples()
    ids, labels, pos, _ = pack(examples)
    loss = float(model(ids, position_ids=pos, labels=labels)[0])
    assert abs(loss - separate_loss_and_grads(ref, examples)[0]) > 1e-4


def test_install_is_idempotent_local_and_nests():
    import paddle.nn.functional as F
    from paddlenlp.transformers.llama import fusion_ops

    native = F.flashmask_attention
    proxy = fusion_ops.F  # installed by the autouse fixture
    assert is_installed()
    install_cpu_flashmask()
    with cpu_flashmask():
        assert fusion_ops.F is proxy
    assert fusion_ops.F is proxy and is_installed()  # the inner context restores the outer state
    assert F.flashmask_attention is native  # the global API is untouched
    assert fusion_ops.F.flashmask_attention is flashmask_patch.flashmask_dispatch
    # SDPA goes through the dense-mask fix (sdpa_dispatch); everything else is Paddle's own
    assert fusion_ops.F.scaled_dot_product_attention is flashmask_patch.sdpa_dispatch
    assert F.scaled_dot_product_attention is not flashmask_patch.sdpa_dispatch
    assert fusion_ops.F.softmax is F.softmax
    uninstall_cpu_flashmask()
    assert fusion_ops.F is F and not is_installed()
    with cpu_flashmask():
        assert is_installed()
    assert fusion_ops.F is F and not is_installed()  # a context that installed it removes it
    install_cpu_flashmask()  # leave it as the fixture expects


@pytest.mark.parametrize(
    "available,on_device,dtype,expected",
    [
        (True, True, "bfloat16", "native"),
        (True, True, "float16", "native"),
        (True, True, "float32", "portable"),  # the native kernel has no fp32 kernel: fp32 weights without O2
        (True, False, "bfloat16", "portable"),  # CPU tensor in a GPU build
        (False, True, "bfloat16", "portable"),  # no native op / no device
    ],
)
def test_dispatch_decision(monkeypatch, available, on_device, dtype, expected):
    """The decision only (no GPU here): capability flags patched, the query's dtype real."""
    monkeypatch.setattr(flashmask_patch, "native_flashmask_available", lambda: available)
    monkeypatch.setattr(flashmask_patch, "_on_native_device", lambda x: on_device)
    q = paddle.zeros([1, 4, 2, 8], dtype=dtype)
    assert flashmask_patch.flashmask_path(q) == expected


def test_native_availability_on_this_machine():
    if not (paddle.is_compiled_with_cuda() or paddle.is_compiled_with_xpu()):
        assert native_flashmask_available() is False  # CPU wheels register the op but have no kernel
