"""Tests for paddlenlp_ext.adapters: LoRA / rsLoRA / LoRA+ / PiSSA / VeRA / NEFTune.

Each test checks the method's math on small worked examples (standalone
Linear layers) and/or a tiny paddlenlp LlamaForCausalLM.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import paddle  # noqa: E402
import paddle.nn as nn  # noqa: E402

from paddlenlp_ext.adapters import (  # noqa: E402
    METHODS,
    AdapterConfig,
    AdapterConfigError,
    AdapterError,
    AdapterLayer,
    adapter_state_dict,
    apply_adapters,
    attach_neftune,
    compute_delta,
    count_parameters,
    group_adapter_tensors,
    iter_adapter_layers,
    load_adapter,
    load_adapter_weights,
    merge_adapters,
    randomized_svd,
    exact_svd,
    read_adapter_tensors,
    save_adapter,
    token_lengths_from_batch,
    unmerge_adapters,
    unwrap_merged,
    vera_projections,
)
from paddlenlp_ext.adapters.config import CONFIG_NAME, WEIGHTS_NAME, adapter_config_from_args  # noqa: E402
from paddlenlp_ext.adapters.vera import _projections_cached  # noqa: E402

HIDDEN = 64


# ----------------------------------------------------------------- fixtures
def tiny_llama(seed=0):
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    paddle.seed(seed)
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model


def logits(model, ids):
    out = model(input_ids=ids, return_dict=True)
    return out.logits.numpy()


def batch_ids(seed=1, shape=(2, 8)):
    rng = np.random.default_rng(seed)
    return paddle.to_tensor(rng.integers(0, 128, size=shape), dtype="int64")


def make_linear(in_f, out_f, seed=0, weight=None):
    paddle.seed(seed)
    lin = nn.Linear(in_f, out_f)
    if weight is not None:
        lin.weight.set_value(paddle.to_tensor(weight.astype(np.float32)))
    return lin


def randomize_adapters(model, seed=123, scale=0.05):
    """Give every trainable adapter tensor non-trivial values (as after training)."""
    rng = np.random.default_rng(seed)
    for _, layer in iter_adapter_layers(model):
        for p in layer.parameters():
            if not p.stop_gradient:
                p.set_value(paddle.to_tensor(rng.normal(0, scale, size=p.shape).astype(np.float32)))


# Flat config keys, built by the same function the CLI uses.
KEYS = {
    "lora": {"lora": True, "lora_rank": 4, "lora_alpha": 8},
    "rslora_plus": {"lora": True, "lora_rank": 4, "lora_alpha": 8, "rslora": True, "lora_plus_scale": 4.0},
    "pissa": {"lora": True, "lora_rank": 4, "lora_alpha": 8, "pissa": True},
    "pissa_rsvd": {"lora": True, "lora_rank": 4, "lora_alpha": 8, "pissa": True, "pissa_niter": 4},
    "vera": {"vera": True, "vera_rank": 8, "vera_seed": 7},
}
CONFIGS = {name: (lambda keys=keys: adapter_config_from_args(keys)) for name, keys in KEYS.items()}


class FakeQuantLinear(nn.Layer):
    """Stand-in for a quantized linear: int8 weight + per-column scale."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        w = lin.weight.numpy()
        scale = np.abs(w).max(axis=0) / 127.0
        self.in_features, self.out_features = w.shape
        self.register_buffer("qweight", paddle.to_tensor(np.round(w / scale).astype(np.int8)))
        self.register_buffer("scale", paddle.to_tensor(scale.astype(np.float32)))
        self.bias = lin.bias

    def dequantize_weight(self):
        return self.qweight.astype("float32") * self.scale

    def forward(self, x):
        return paddle.matmul(x, self.dequantize_weight()) + self.bias


# ------------------------------------------------------------------ config
def test_config_imports_without_paddle():
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from paddlenlp_ext.adapters.config import AdapterConfig\n"
        "from paddlenlp_ext.adapters import AdapterConfig as A2\n"
        "assert A2 is AdapterConfig\n"
        "assert 'paddle' not in sys.modules, 'paddle imported'\n"
        "print('ok')\n" % ROOT
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_config_defaults_scaling_and_validation(tmp_path):
    c = AdapterConfig()
    assert (c.method, c.r, c.alpha, c.dropout, c.lora_plus_scale, c.pissa_niter) == ("lora", 8, 16.0, 0.0, 1.0, 0)
    assert c.resolved_target_modules == [r".*layers\.\d+\..*"]
    # LoRA: alpha / r ; rsLoRA: alpha / sqrt(r)   (r=4, alpha=8 -> 2.0 vs 4.0)
    assert AdapterConfig(r=4, alpha=8).scaling == 2.0
    assert AdapterConfig(r=4, alpha=8, rslora=True).scaling == 4.0
    assert AdapterConfig(r=16).scaling == 2.0  # default alpha = 2r
    assert AdapterConfig(r=16, alpha=-1).alpha == 32.0  # PaddleNLP's "unset" value
    assert AdapterConfig(method="vera", alpha=-1).alpha is None
    assert AdapterConfig(method="vera", r=16).scaling == 1.0
    assert AdapterConfig(r=4, pissa=True).layer_type == "pissa"

    bad = [
        dict(method="dora"),
        dict(r=0),
        dict(r=2.5),
        dict(alpha=-2.0),
        dict(alpha=0),
        dict(dropout=1.0),
        dict(lora_plus_scale=0.0),
        dict(pissa_niter=-1),
        dict(method="vera", alpha=8),
        dict(method="vera", pissa=True),
        dict(method="vera", lora_plus_scale=2.0),
        dict(target_modules=["(unclosed"]),
        dict(target_modules=[]),
        dict(pissa=True, quantization={"weight_quantize_algo": "nf4"}),
    ]
    for kw in bad:
        with pytest.raises(AdapterConfigError):
            AdapterConfig(**kw)
    with pytest.raises(AdapterConfigError, match="unknown keys"):
        AdapterConfig.from_dict({"method": "lora", "lora_rnk": 4})

    c = AdapterConfig(method="lora", r=4, alpha=8, rslora=True, target_modules=[".*q_proj"], model_type="llama")
    c.save(str(tmp_path))
    assert json.load(open(tmp_path / CONFIG_NAME))["alpha"] == 8.0
    assert AdapterConfig.load(str(tmp_path)) == c

    f = adapter_config_from_args(
        {
            "lora": True,
            "lora_rank": 4,
            "pissa": True,
            "pissa_niter": 2,
            "lora_target_modules": [".*q_proj"],
            "learning_rate": 1e-4,
        }
    )
    assert (f.method, f.r, f.alpha, f.pissa, f.pissa_niter, f.target_modules) == ("lora", 4, 8.0, True, 2, [".*q_proj"])
    v = adapter_config_from_args({"vera": True, "vera_rank": 16, "lora_alpha": 32})
    assert (v.method, v.r, v.alpha) == ("vera", 16, None)
    assert adapter_config_from_args({"lora": False}) is None


# -------------------------------------------------------------------- LoRA
def test_lora_layer_math_and_init():
    in_f, out_f, r = 48, 20, 4
    lin = make_linear(in_f, out_f)
    w0 = lin.weight.numpy().copy()
    layer = METHODS["lora"](lin, AdapterConfig(r=r, alpha=8))
    a = layer.lora_A.numpy()
    # kaiming-uniform(a=sqrt(5)) on A: U(-1/sqrt(in), 1/sqrt(in)); B = 0
    assert a.shape == (in_f, r) and np.abs(a).max() <= 1 / math.sqrt(in_f) + 1e-7
    assert np.abs(a).max() > 0.5 / math.sqrt(in_f)
    assert np.all(layer.lora_B.numpy() == 0)
    assert layer.lora_A.stop_gradient is False and layer.lora_B.stop_gradient is False

    x = paddle.randn([3, 5, in_f])
    np.testing.assert_allclose(layer(x).numpy(), lin(x).numpy(), atol=0)  # identity at init

    rng = np.random.default_rng(0)
    b = rng.normal(size=(r, out_f)).astype(np.float32)
    layer.lora_B.set_value(paddle.to_tensor(b))
    xn = x.numpy()
    expect = xn @ w0 + lin.bias.numpy() + (xn @ a @ b) * 2.0  # scaling alpha/r = 8/4
    np.testing.assert_allclose(layer(x).numpy(), expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.delta_weight().numpy(), a @ b * 2.0, rtol=1e-6, atol=1e-6)

    # dropout acts on the adapter branch only, and only in training mode
    dl = METHODS["lora"](lin, AdapterConfig(r=r, alpha=8, dropout=0.5))
    dl.lora_A.set_value(paddle.to_tensor(a))
    dl.lora_B.set_value(paddle.to_tensor(b))
    dl.eval()
    np.testing.assert_allclose(dl(x).numpy(), expect, rtol=1e-5, atol=1e-5)
    dl.train()
    assert np.abs(dl(x).numpy() - expect).max() > 1e-3
    dl.lora_B.set_value(paddle.zeros([r, out_f]))
    np.testing.assert_allclose(dl(x).numpy(), lin(x).numpy(), atol=0)

    rs = METHODS["lora"](make_linear(in_f, out_f), AdapterConfig(r=r, alpha=8, rslora=True))
    assert rs.scaling == 4.0  # alpha / sqrt(r)
    rs.lora_A.set_value(paddle.to_tensor(a))
    rs.lora_B.set_value(paddle.to_tensor(b))
    np.testing.assert_allclose(rs.delta_weight().numpy(), a @ b * 4.0, rtol=1e-6, atol=1e-6)


def test_lora_plus_learning_rates_with_adamw_and_scheduler():
    ratio = 16.0
    model = tiny_llama()
    apply_adapters(model, AdapterConfig(r=4, alpha=8, lora_plus_scale=ratio))
    layers = iter_adapter_layers(model)
    for _, l in layers:
        assert l.lora_B.optimize_attr["learning_rate"] == ratio
        assert l.lora_A.optimize_attr["learning_rate"] == 1.0
    randomize_adapters(model)  # B != 0 so that A receives gradients too
    params = [p for p in model.parameters() if not p.stop_gradient]
    sched = paddle.optimizer.lr.StepDecay(learning_rate=2e-3, step_size=1, gamma=0.5)
    sched.step()  # the optimizer must use the SCHEDULED value: 1e-3
    lr = 1e-3
    opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=params, weight_decay=0.0, epsilon=1e-12)
    before = {p.name: p.numpy().copy() for p in params}
    model.train()
    ids = batch_ids()
    loss = model(input_ids=ids, labels=ids, return_dict=True).loss
    loss.backward()
    grads = {p.name: p.grad.numpy().copy() for p in params}
    opt.step()
    opt.clear_grad()
    # Adam's first update is lr_param * g / (|g| + eps) = lr_param * sign(g)
    for _, l in layers:
        for p, want in ((l.lora_A, lr), (l.lora_B, lr * ratio)):
            upd = np.abs(p.numpy() - before[p.name])
            sel = np.abs(grads[p.name]) > 1e-8
            assert sel.any()
            np.testing.assert_allclose(upd[sel], want, rtol=1e-2)


# -------------------------------------------------------------------- PiSSA
def _decaying_matrix(m, n, seed=0):
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.normal(size=(m, m)))
    v, _ = np.linalg.qr(rng.normal(size=(n, n)))
    k = min(m, n)
    s = 2.0 * 0.7 ** np.arange(k)
    return (u[:, :k] * s) @ v[:, :k].T


def test_pissa_residual_and_principal_part():
    in_f, out_f, r = 40, 24, 4
    w = _decaying_matrix(in_f, out_f).astype(np.float32)
    lin = make_linear(in_f, out_f, weight=w)
    cfg = AdapterConfig(r=r, alpha=8, pissa=True)  # s = 2
    x = paddle.randn([3, in_f])
    y0 = lin(x).numpy()
    layer = METHODS["pissa"](lin, cfg)
    s = layer.scaling
    assert s == 2.0
    a, b = layer.lora_A.numpy(), layer.lora_B.numpy()
    w_res = lin.weight.numpy()
    # residual + s*A@B == W
    assert np.abs(w_res + s * a @ b - w).max() <= 1e-5
    # s*A@B is the top-r part of W (Paddle [in,out] orientation: W = U S Vh)
    u, sv, vh = np.linalg.svd(w.astype(np.float64), full_matrices=False)
    top = (u[:, :r] * sv[:r]) @ vh[:r]
    assert np.abs(s * a @ b - top).max() <= 1e-5
    # A = U_r sqrt(S_r/s), B = sqrt(S_r/s) Vh_r: the column norms of A are sqrt(S/s)
    np.testing.assert_allclose(np.linalg.norm(a, axis=0), np.sqrt(sv[:r] / s), rtol=1e-5)
    # outputs unchanged at init, reference factors stored
    assert np.abs(layer(x).numpy() - y0).max() <= 1e-5
    np.testing.assert_array_equal(layer.pissa_A0.numpy(), a)
    np.testing.assert_array_equal(layer.pissa_B0.numpy(), b)
    assert layer.pissa_A0.stop_gradient and set(layer.adapter_state_dict()) == {
        "lora_A",
        "lora_B",
        "pissa_A0",
        "pissa_B0",
    }


def test_randomized_svd_close_to_exact():
    w = _decaying_matrix(96, 64, seed=3).astype(np.float32)
    u, s, vh = exact_svd(w, 6)
    ur, sr, vhr = randomized_svd(w, 6, niter=4)
    np.testing.assert_allclose(sr, s, rtol=1e-4)
    np.testing.assert_allclose((ur * sr) @ vhr, (u * s) @ vh, atol=1e-4)
    # through the layer
    lin_e, lin_r = make_linear(96, 64, weight=w), make_linear(96, 64, weight=w)
    le = METHODS["pissa"](lin_e, AdapterConfig(r=6, pissa=True))
    lr_ = METHODS["pissa"](lin_r, AdapterConfig(r=6, pissa=True, pissa_niter=4))
    np.testing.assert_allclose(lr_.delta_weight().numpy(), le.delta_weight().numpy(), atol=1e-4)


def test_pissa_model_outputs_unchanged_at_init():
    for key in ("pissa", "pissa_rsvd"):
        model = tiny_llama()
        ids = batch_ids()
        ref = logits(model, ids)
        apply_adapters(model, CONFIGS[key]())
        assert np.abs(logits(model, ids) - ref).max() <= 1e-5


# --------------------------------------------------------------------- VeRA
def test_vera_projections_deterministic_and_shared():
    a1, b1 = vera_projections(7, 8, 128, 128)
    _projections_cached.cache_clear()  # regenerate: a cached result compared with itself would prove nothing
    a2, b2 = vera_projections(7, 8, 128, 128)
    assert a2 is not a1
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(b1, b2)
    # defined by numpy's default_rng: A first, then B, kaiming-uniform bounds
    rng = np.random.default_rng(7)
    np.testing.assert_array_equal(a1, rng.uniform(-1 / math.sqrt(128), 1 / math.sqrt(128), (8, 128)).astype(np.float32))
    np.testing.assert_array_equal(b1, rng.uniform(-1 / math.sqrt(8), 1 / math.sqrt(8), (128, 8)).astype(np.float32))
    assert not np.array_equal(vera_projections(8, 8, 128, 128)[0], a1)

    model = tiny_llama()
    cfg = CONFIGS["vera"]()
    info = apply_adapters(model, cfg)
    assert (cfg.vera_max_in, cfg.vera_max_out) == (128, 128)
    layers = [l for _, l in iter_adapter_layers(model)]
    shared = layers[0].vera_shared
    assert all(l.vera_shared is shared for l in layers)  # one object for all layers
    assert all(l.vera_shared.A is shared.A for l in layers)
    np.testing.assert_array_equal(shared.A.numpy(), a1)
    # trainable parameters: r + out_features per adapted layer, nothing else
    for l in layers:
        trainable = [p for p in l.parameters() if not p.stop_gradient]
        assert sum(int(np.prod(p.shape)) for p in trainable) == cfg.r + l.out_features
    assert info["trainable_params"] == sum(cfg.r + l.out_features for l in layers)
    assert np.all(layers[0].vera_d.numpy() == np.float32(0.1)) and np.all(layers[0].vera_b.numpy() == 0)
    # projections are not persisted: neither in the model state dict nor the adapter state
    assert not any("vera_A" in k or "vera_B" in k or "shared" in k for k in model.state_dict())
    assert {k.rsplit(".", 1)[1] for k in adapter_state_dict(model)} == {"vera_d", "vera_b"}


def test_vera_layer_math():
    in_f, out_f, r = 24, 16, 4
    lin = make_linear(in_f, out_f)
    cfg = AdapterConfig(method="vera", r=r, vera_seed=3, vera_max_in=32, vera_max_out=40)
    layer = METHODS["vera"](lin, cfg)
    x = paddle.randn([5, in_f])
    np.testing.assert_allclose(layer(x).numpy(), lin(x).numpy(), atol=0)  # b = 0 at init
    rng = np.random.default_rng(1)
    d = rng.normal(size=r).astype(np.float32)
    bv = rng.normal(size=out_f).astype(np.float32)
    layer.vera_d.set_value(paddle.to_tensor(d))
    layer.vera_b.set_value(paddle.to_tensor(bv))
    A, B = vera_projections(3, r, 32, 40)
    As, Bs = A[:, :in_f], B[:out_f, :]  # sliced shared matrices
    # column form: h = W0 x + diag(b) B diag(d) A x
    xn = x.numpy()
    col = (np.diag(bv) @ Bs @ np.diag(d) @ As @ xn.T).T
    np.testing.assert_allclose(layer(x).numpy(), lin(x).numpy() + col, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.delta_weight().numpy(), (np.diag(bv) @ Bs @ np.diag(d) @ As).T, atol=1e-6)


def test_vera_model_unchanged_at_init_and_loss_decreases():
    model = tiny_llama()
    ids = batch_ids(shape=(2, 16))
    ref = logits(model, ids)
    apply_adapters(model, CONFIGS["vera"]())
    assert np.abs(logits(model, ids) - ref).max() == 0.0
    params = [p for p in model.parameters() if not p.stop_gradient]
    opt = paddle.optimizer.AdamW(learning_rate=1e-1, parameters=params, weight_decay=0.0)
    model.train()
    d0 = iter_adapter_layers(model)[0][1].vera_d.numpy().copy()
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids, return_dict=True).loss
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.clear_grad()
    assert losses[-1] < losses[0] - 0.05, losses
    # both vectors learn (b gets a gradient at init, then d does too)
    assert np.abs(iter_adapter_layers(model)[0][1].vera_d.numpy() - d0).max() > 0


def test_paddlenlp_vera_contrast_gets_no_gradient():
    """PaddleNLP 3.0.0b4's VeRALinear keeps a frozen all-zero vera_B, so b and d
    never receive a gradient (the defect our VeRA avoids)."""
    from paddlenlp.peft.vera.vera_layers import VeRALinear as PaddleNLPVeRA

    layer = PaddleNLPVeRA(nn.Linear(16, 8), 16, 8, r=4, vera_alpha=4)
    for n, p in layer.named_parameters():  # as in VeRAModel.mark_only_vera_as_trainable
        p.stop_gradient = not ("vera_b" in n or "vera_d" in n)
    layer(paddle.randn([3, 16])).sum().backward()
    assert np.all(layer.vera_b.grad.numpy() == 0) and np.all(layer.vera_d.grad.numpy() == 0)

    ours = METHODS["vera"](nn.Linear(16, 8), AdapterConfig(method="vera", r=4))
    ours(paddle.randn([3, 16])).sum().backward()
    assert np.abs(ours.vera_b.grad.numpy()).max() > 0


# ------------------------------------------------------------------ NEFTune
def test_token_lengths_from_batch():
    pos = np.array([[0, 1, 2, 0, 1, 0, 0, 0]])  # packed: examples of 3 and 2 tokens + 3 pads (pos 0)
    am = np.array([[1, 1, 1, 1, 1, 0, 0, 0]])
    want = [[3, 3, 3, 2, 2, 0, 0, 0]]
    np.testing.assert_array_equal(token_lengths_from_batch(position_ids=pos, attention_mask=am).numpy(), want)
    # FlashMask start-end row indices (end of each token's example, 0 on padding)
    se = np.array([3, 3, 3, 5, 5, 0, 0, 0]).reshape(1, 1, 8, 1)
    np.testing.assert_array_equal(token_lengths_from_batch(startend_row_indices=se, position_ids=pos).numpy(), want)
    # 3-D block-diagonal causal mask (PaddleNLP zero padding) without position ids
    blk = np.zeros((1, 8, 8), dtype=bool)
    blk[0, :3, :3] = np.tril(np.ones((3, 3), dtype=bool))
    blk[0, 3:5, 3:5] = np.tril(np.ones((2, 2), dtype=bool))
    np.testing.assert_array_equal(token_lengths_from_batch(attention_mask=blk[:, None]).numpy(), want)
    # pad ids; unpacked rows of different lengths
    ids = np.array([[5, 6, 7, 8, 0, 0], [5, 6, 0, 0, 0, 0]])
    np.testing.assert_array_equal(
        token_lengths_from_batch(input_ids=ids, pad_token_id=0).numpy(), [[4, 4, 4, 4, 0, 0], [2, 2, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        token_lengths_from_batch(
            attention_mask=paddle.to_tensor(ids != 0).astype("int64"), position_ids=np.tile(np.arange(6), (2, 1))
        ).numpy(),
        [[4, 4, 4, 4, 0, 0], [2, 2, 0, 0, 0, 0]],
    )
    # no padding information: the whole row is one example
    np.testing.assert_array_equal(token_lengths_from_batch(labels=np.full((1, 4), -100)).numpy(), [[4, 4, 4, 4]])
    with pytest.raises(ValueError):
        token_lengths_from_batch()


def test_neftune_noise_bound_packing_padding_and_eval():
    alpha = 5.0
    model = tiny_llama()
    emb = model.get_input_embeddings()
    hook = attach_neftune(model, alpha)
    bsz, seq = 16, 64
    ids = batch_ids(seed=4, shape=(bsz, seq))
    # packed rows: segments of 40 and 20 tokens, then 4 padding positions
    pos = np.concatenate([np.arange(40), np.arange(20), np.zeros(4, dtype=np.int64)])
    am = np.concatenate([np.ones(60), np.zeros(4)])
    lengths = token_lengths_from_batch(position_ids=np.tile(pos, (bsz, 1)), attention_mask=np.tile(am, (bsz, 1)))

    model.eval()
    clean = emb(ids).numpy()
    model.train()
    hook.set_token_lengths(lengths)
    noisy = emb(ids).numpy()
    noise = noisy - clean
    d = HIDDEN
    b40, b20 = alpha / math.sqrt(40 * d), alpha / math.sqrt(20 * d)
    seg40, seg20, pad = noise[:, :40], noise[:, 40:60], noise[:, 60:]
    assert np.abs(seg40).max() <= b40 * (1 + 1e-5) and np.abs(seg40).max() > 0.99 * b40
    assert np.abs(seg20).max() <= b20 * (1 + 1e-5) and np.abs(seg20).max() > 0.99 * b20
    assert np.all(pad == 0)  # no noise on padding
    assert abs(seg40.mean()) < 0.02 * b40 and abs(seg20.mean()) < 0.03 * b20  # Uniform(-1,1): mean 0
    np.testing.assert_allclose(np.abs(seg40 / b40).mean(), 0.5, atol=0.02)  # E|U(-1,1)| = 1/2

    # lengths are consumed: a second training forward without new lengths raises
    with pytest.raises(RuntimeError, match="token lengths"):
        emb(ids)
    hook.set_token_lengths(paddle.ones([2, 3]))
    with pytest.raises(ValueError, match="shape"):
        emb(ids)
    # no noise under no_grad (generation) nor in eval mode
    with paddle.no_grad():
        np.testing.assert_array_equal(emb(ids).numpy(), clean)
    model.eval()
    np.testing.assert_array_equal(emb(ids).numpy(), clean)
    # full model forward in training mode works with the hook
    model.train()
    small = batch_ids()
    hook.set_token_lengths(token_lengths_from_batch(input_ids=small))
    assert np.isfinite(float(model(input_ids=small, labels=small, return_dict=True).loss))
    with pytest.raises(RuntimeError, match="already attached"):
        attach_neftune(model, alpha)
    hook.remove()
    np.testing.assert_array_equal(emb(ids).numpy(), clean)  # training, no hook: no noise, no error


# ------------------------------------------------- apply / targets / errors
def test_apply_targets_freezing_and_errors():
    model = tiny_llama()
    n_total = count_parameters(model)[1]
    info = apply_adapters(model, CONFIGS["lora"]())
    names = info["adapted_modules"]
    assert len(names) == 14 and all(".layers." in n for n in names)
    assert not any("lm_head" in n or "embed" in n for n in names)
    assert info["method"] == "lora"
    lora_params = sum(4 * (l.in_features + l.out_features) for _, l in iter_adapter_layers(model))
    assert info["trainable_params"] == lora_params == count_parameters(model)[0]
    assert info["total_params"] == n_total + lora_params
    assert all(p.stop_gradient for n, p in model.named_parameters() if "lora_" not in n)
    assert isinstance(model.llama.layers[0].self_attn.q_proj, AdapterLayer)
    with pytest.raises(AdapterError, match="already"):
        apply_adapters(model, CONFIGS["lora"]())

    m2 = tiny_llama()
    info = apply_adapters(m2, AdapterConfig(r=2, target_modules=[r".*\.q_proj", r".*\.v_proj"]))
    assert info["adapted_modules"] == [
        f"llama.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")
    ]

    with pytest.raises(ValueError, match="linear modules available") as e:
        apply_adapters(tiny_llama(), AdapterConfig(r=2, target_modules=["q_proj"]))  # fullmatch: no hit
    assert "llama.layers.0.self_attn.q_proj" in str(e.value)

    class ColumnParallelLinear(nn.Layer):  # same name as the fleet class
        def __init__(self):
            super().__init__()
            self.weight = self.create_parameter([8, 8])

    m3 = tiny_llama()
    m3.llama.layers[0].self_attn.q_proj = ColumnParallelLinear()
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        apply_adapters(m3, CONFIGS["lora"]())


def test_quantized_base_forward_ok_merge_refused():
    lin = make_linear(32, 16)
    q = FakeQuantLinear(lin)
    layer = METHODS["lora"](q, AdapterConfig(r=4))
    x = paddle.randn([3, 32])
    np.testing.assert_allclose(layer(x).numpy(), q(x).numpy())
    assert layer.lora_A.shape == [32, 4]
    with pytest.raises(AdapterError, match="quantized"):
        layer.merge()
    with pytest.raises(AdapterError, match="quantized"):
        METHODS["pissa"](FakeQuantLinear(lin), AdapterConfig(r=4, pissa=True))
    vera = METHODS["vera"](FakeQuantLinear(lin), AdapterConfig(method="vera", r=4))
    assert vera(x).shape == [3, 16]


# ---------------------------------------------- merge / save / load / delta
@pytest.mark.parametrize("key", list(CONFIGS))
def test_merge_unmerge_save_load_compute_delta(key, tmp_path):
    model = tiny_llama()
    orig = {n: p.numpy().copy() for n, p in model.named_parameters()}
    ids = batch_ids()
    cfg = CONFIGS[key]()
    apply_adapters(model, cfg)
    randomize_adapters(model)
    y = logits(model, ids)

    # merge / unmerge round trip
    before = {n: l.base_layer.weight.numpy().copy() for n, l in iter_adapter_layers(model)}
    merge_adapters(model)
    assert all(l.merged for _, l in iter_adapter_layers(model))
    np.testing.assert_allclose(logits(model, ids), y, atol=1e-5)
    merged = {n: l.base_layer.weight.numpy().copy() for n, l in iter_adapter_layers(model)}
    unmerge_adapters(model)
    for n, l in iter_adapter_layers(model):
        np.testing.assert_allclose(l.base_layer.weight.numpy(), before[n], atol=1e-6)
    np.testing.assert_allclose(logits(model, ids), y, atol=1e-5)

    # save / load onto a fresh ORIGINAL base
    paths = save_adapter(model, cfg, str(tmp_path))
    assert os.path.basename(paths["weights"]) == WEIGHTS_NAME
    tensors = read_adapter_tensors(str(tmp_path))
    assert set(tensors) == set(adapter_state_dict(model))
    assert all(v.dtype == np.float32 for v in tensors.values())
    fresh = tiny_llama()
    loaded_cfg = load_adapter(fresh, str(tmp_path))
    assert loaded_cfg == cfg
    np.testing.assert_allclose(logits(fresh, ids), y, atol=1e-5)

    # resume: a model that already has (freshly initialised) adapters loads the checkpoint
    resumed = tiny_llama()
    apply_adapters(resumed, CONFIGS[key]())
    load_adapter_weights(resumed, str(tmp_path))
    np.testing.assert_allclose(logits(resumed, ids), y, atol=1e-5)

    # compute_delta from the file == what the layer's merge produces, against the ORIGINAL W
    groups = group_adapter_tensors(tensors)
    for n, _ in iter_adapter_layers(model):
        w0 = orig[f"{n}.weight"]
        delta = compute_delta(cfg.method, loaded_cfg.to_dict(), groups[n], *w0.shape)
        assert delta.shape == w0.shape and delta.dtype == np.float32
        assert np.abs(w0 + delta - merged[n]).max() <= 1e-5, n

    # unwrap_merged leaves a plain model with the original keys and same outputs
    unwrap_merged(fresh)
    assert not iter_adapter_layers(fresh)
    assert set(fresh.state_dict()) == set(orig)
    np.testing.assert_allclose(logits(fresh, ids), y, atol=1e-5)


def test_load_adapter_is_strict(tmp_path):
    from safetensors.numpy import save_file

    model = tiny_llama()
    cfg = CONFIGS["lora"]()
    apply_adapters(model, cfg)
    save_adapter(model, cfg, str(tmp_path))
    good = read_adapter_tensors(str(tmp_path))
    key = "llama.layers.0.self_attn.q_proj.lora_A"

    def write(t):
        save_file(t, str(tmp_path / WEIGHTS_NAME))

    missing = dict(good)
    missing.pop(key)
    write(missing)
    with pytest.raises(AdapterError, match=r"missing keys \['llama\.layers\.0\.self_attn\.q_proj\.lora_A'\]"):
        load_adapter(tiny_llama(), str(tmp_path))
    extra = dict(good, **{"llama.layers.0.self_attn.q_proj.lora_C": np.zeros((2, 2), np.float32)})
    write(extra)
    with pytest.raises(AdapterError, match="unexpected keys.*lora_C"):
        load_adapter(tiny_llama(), str(tmp_path))
    bad = dict(good, **{key: np.zeros((64, 5), np.float32)})
    write(bad)
    with pytest.raises(AdapterError, match=r"q_proj\.lora_A.*shape \[64, 5\]"):
        load_adapter(tiny_llama(), str(tmp_path))
    other = tiny_llama()
    apply_adapters(other, AdapterConfig(r=2))
    write(good)
    with pytest.raises(AdapterError, match="different adapter config"):
        load_adapter_weights(other, str(tmp_path))
    with pytest.raises(ValueError, match="expected tensors"):
        compute_delta("lora", cfg, {"lora_A": good[key]}, 64, 64)
