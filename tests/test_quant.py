"""Tests for paddlenlp_ext.quant (quantized frozen base linears for QLoRA)."""

import doctest
import os
import subprocess
import sys
from statistics import NormalDist

import numpy as np
import paddle
import pytest

import paddlenlp_ext.quant as Q
from paddlenlp_ext.quant import (
    FP4_CODE,
    NF4_CODE,
    SUPPORTED_ALGOS,
    QuantizedLinear,
    dequantize,
    quantize,
    quantize_model,
    quantized_state_bytes,
)
from paddlenlp_ext.quant import formats as F
from paddlenlp_ext.quant import linear as L

ALGO_DQ = [(a, False) for a in SUPPORTED_ALGOS] + [("nf4", True), ("fp4", True)]


def _w(in_f, out_f, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((in_f, out_f)).astype(np.float32) * scale
    w[3, 2] = 0.0  # exact zero
    w[:, 1] *= 20.0  # one outlier column
    return w


def _linear(in_f, out_f, bias=True, seed=0):
    lin = paddle.nn.Linear(in_f, out_f, bias_attr=None if bias else False)
    lin.weight.set_value(paddle.to_tensor(_w(in_f, out_f, seed, 0.05)))
    if bias:
        lin.bias.set_value(paddle.to_tensor(np.linspace(-1, 1, out_f).astype(np.float32)))
    return lin


# --------------------------------------------------------------- code books
def test_nf4_code_exact_values():
    expected = [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ]  # fmt: skip
    assert NF4_CODE.dtype == np.float32 and NF4_CODE.shape == (16,)
    assert NF4_CODE.tolist() == np.array(expected, dtype=np.float32).tolist()
    # independent derivation (QLoRA appendix): N(0,1) quantiles, 8 positive / 7 negative + exact 0
    offset, inv = 0.9677083, NormalDist().inv_cdf
    pos = [inv(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    neg = [-inv(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    v = np.array(sorted(pos + neg + [0.0]))
    np.testing.assert_allclose(NF4_CODE, v / np.abs(v).max(), atol=1e-6)
    assert np.all(np.diff(NF4_CODE) > 0)


def test_fp4_code_exact_values():
    assert FP4_CODE.dtype == np.float32 and FP4_CODE.shape == (16,)
    raw = [0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3]
    assert FP4_CODE.tolist() == (np.array(raw, np.float64) / 12.0).astype(np.float32).tolist()
    # derive from the bit layout s|e1 e0|m, exponent bias 3, exponent 0 subnormal
    for idx in range(16):
        s, e, m = idx >> 3, (idx >> 1) & 3, idx & 1
        mag = (0.0625 if m else 0.0) if e == 0 else 2.0 ** (-e + 4) * (1.5 if m else 1.0)
        assert FP4_CODE[idx] == np.float32((-mag if s else mag) / 12.0), idx
    assert np.signbit(FP4_CODE[8]) and FP4_CODE[8] == 0.0  # code 8 is -0


def test_code_book_half_gaps():
    assert F._max_half_gap(NF4_CODE) == pytest.approx((1.0 - 0.6961928009986877) / 2, abs=1e-7)
    assert F._max_half_gap(FP4_CODE) == pytest.approx((1.0 - 8 / 12) / 2, abs=1e-7)


def test_formats_doctests():
    res = doctest.testmod(F, optionflags=doctest.ELLIPSIS)
    assert res.attempted >= 10 and res.failed == 0


# ------------------------------------------------------------------ packing
def test_pack_unpack_round_trip():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(7, 10), dtype=np.uint8)
    packed = F.pack_nibbles(codes)
    assert packed.shape == (7, 5) and packed.dtype == np.uint8
    assert np.array_equal(F.unpack_nibbles(packed), codes)
    assert packed[0, 0] == (codes[0, 0] << 4) | codes[0, 1]  # first element in the high nibble
    with pytest.raises(ValueError):
        F.pack_nibbles(np.zeros((2, 3), np.uint8))


def test_int4_signed_nibbles_round_trip():
    # per column absmax 7 -> scale 1 -> codes equal the integers
    vals = np.array([[-7, -3, 0, 1, 5, 7]], dtype=np.float32).T  # [in=6, out=1]
    w = np.concatenate([vals, -vals], axis=1)  # [6, 2]
    s = quantize(w, "weight_only_int4")
    assert s["quant_weight"].shape == (2, 3) and s["quant_weight"].dtype == np.uint8
    np.testing.assert_array_equal(s["quant_scale"], [1.0, 1.0])
    np.testing.assert_array_equal(dequantize(s), w)


# -------------------------------------------------------------- error bound
@pytest.mark.parametrize("algo", ["weight_only_int8", "weight_only_int4"])
def test_int_error_within_half_scale(algo):
    w = _w(96, 40)
    s = quantize(w, algo)
    qmax = 127 if algo == "weight_only_int8" else 7
    scale = np.abs(w).max(axis=0) / qmax  # per output column
    np.testing.assert_allclose(s["quant_scale"], scale, rtol=1e-6)
    err = np.abs(dequantize(s) - w)
    assert np.all(err <= scale[None, :] / 2 * (1 + 1e-5) + 1e-7)
    # absmax is represented exactly (up to float rounding)
    np.testing.assert_allclose(np.abs(dequantize(s)).max(axis=0), np.abs(w).max(axis=0), rtol=1e-6)


@pytest.mark.parametrize("algo,block", [("nf4", 64), ("fp4", 64), ("nf4", 32), ("fp4", 128)])
def test_blockwise_error_within_half_max_gap(algo, block):
    w = _w(256, 24, seed=2)
    s = quantize(w, algo, block_size=block)
    code = NF4_CODE if algo == "nf4" else FP4_CODE
    half_gap = np.max(np.diff(np.unique(code.astype(np.float64)))) / 2
    # blocks run along in_features for every output channel
    absmax = np.abs(w.T.reshape(24, 256 // block, block)).max(axis=2)  # [out, nblk]
    np.testing.assert_array_equal(s["quant_scale"], absmax.astype(np.float32))
    bound = np.repeat(half_gap * absmax, block, axis=1).T  # [in, out]
    err = np.abs(dequantize(s) - w)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-7)
    assert np.all(err <= F.max_abs_error_bound(s) * (1 + 1e-5) + 1e-7)
    # zeros stay zero, block absmax is exact
    assert dequantize(s)[3, 2] == 0.0
    np.testing.assert_allclose(np.abs(dequantize(s)).max(axis=0), np.abs(w).max(axis=0), rtol=1e-6)


def test_nearest_code_is_chosen():
    x = np.linspace(-1, 1, 1001)
    for code in (NF4_CODE, FP4_CODE):
        idx = F._nearest_code(x, code)
        best = np.min(np.abs(x[:, None] - code[None, :].astype(np.float64)), axis=1)
        np.testing.assert_allclose(np.abs(x - code[idx]), best, atol=1e-7)


@pytest.mark.parametrize("algo", ["nf4", "fp4"])
def test_double_quant_reduces_bytes_and_stays_bounded(algo):
    w = _w(512, 160, seed=3)  # 1280 blocks of 64 -> 5 double-quant blocks of 256
    s1 = quantize(w, algo)
    s2 = quantize(w, algo, double_quant=True)
    assert s2["qquant_scale"].dtype == np.int8 and s2["qquant_scale"].shape == (160, 8)
    assert s2["double_quant_scale"].shape == (5,) and s2["quant_scale_offset"].shape == ()
    assert F.structure_nbytes(s2) < F.structure_nbytes(s1)
    # the scales themselves: |c - c_dq| <= double_quant_scale / 2, with the mean removed
    c, cdq = s1["quant_scale"].reshape(-1), F.block_scales(s2).reshape(-1)
    half = np.repeat(s2["double_quant_scale"], 256)[: c.size] / 2
    assert np.all(np.abs(c - cdq) <= half * (1 + 1e-5) + 1e-6)
    assert float(s2["quant_scale_offset"]) == pytest.approx(float(c.mean()), rel=1e-6)
    # weights: half max gap * absmax + scale error
    err = np.abs(dequantize(s2) - w)
    assert np.all(err <= F.max_abs_error_bound(s2) * (1 + 1e-5) + 1e-6)
    # and it is barely worse than single quantization
    e1 = np.abs(dequantize(s1) - w).mean()
    assert err.mean() < 1.05 * e1


def test_double_quant_tail_block():
    w = _w(128, 3, seed=4)  # 6 block scales < one double-quant block of 256
    s = quantize(w, "nf4", double_quant=True)
    assert s["double_quant_scale"].shape == (1,)
    assert np.all(np.abs(dequantize(s) - w) <= F.max_abs_error_bound(s) * (1 + 1e-5) + 1e-6)


def test_bytes_per_parameter():
    in_f = out_f = 1024
    n = in_f * out_f
    w = _w(in_f, out_f, seed=5)
    bpp = {
        "nf4+dq": F.structure_nbytes(quantize(w, "nf4", double_quant=True)) / n,
        "nf4": F.structure_nbytes(quantize(w, "nf4")) / n,
        "fp4+dq": F.structure_nbytes(quantize(w, "fp4", double_quant=True)) / n,
        "int4": F.structure_nbytes(quantize(w, "weight_only_int4")) / n,
        "int8": F.structure_nbytes(quantize(w, "weight_only_int8")) / n,
    }
    assert bpp["nf4+dq"] <= 0.54 and bpp["fp4+dq"] <= 0.54
    assert bpp["int4"] <= 0.55
    assert bpp["int8"] <= 1.05
    assert bpp["nf4"] == pytest.approx(0.5 + 4 / 64)
    assert bpp["nf4+dq"] == pytest.approx(0.5 + 1 / 64 + 4 * 64 / n + 4 / n)
    # the layer reports the same numbers
    lin = paddle.nn.Linear(in_f, out_f)
    lin.weight.set_value(paddle.to_tensor(w))
    q = QuantizedLinear.from_linear(lin, "nf4", double_quant=True)
    assert q.quantized_nbytes() / n == pytest.approx(bpp["nf4+dq"])


# ---------------------------------------------------------- bad arguments
def test_unknown_algo_errors():
    w = _w(64, 8)
    for fn in (
        lambda: quantize(w, "int3"),
        lambda: QuantizedLinear.from_linear(_linear(64, 8), "nf5"),
        lambda: quantize_model(paddle.nn.Sequential(paddle.nn.Linear(64, 8)), "llm.int8"),
    ):
        with pytest.raises(ValueError, match="unknown weight_quantize_algo .*supported"):
            fn()


def test_bad_shape_errors_name_the_layer_shape():
    with pytest.raises(ValueError, match=r"in_features=96, out_features=8.*divisible by weight_blocksize=64.*e\.g\. 32"):
        quantize(_w(96, 8), "nf4")
    with pytest.raises(ValueError, match=r"in_features=33, out_features=8.*even"):
        quantize(_w(33, 8), "weight_only_int4")
    with pytest.raises(ValueError, match="in_features=96"):
        QuantizedLinear.from_linear(_linear(96, 8), "fp4", block_size=64)
    with pytest.raises(ValueError, match="positive even"):
        quantize(_w(64, 8), "nf4", block_size=7)
    with pytest.raises(ValueError, match="only defined for nf4/fp4"):
        quantize(_w(64, 8), "weight_only_int8", double_quant=True)
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.zeros((4, 4, 4), np.float32), "nf4")
    # int8 takes any shape; nf4 with a block size that divides in_features works
    quantize(_w(33, 8), "weight_only_int8")
    quantize(_w(96, 8), "nf4", block_size=32)


def test_weight_only_backend_unavailable_on_cpu():
    if L.weight_only_supported()[0]:
        pytest.skip("GPU weight-only kernels available")
    with pytest.raises(RuntimeError, match="paddle_weight_only.*unavailable"):
        QuantizedLinear.from_linear(_linear(64, 16), "weight_only_int8", backend="paddle_weight_only")
    with pytest.raises(ValueError, match="only supports"):
        QuantizedLinear.from_linear(_linear(64, 8), "nf4", backend="paddle_weight_only")
    with pytest.raises(ValueError, match="in_features % 64 == 0"):
        QuantizedLinear.from_linear(_linear(48, 8), "weight_only_int8", backend="paddle_weight_only")
    assert L.weight_only_shape_ok(4096, 11008) and not L.weight_only_shape_ok(4096, 30)
    # auto falls back to the portable layout
    assert QuantizedLinear.from_linear(_linear(64, 8), "weight_only_int8").backend == "portable"


@pytest.mark.parametrize("algo", ["weight_only_int8", "weight_only_int4"])
def test_weight_only_gpu_path_wiring(monkeypatch, algo):
    """The GPU weight-only path cannot run here; check its argument wiring with a fake kernel.

    Paddle's CPU ``weight_quantize(arch=80)`` produces the real GPU layout; the fake
    ``weight_only_linear`` checks dtypes/shapes and computes with the reference weight.
    """
    lin = _linear(128, 32)
    w_ref = paddle.to_tensor(lin.weight.numpy())
    calls = []

    def fake_wol(x, weight, bias=None, weight_scale=None, weight_dtype="int8", arch=None, group_size=-1):
        calls.append(weight_dtype)
        assert weight.dtype == paddle.int8 and arch == 80
        assert weight_dtype == ("int8" if algo == "weight_only_int8" else "int4")
        assert list(weight.shape) == ([32, 128] if weight_dtype == "int8" else [16, 128])
        assert weight_scale.dtype == x.dtype and list(weight_scale.shape) == [32]
        assert bias is None or bias.dtype == x.dtype
        out = paddle.matmul(x.astype("float32"), w_ref)
        return (out + bias.astype("float32") if bias is not None else out).astype(x.dtype)

    monkeypatch.setattr(L, "weight_only_supported", lambda: (True, ""))
    monkeypatch.setattr(L, "_cuda_arch", lambda: 80)
    monkeypatch.setattr(L, "_on_gpu", lambda t: True)
    monkeypatch.setattr(paddle.nn.quant, "weight_only_linear", fake_wol)
    q = QuantizedLinear.from_linear(lin, algo)  # auto -> paddle_weight_only ("GPU" weight)
    assert q.backend == "paddle_weight_only" and q.quant_weight.dtype == paddle.int8
    assert q.quant_scale.dtype == paddle.bfloat16  # fp32 weight quantized as bf16 on SM80
    x = paddle.randn([3, 128])
    y16 = q(x.astype("float16"))
    assert q.last_path == L.PATH_WEIGHT_ONLY and y16.dtype == paddle.float16
    np.testing.assert_allclose(y16.astype("float32").numpy(), (x @ w_ref + lin.bias).numpy(), atol=2e-2, rtol=1e-2)
    # float32 input: weight_dequantize (no CPU kernel here -> exact I @ W fallback) + matmul
    y32 = q(x)
    assert q.last_path == L.PATH_WEIGHT_DEQUANT and y32.dtype == paddle.float32
    np.testing.assert_allclose(y32.numpy(), (x @ w_ref + lin.bias).numpy(), atol=5e-2, rtol=1e-2)  # bf16 W
    assert list(q.dequantize_weight().shape) == [128, 32]
    assert set(q.state_dict()) == {"bias", "quant_weight", "quant_scale"}
    assert len(calls) >= 3
    with pytest.raises(ValueError, match="to_structure needs the portable layout"):
        q.to_structure()


@pytest.mark.parametrize("algo,dq", [("nf4", False), ("fp4", True)])
def test_paddleslim_path_wiring(monkeypatch, algo, dq):
    """nf4/fp4 on GPU use PaddleSlim's ``dequant_blockwise(input, code, abs_max, blocksize, quant_type)``.

    The fake below follows that kernel's contract (flat blocks of ``blocksize`` elements,
    high nibble first, output ``[2 * numel, 1]`` float32) to check our buffers fit it.
    """

    class FakeOps:
        @staticmethod
        def dequant_blockwise(inp, code, abs_max, blocksize, quant_type):
            assert code is None and quant_type == algo and inp.dtype == paddle.uint8
            assert abs_max.dtype == paddle.float32 and len(abs_max.shape) == 1
            flat = F.unpack_nibbles(inp.numpy().reshape(-1))
            vals = F.code_book(quant_type)[flat] * np.repeat(abs_max.numpy(), blocksize)
            return paddle.to_tensor(vals.reshape(-1, 1).astype(np.float32))

    lin = _linear(128, 24)
    q = QuantizedLinear.from_linear(lin, algo, block_size=32, double_quant=dq)
    x = paddle.randn([5, 128])
    ref = q(x).numpy()
    monkeypatch.setattr(L, "_PADDLESLIM_CHECKED", True)
    monkeypatch.setattr(L, "_PADDLESLIM_OPS", FakeOps)
    monkeypatch.setattr(L, "_on_gpu", lambda t: True)
    x.stop_gradient = False
    y = q(x)
    assert q.last_path == L.PATH_PADDLESLIM
    np.testing.assert_allclose(y.numpy(), ref, atol=1e-5)
    y.sum().backward()
    assert x.grad is not None


# ------------------------------------------------------------ QuantizedLinear
@pytest.mark.parametrize("algo,dq", ALGO_DQ)
@pytest.mark.parametrize("bias", [True, False])
def test_quantized_linear_forward_matches_dequantized(algo, dq, bias):
    lin = _linear(128, 48, bias=bias)
    w_ref = lin.weight.numpy().copy()
    q = QuantizedLinear.from_linear(lin, algo, block_size=64, double_quant=dq)
    assert (q.in_features, q.out_features) == (128, 48)
    x = paddle.randn([2, 5, 128])
    y = q(x)
    w = q.dequantize_weight()
    assert list(w.shape) == [128, 48] and w.dtype == paddle.float32
    ref = paddle.matmul(x, w) + (lin.bias if bias else 0.0)
    np.testing.assert_allclose(y.numpy(), ref.numpy(), atol=1e-5, rtol=0)
    # paddle-side dequantization == numpy reference
    np.testing.assert_allclose(w.numpy(), dequantize(quantize(w_ref, algo, 64, dq)), atol=1e-6, rtol=0)
    np.testing.assert_allclose(dequantize(q.to_structure()), w.numpy(), atol=1e-6, rtol=0)
    assert q.last_path == L.PATH_PORTABLE


@pytest.mark.parametrize("algo,dq", [("nf4", True), ("weight_only_int4", False), ("weight_only_int8", False)])
def test_gradient_flows_to_input_only(algo, dq):
    lin = _linear(64, 32)
    q = QuantizedLinear.from_linear(lin, algo, double_quant=dq)
    x = paddle.randn([4, 64])
    x.stop_gradient = False
    dy = paddle.randn([4, 32])
    (q(x) * dy).sum().backward()
    expected = paddle.matmul(dy, q.dequantize_weight(), transpose_y=True)
    np.testing.assert_allclose(x.grad.numpy(), expected.numpy(), atol=1e-5)
    assert [p for p in q.parameters() if not p.stop_gradient] == []
    for name, buf in q.named_buffers():
        assert buf.stop_gradient and buf.grad is None, name
    assert q.bias.grad is None


def test_no_full_precision_copy_and_buffers_in_state_dict():
    lin = _linear(64, 32)
    q = QuantizedLinear.from_linear(lin, "nf4", double_quant=True)
    assert not hasattr(q, "weight")
    sd = q.state_dict()
    assert set(sd) == {"bias", "quant_weight", "qquant_scale", "double_quant_scale", "quant_scale_offset"}
    assert sd["quant_weight"].dtype == paddle.uint8 and list(sd["quant_weight"].shape) == [32, 32]
    float_elems = sum(int(np.prod(t.shape)) for k, t in sd.items() if t.dtype == paddle.float32)
    assert float_elems < 64 * 32 / 8  # only bias + scales are float
    q2 = QuantizedLinear.from_linear(_linear(64, 32), "weight_only_int8")
    assert set(q2.state_dict()) == {"bias", "quant_weight", "quant_scale"}


@pytest.mark.parametrize("algo,dq", [("nf4", True), ("fp4", False), ("weight_only_int4", False)])
def test_save_load_into_skeleton(tmp_path, algo, dq):
    q = QuantizedLinear.from_linear(_linear(128, 16), algo, double_quant=dq)
    path = os.path.join(tmp_path, "q.pdparams")
    paddle.save(q.state_dict(), path)
    skel = QuantizedLinear(128, 16, algo, double_quant=dq, bias_attr=True)
    skel.set_state_dict(paddle.load(path))
    x = paddle.randn([3, 128])
    np.testing.assert_allclose(skel(x).numpy(), q(x).numpy(), atol=1e-6)


def test_recompute_and_autocast():
    from paddle.distributed.fleet.utils import recompute

    q = QuantizedLinear.from_linear(_linear(64, 32), "nf4", double_quant=True)
    x = paddle.randn([4, 64])
    x.stop_gradient = False
    y = recompute(q, x)
    y.sum().backward()
    g1 = x.grad.numpy().copy()
    x.clear_gradient()
    q(x).sum().backward()
    np.testing.assert_allclose(g1, x.grad.numpy(), atol=1e-6)
    with paddle.amp.auto_cast(dtype="bfloat16", level="O1"):
        y2 = q(x)
    np.testing.assert_allclose(y2.astype("float32").numpy(), q(x).numpy(), rtol=2e-2, atol=2e-2)


def test_adapter_interface_attributes():
    q = QuantizedLinear.from_linear(_linear(64, 32), "nf4")
    assert callable(q.dequantize_weight) and q.compute_dtype == "float32"
    assert "algo=nf4" in repr(q) and "block_size=64" in repr(q)


# ----------------------------------------------------------- quantize_model
def _tiny_llama(seed=0):
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(seed)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model


def _loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out[0] if isinstance(out, tuple) else out.loss


def _logits(model, ids):
    with paddle.no_grad():
        out = model(input_ids=ids)
    return (out[0] if isinstance(out, (tuple, list)) else out.logits).numpy()


# measured relative logit errors on this model: int8 0.004, nf4 0.061, int4 0.075, fp4 0.081
@pytest.mark.parametrize("algo,dq,loss_tol,logit_tol", [
    ("weight_only_int8", False, 5e-4, 0.01), ("weight_only_int4", False, 5e-3, 0.12),
    ("nf4", False, 5e-3, 0.1), ("nf4", True, 5e-3, 0.1), ("fp4", True, 5e-3, 0.12),
])  # fmt: skip
def test_quantize_model_tiny_llama(algo, dq, loss_tol, logit_tol):
    model = _tiny_llama()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 128, (2, 16)))
    with paddle.no_grad():
        ref = float(_loss(model, ids))
    ref_logits = _logits(model, ids)
    emb_before = model.llama.embed_tokens.weight.numpy().copy()
    stats = quantize_model(model, algo, block_size=64, double_quant=dq)
    names = [n for n, l in model.named_sublayers() if isinstance(l, QuantizedLinear)]
    assert stats["layers_replaced"] == 14 == len(names)
    assert all(".layers." in n for n in names)
    assert not any(isinstance(l, paddle.nn.Linear) and ".layers." in n for n, l in model.named_sublayers())
    assert stats["params"] == 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
    assert stats["bytes_before"] == 4 * stats["params"]
    assert stats["bytes_after"] == quantized_state_bytes(model)
    assert stats["bytes_per_param"] == pytest.approx(stats["bytes_after"] / stats["params"])
    assert stats["path"] == [L.PATH_PORTABLE]
    # embeddings / lm_head untouched
    np.testing.assert_array_equal(model.llama.embed_tokens.weight.numpy(), emb_before)
    logits = _logits(model, ids)
    assert np.linalg.norm(logits - ref_logits) / np.linalg.norm(ref_logits) < logit_tol
    loss = _loss(model, ids)
    assert np.isfinite(float(loss))
    assert abs(float(loss) - ref) < loss_tol
    # gradients flow through every quantized layer down to the embeddings
    loss.backward()
    g = model.llama.embed_tokens.weight.grad
    assert g is not None and float(g.abs().sum()) > 0
    for n, l in model.named_sublayers():
        if isinstance(l, QuantizedLinear):
            assert l.last_path == L.PATH_PORTABLE and l.quant_weight.grad is None


def test_quantize_model_target_modules_and_bad_shape_is_atomic():
    model = _tiny_llama()
    stats = quantize_model(model, "nf4", target_modules=[r".*mlp\.(gate|up)_proj"])
    assert stats["layers_replaced"] == 4
    assert all(n.endswith(("gate_proj", "up_proj")) for n in stats["replaced"])
    model2 = _tiny_llama()
    before = [n for n, l in model2.named_sublayers() if type(l) is paddle.nn.Linear]
    # down_proj has in_features=128 -> fine; block 48 does not divide 64
    with pytest.raises(ValueError, match=r"layer 'llama\.layers\.0\.self_attn\.q_proj'.*in_features=64"):
        quantize_model(model2, "nf4", block_size=48)
    after = [n for n, l in model2.named_sublayers() if type(l) is paddle.nn.Linear]
    assert before == after  # nothing was replaced
    with pytest.raises(ValueError, match="invalid regular expression"):
        quantize_model(_tiny_llama(), "nf4", target_modules=["("])
    with pytest.raises(ValueError, match="only defined for nf4/fp4"):
        quantize_model(_tiny_llama(), "weight_only_int4", double_quant=True)


def test_formats_import_does_not_import_paddle():
    code = "import sys, paddlenlp_ext.quant as q; q.quantize; assert 'paddle' not in sys.modules, 'paddle imported'"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert Q.SUPPORTED_ALGOS == ("weight_only_int8", "weight_only_int4", "nf4", "fp4")
