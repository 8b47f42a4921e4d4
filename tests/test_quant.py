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
)
from paddlenlp_ext.models.quantize import quantize_model, quantized_state_bytes
from paddlenlp_ext.quant import codec as C
from paddlenlp_ext.quant import dispatch as D
from paddlenlp_ext.quant import encode as E
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
    assert C._max_half_gap(NF4_CODE) == pytest.approx((1.0 - 0.6961928009986877) / 2, abs=1e-7)
    assert C._max_half_gap(FP4_CODE) == pytest.approx((1.0 - 8 / 12) / 2, abs=1e-7)


@pytest.mark.parametrize("module,examples", [(F, 8), (C, 14)], ids=["formats", "codec"])
def test_doctests(module, examples):
    res = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert res.attempted >= examples and res.failed == 0


# ------------------------------------------------------------- format table
def test_format_table_matches_what_is_stored():
    """Each table entry against what quantize stores and what Paddle's own weight_quantize returns."""
    from paddlenlp_ext.config.schema import QUANT_ALGOS  # config keeps its own paddle-free copy

    assert SUPPORTED_ALGOS == tuple(F.FORMATS) == QUANT_ALGOS
    assert F.BLOCK_ALGOS == ("nf4", "fp4") and F.INT_ALGOS == ("weight_only_int8", "weight_only_int4")
    w = _w(128, 32)
    for name, fmt in F.FORMATS.items():
        s = quantize(w, name)
        assert s["quant_weight"].dtype == fmt.code_dtype and s["quant_weight"].shape == (32, 128 * fmt.bits // 8)
        assert s["quant_scale"].shape == ((32, 128 // fmt.default_block_size) if fmt.blockwise else (32,))
        assert (fmt.code is None) == (fmt.bits == 8)
        if fmt.gpu_kernel == F.KERNEL_WEIGHT_ONLY:
            # bits -> Paddle's weight-only layout [out * bits / 8, in] (CPU weight_quantize, arch=80)
            qw, _ = paddle.nn.quant.weight_quantize(paddle.to_tensor(w).astype("float16"), algo=name, arch=80)
            assert list(qw.shape) == [32 * fmt.bits // 8, 128] and fmt.kernel_weight_dtype == f"int{fmt.bits}"
        else:
            assert fmt.gpu_kernel == F.KERNEL_DEQUANT_BLOCKWISE and fmt.kernel_weight_dtype is None
    with pytest.raises(ValueError, match="unknown weight_quantize_algo 'int3'; supported"):
        F.get_format("int3")


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
    assert np.all(err <= C.max_abs_error_bound(s) * (1 + 1e-5) + 1e-7)
    # zeros stay zero, block absmax is exact
    assert dequantize(s)[3, 2] == 0.0
    np.testing.assert_allclose(np.abs(dequantize(s)).max(axis=0), np.abs(w).max(axis=0), rtol=1e-6)


def test_nearest_code_is_chosen():
    x = np.linspace(-1, 1, 1001).astype(np.float32)
    for code in (NF4_CODE, FP4_CODE):
        idx = E.nearest_code(x, code)
        best = np.min(np.abs(x[:, None].astype(np.float64) - code[None, :].astype(np.float64)), axis=1)
        np.testing.assert_allclose(np.abs(x - code[idx]), best, atol=1e-7)


# ------------------------------------- vectorized encoders == a straightforward reference
def _ref_nearest(v, code):
    """Nearest code index of each float32 value: float64 distances, ties to the smaller code value."""
    order = np.argsort(code, kind="stable")  # fp4's -0 and 0 are one value: the first index (0.0) wins
    vals = code[order].astype(np.float64)
    keep = np.concatenate([[True], np.diff(vals) > 0])
    vals, order = vals[keep], order[keep]
    d = np.abs(np.asarray(v, np.float32).astype(np.float64)[:, None] - vals[None, :])
    return order[np.argmin(d, axis=1)]  # argmin: the first (smaller) of two equal distances


def _ref_quantize(w, algo, bs):
    """quantize's codes and scales, one output channel and one block at a time (docs/qlora.md)."""
    fmt = F.get_format(algo)
    wt = np.asarray(w, np.float32).T  # [out, in]
    out_f, in_f = wt.shape
    if not fmt.blockwise:
        scale = (np.abs(wt).max(axis=1) / np.float32(fmt.qmax)).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
        q = np.clip(np.rint(wt / safe[:, None]), -fmt.qmax, fmt.qmax).astype(np.int8)
        return (q if fmt.bits == 8 else F.pack_nibbles((q & 0x0F).astype(np.uint8))), scale
    nblk = -(-in_f // bs)
    idx = np.zeros((out_f, 2 * -(-in_f // 2)), np.uint8)
    idx[:, in_f:] = _ref_nearest([0.0], fmt.code)  # an odd `in` pads its last byte with the code of 0
    scales = np.zeros((out_f, nblk), np.float32)
    for o in range(out_f):
        for k in range(nblk):
            blk = wt[o, k * bs : (k + 1) * bs]
            a = np.abs(blk).max()
            scales[o, k] = a
            idx[o, k * bs : k * bs + blk.size] = _ref_nearest(blk / (a if a > 0 else np.float32(1.0)), fmt.code)
    return F.pack_nibbles(idx), scales


def _hard_weight(in_f, out_f, algo, seed=0):
    """Random weights plus the cases that break encoders: exact midpoints and their float32 neighbours,
    ties of rint, zeros, negative zeros, all-zero and all-negative-zero blocks, subnormals, huge scales."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((in_f, out_f)).astype(np.float32)
    w[:, 1] *= 1e30
    w[:, 2] *= 1e-30
    w[:, 3] = 0.0
    w[:, 4] = -0.0
    w[::3, 5] = -0.0
    w[:, 6] = np.float32(1e-45) * rng.integers(-3, 4, in_f)  # subnormals
    code = F.get_format(algo).code
    if code is not None and F.get_format(algo).blockwise:
        vals = np.unique(code.astype(np.float64))
        mids = (vals[:-1] + vals[1:]) / 2
        m32 = mids.astype(np.float32)
        edge = np.concatenate([m32, np.nextafter(m32, np.float32(2)), np.nextafter(m32, np.float32(-2)), -m32])
        for c in (7, 8):  # absmax 1 (v == w) and 2 (exact power-of-two scaling)
            col = np.resize(edge * (c - 6), in_f).astype(np.float32)
            col[::16] = c - 6  # every block (16 or more long) holds its absmax
            w[:, c] = col
    else:  # ties of rint: absmax 127 * 2^k gives power-of-two scales, w / s lands on k + 0.5
        w[:, 7] = np.resize(np.arange(-63.5, 64.0, 1.0, dtype=np.float32), in_f)
        w[0, 7] = 127.0
    return w


@pytest.mark.parametrize("algo", SUPPORTED_ALGOS)
@pytest.mark.parametrize(
    "shape,bs",
    [
        ((128, 24), 16),
        ((256, 40), 64),
        ((512, 9), 256),
        ((64, 1100), 64),
        ((176, 24), 64),
        ((175, 10), 16),
        ((30, 12), 64),
    ],
)
def test_encoders_are_bit_identical_to_the_reference(algo, shape, bs):
    fmt = F.get_format(algo)
    if fmt.bits == 4 and not fmt.blockwise and shape[0] % 2:
        pytest.skip("int4 needs an even in_features")
    w = _hard_weight(*shape, algo)
    got = E.quantize_blockwise(fmt, w, bs) if fmt.blockwise else E.quantize_per_channel(fmt, w)
    ref = _ref_quantize(w, algo, bs)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert g.tobytes() == r.tobytes(), np.argwhere(g != r)[:5].tolist()


def test_encoders_work_in_tiles(monkeypatch):
    """Small tiles: many row/column tiles and a short last tile in both directions, same bytes."""
    w = _hard_weight(200, 70, "nf4", seed=2)
    monkeypatch.setattr(E, "_TILE_ELEMS", 1024)
    monkeypatch.setattr(E, "_MIN_ROWS", 32)
    for algo in SUPPORTED_ALGOS:
        fmt = F.get_format(algo)
        got = E.quantize_blockwise(fmt, w, 16) if fmt.blockwise else E.quantize_per_channel(fmt, w)
        assert all(g.tobytes() == r.tobytes() for g, r in zip(got, _ref_quantize(w, algo, 16))), algo


def test_nearest_code_tables_cover_every_float32_bucket():
    """Each 16-bit bucket decides exactly: the first and last float of every bucket against the reference."""
    for code in (NF4_CODE, FP4_CODE):
        hi = np.arange(1 << 16, dtype=np.uint32)
        v = np.concatenate([(hi << 16).view(np.float32), ((hi << 16) | 0xFFFF).view(np.float32)])
        v = v[np.abs(v) <= 1]  # w / absmax; outside, the float64 distances of the reference lose the tie order
        np.testing.assert_array_equal(E.nearest_code(v, code), _ref_nearest(v, code))


@pytest.mark.parametrize("algo", ["nf4", "fp4"])
def test_double_quant_reduces_bytes_and_stays_bounded(algo):
    w = _w(512, 160, seed=3)  # 1280 blocks of 64 -> 5 double-quant blocks of 256
    s1 = quantize(w, algo)
    s2 = quantize(w, algo, double_quant=True)
    assert s2["qquant_scale"].dtype == np.int8 and s2["qquant_scale"].shape == (160, 8)
    assert s2["double_quant_scale"].shape == (5,) and s2["quant_scale_offset"].shape == ()
    assert C.structure_nbytes(s2) < C.structure_nbytes(s1)
    # the scales themselves: |c - c_dq| <= double_quant_scale / 2, with the mean removed
    c, cdq = s1["quant_scale"].reshape(-1), C.block_scales(s2).reshape(-1)
    half = np.repeat(s2["double_quant_scale"], 256)[: c.size] / 2
    assert np.all(np.abs(c - cdq) <= half * (1 + 1e-5) + 1e-6)
    assert float(s2["quant_scale_offset"]) == pytest.approx(float(c.mean()), rel=1e-6)
    # weights: half max gap * absmax + scale error
    err = np.abs(dequantize(s2) - w)
    assert np.all(err <= C.max_abs_error_bound(s2) * (1 + 1e-5) + 1e-6)
    # and it is barely worse than single quantization
    e1 = np.abs(dequantize(s1) - w).mean()
    assert err.mean() < 1.05 * e1


def test_double_quant_tail_block():
    w = _w(128, 3, seed=4)  # 6 block scales < one double-quant block of 256
    s = quantize(w, "nf4", double_quant=True)
    assert s["double_quant_scale"].shape == (1,)
    assert np.all(np.abs(dequantize(s) - w) <= C.max_abs_error_bound(s) * (1 + 1e-5) + 1e-6)


def test_bytes_per_parameter():
    in_f = out_f = 1024
    n = in_f * out_f
    w = _w(in_f, out_f, seed=5)
    bpp = {
        "nf4+dq": C.structure_nbytes(quantize(w, "nf4", double_quant=True)) / n,
        "nf4": C.structure_nbytes(quantize(w, "nf4")) / n,
        "fp4+dq": C.structure_nbytes(quantize(w, "fp4", double_quant=True)) / n,
        "int4": C.structure_nbytes(quantize(w, "weight_only_int4")) / n,
        "int8": C.structure_nbytes(quantize(w, "weight_only_int8")) / n,
    }
    # codes + one f32 scale per output channel (int) / per 64-block (nf4) / int8 per block, f32 per
    # 256 blocks and one f32 offset (double quant): 16384 blocks -> 64 double-quant scales
    assert bpp["int8"] == pytest.approx(1 + 4 / in_f)
    assert bpp["int4"] == pytest.approx(0.5 + 4 / in_f)
    assert bpp["nf4"] == pytest.approx(0.5 + 4 / 64)
    assert bpp["nf4+dq"] == pytest.approx(0.5 + 1 / 64 + 4 * 64 / n + 4 / n)
    assert bpp["fp4+dq"] == bpp["nf4+dq"] < 0.54
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
    with pytest.raises(ValueError, match=r"in_features=33, out_features=8.*even"):
        quantize(_w(33, 8), "weight_only_int4")
    with pytest.raises(ValueError, match=r"in_features=33, out_features=8.*even"):
        QuantizedLinear.from_linear(_linear(33, 8), "weight_only_int4")
    with pytest.raises(ValueError, match="positive even"):
        quantize(_w(64, 8), "nf4", block_size=7)
    with pytest.raises(ValueError, match="only defined for nf4/fp4"):
        quantize(_w(64, 8), "weight_only_int8", double_quant=True)
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.zeros((4, 4, 4), np.float32), "nf4")
    # int8 takes any shape, and so do nf4/fp4 (a short last block per channel)
    quantize(_w(33, 8), "weight_only_int8")
    quantize(_w(96, 8), "nf4", block_size=64)


# ----------------------------------------------- any shape for nf4 / fp4
@pytest.mark.parametrize("algo,dq", [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)])
@pytest.mark.parametrize("in_f,bs", [(176, 64), (175, 64), (40, 64), (1000, 256), (7, 2)])
def test_any_in_features_quantizes_blockwise(algo, dq, in_f, bs):
    out_f = 24
    w = _w(in_f, out_f, seed=4)
    s = quantize(w, algo, bs, dq)
    nblk = -(-in_f // bs)
    assert s["quant_weight"].shape == (out_f, -(-in_f // 2))
    assert (s["qquant_scale"] if dq else s["quant_scale"]).shape == (out_f, nblk)
    back = dequantize(s)
    assert back.shape == (in_f, out_f)
    assert np.all(np.abs(back - w) <= C.max_abs_error_bound(s) * (1 + 1e-5) + 1e-7)
    if not dq:  # each block's absmax is exact: also the short last one
        last = np.abs(w[(nblk - 1) * bs :]).max(axis=0)
        np.testing.assert_array_equal(s["quant_scale"][:, -1], last)
        np.testing.assert_array_equal(np.abs(back[(nblk - 1) * bs :]).max(axis=0), last)
    expected = out_f * -(-in_f // 2) + (out_f * nblk + 4 * -(-out_f * nblk // 256) + 4 if dq else 4 * out_f * nblk)
    assert C.structure_nbytes(s) == expected
    # the layer: same bytes, forward == x @ dequantized weight (CPU numpy and Paddle-op decoders alike)
    q = QuantizedLinear.from_weight(w, None, algo, bs, dq)
    assert q.quantized_nbytes() == expected
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((3, in_f)).astype(np.float32))
    np.testing.assert_allclose(q(x).numpy(), x.numpy() @ back, rtol=1e-5, atol=1e-4)
    from paddlenlp_ext.quant import dequant as DQ

    np.testing.assert_array_equal(DQ.decode_cpu(q).numpy(), back.T)
    np.testing.assert_array_equal(DQ.decode_paddle(q).numpy(), back.T)


def test_shapes_that_divide_keep_their_layout_and_bytes():
    """176 = 2 * 64 + 48: one short block per channel; 128 keeps exactly the old layout (no extra scale)."""
    w = _w(176, 64, seed=6)
    s = quantize(w, "nf4", 64)
    assert s["quant_scale"].shape == (64, 3)
    assert C.structure_nbytes(s) / w.size == pytest.approx(0.5 + 3 * 4 / 176)  # 0.568 bytes/param
    s128 = quantize(w[:128], "nf4", 64)
    assert s128["quant_scale"].shape == (64, 2) and C.structure_nbytes(s128) / (128 * 64) == 0.5 + 4 / 64
    np.testing.assert_array_equal(s128["quant_weight"], s["quant_weight"][:, :64])  # same codes, same blocks
    np.testing.assert_array_equal(s128["quant_scale"], s["quant_scale"][:, :2])


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
    # two float32 matmuls over differently laid out weights (MKL picks kernels by layout and alignment)
    np.testing.assert_allclose(y.numpy(), ref.numpy(), atol=1e-5, rtol=1e-5)
    # paddle-side dequantization == numpy reference
    np.testing.assert_allclose(w.numpy(), dequantize(quantize(w_ref, algo, 64, dq)), atol=1e-6, rtol=0)
    np.testing.assert_allclose(dequantize(q.to_structure()), w.numpy(), atol=1e-6, rtol=0)
    assert q.last_path == D.PATH_PORTABLE


@pytest.mark.parametrize("algo,dq", [("nf4", True), ("weight_only_int4", False), ("weight_only_int8", False)])
def test_gradient_flows_to_input_only(algo, dq):
    lin = _linear(64, 32)
    q = QuantizedLinear.from_linear(lin, algo, double_quant=dq)
    x = paddle.randn([4, 64])
    x.stop_gradient = False
    dy = paddle.randn([4, 32])
    (q(x) * dy).sum().backward()
    expected = paddle.matmul(dy, q.dequantize_weight(), transpose_y=True)
    np.testing.assert_allclose(x.grad.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
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


def _lora_pair(algo, dq, in_f=96, out_f=40, seed=1):
    """A LoRA on a QuantizedLinear and the same LoRA on a plain Linear holding its dequantized weight."""
    from paddlenlp_ext.adapters.config import AdapterConfig
    from paddlenlp_ext.adapters.lora import LoRALinear

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((in_f, out_f)) * 0.05).astype(np.float32)
    b = rng.standard_normal(out_f).astype(np.float32)
    q = QuantizedLinear.from_weight(w, b, algo, 32, dq)
    plain = paddle.nn.Linear(in_f, out_f)
    plain.weight.set_value(q.dequantize_weight())  # the same float weight, ordinary autograd (matmul saves it)
    plain.bias.set_value(q.bias)
    plain.weight.stop_gradient = plain.bias.stop_gradient = True
    cfg = AdapterConfig(r=4, alpha=8)
    lq, lp = LoRALinear(q, cfg), LoRALinear(plain, cfg)
    for name in ("lora_A", "lora_B"):
        v = paddle.to_tensor(rng.standard_normal(getattr(lq, name).shape).astype(np.float32) * 0.1)
        getattr(lq, name).set_value(v)  # a non-zero B: the adapter's gradients depend on the base output
        getattr(lp, name).set_value(v)
    return lq, lp


@pytest.mark.parametrize("algo,dq", ALGO_DQ)
def test_quantized_gradients_equal_the_plain_computation(algo, dq):
    """x.grad and the LoRA gradients through the PyLayer == through matmul on the dequantized weight."""
    lq, lp = _lora_pair(algo, dq)
    x = paddle.to_tensor(np.random.default_rng(2).standard_normal((3, 5, 96)).astype(np.float32))
    dy = paddle.to_tensor(np.random.default_rng(3).standard_normal((3, 5, 40)).astype(np.float32))
    grads = []
    for layer in (lq, lp):
        xi = x.clone()
        xi.stop_gradient = False
        y = layer(xi)
        (y * dy).sum().backward()
        grads.append([y.numpy(), xi.grad.numpy(), layer.lora_A.grad.numpy(), layer.lora_B.grad.numpy()])
    for name, got, ref in zip(["y", "x.grad", "lora_A.grad", "lora_B.grad"], *grads):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6, err_msg=name)
    assert lq.base_layer.quant_weight.grad is None and lq.base_layer.bias.grad is None  # frozen


def test_a_trainable_bias_gets_its_gradient():
    q = QuantizedLinear.from_weight(_w(64, 16), np.zeros(16, np.float32), "nf4")
    q.bias.stop_gradient = False  # the bias is added outside the PyLayer: ordinary autograd
    x = paddle.randn([4, 7, 64])
    dy = paddle.randn([4, 7, 16])
    (q(x) * dy).sum().backward()
    np.testing.assert_allclose(q.bias.grad.numpy(), dy.numpy().sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algo,dq", ALGO_DQ)
@pytest.mark.parametrize("use_recompute", [False, True])
def test_no_float_weight_stays_alive_for_backward(monkeypatch, algo, dq, use_recompute):
    """Every float weight the forward decodes is freed before backward (the graph keeps none).

    The CPU decoder's result (a numpy array handed to Paddle without a copy) is watched through a
    weakref: a weight kept for backward -- by ``ctx``, by ``save_for_backward`` or by an ordinary
    ``paddle.matmul(x, w)`` in the autograd graph -- keeps its array alive.
    """
    import weakref

    from paddle.distributed.fleet.utils import recompute

    from paddlenlp_ext.quant import dequant as DQ

    decoded = []

    def watched(*args):
        w = decode(*args)
        decoded.append(weakref.ref(w))
        return w

    decode = DQ.decode_out_in
    monkeypatch.setattr(DQ, "decode_out_in", watched)
    lq, _ = _lora_pair(algo, dq)
    x = paddle.randn([2, 3, 96])
    x.stop_gradient = False
    y = recompute(lq, x) if use_recompute else lq(x)
    y = y * 2.0 + 1.0  # more graph on top
    assert decoded and all(r() is None for r in decoded), f"{sum(r() is not None for r in decoded)} weights alive"
    n_fwd = len(decoded)
    y.sum().backward()
    assert len(decoded) > n_fwd and all(r() is None for r in decoded)  # backward decoded again, and freed it
    assert x.grad is not None and lq.lora_A.grad is not None


@pytest.mark.parametrize("algo,dq", [("nf4", True), ("fp4", False), ("weight_only_int4", False)])
def test_save_load_into_skeleton(tmp_path, algo, dq):
    q = QuantizedLinear.from_linear(_linear(128, 16), algo, double_quant=dq)
    path = os.path.join(tmp_path, "q.pdparams")
    paddle.save(q.state_dict(), path)
    skel = QuantizedLinear(128, 16, algo, double_quant=dq, bias_attr=True)
    skel.set_state_dict(paddle.load(path))
    x = paddle.randn([3, 128])
    # same weights; MKL may sum in another order
    np.testing.assert_allclose(skel(x).numpy(), q(x).numpy(), rtol=1e-6, atol=1e-6)


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
    np.testing.assert_allclose(g1, x.grad.numpy(), rtol=1e-6, atol=1e-6)
    with paddle.amp.auto_cast(dtype="bfloat16", level="O1"):
        y2 = q(x)
    np.testing.assert_allclose(y2.astype("float32").numpy(), q(x).numpy(), rtol=2e-2, atol=2e-2)


def test_adapter_interface_attributes():
    q = QuantizedLinear.from_linear(_linear(64, 32), "nf4")
    assert callable(q.dequantize_weight) and q.compute_dtype == "float32"
    assert "algo=nf4" in repr(q) and "block_size=64" in repr(q)


# ------------------------------------------------------------ from_weight
def _bytes(layer):
    """name -> (dtype, raw bytes) of every state_dict entry (bf16 compared through its exact f32 widening)."""
    out = {}
    for k, t in layer.state_dict().items():
        a = t.astype("float32").numpy() if t.dtype == paddle.bfloat16 else t.numpy()
        out[k] = (str(t.dtype), a.tobytes())
    return out


@pytest.mark.parametrize("algo,dq", ALGO_DQ)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_from_weight_is_from_linear_without_a_linear(algo, dq, dtype):
    lin = _linear(128, 48)
    lin.to(dtype=dtype)
    w = lin.weight.astype("float32").numpy()  # [in, out]; bf16 arrives widened to fp32 (numpy has no bf16)
    b = lin.bias.astype("float32").numpy()
    if dtype == "float16":
        w, b = w.astype(np.float16), b.astype(np.float16)
    q = QuantizedLinear.from_weight(w, b, algo, 64, dq, weight_dtype=None if dtype == "float16" else dtype)
    ref = QuantizedLinear.from_linear(lin, algo, 64, dq)
    assert _bytes(q) == _bytes(ref)  # codes, scales and bias: same dtypes, same bits
    assert (q.weight_dtype, q.bias.dtype, q.bias.stop_gradient) == (dtype, lin.bias.dtype, True)
    # the structure is what codec.quantize stores for these values
    s = quantize(w.astype(np.float32), algo, 64, dq)
    for name, t in q.named_buffers():
        if name in s:
            assert t.numpy().tobytes() == s[name].tobytes(), name


def test_from_weight_keeps_no_float_weight_and_copies_the_bias():
    w, b = _w(128, 48), np.linspace(-1, 1, 48).astype(np.float32)
    q = QuantizedLinear.from_weight(w, b, "nf4")
    b[:] = 7.0  # the caller's array is not aliased
    assert float(q.bias.abs().max()) == 1.0 and not hasattr(q, "weight")
    float_elems = sum(int(np.prod(t.shape)) for t in q.state_dict().values() if t.dtype == paddle.float32)
    assert float_elems == 48 + 48 * 128 // 64  # bias + one scale per block: no [in, out] float tensor
    assert QuantizedLinear.from_weight(w, None, "weight_only_int8").bias is None
    x = paddle.randn([3, 128])
    ref = paddle.matmul(x, paddle.to_tensor(dequantize(quantize(w, "nf4")))) + paddle.to_tensor(np.linspace(-1, 1, 48))
    np.testing.assert_allclose(q(x).numpy(), ref.astype("float32").numpy(), rtol=1e-5, atol=1e-4)


def test_from_weight_rejects_what_it_cannot_build():
    with pytest.raises(ValueError, match="2-D"):
        QuantizedLinear.from_weight(np.zeros(64, np.float32), None, "nf4")
    with pytest.raises(ValueError, match="floating point"):
        QuantizedLinear.from_weight(np.zeros((64, 8), np.int32), None, "nf4")
    with pytest.raises(ValueError, match=r"bias must be a float array of shape \[8\]"):
        QuantizedLinear.from_weight(np.zeros((64, 8), np.float32), np.zeros(9, np.float32), "nf4")
    with pytest.raises(ValueError, match="must be even"):
        QuantizedLinear.from_weight(np.zeros((63, 8), np.float32), None, "weight_only_int4")


def test_check_target_shape_names_the_layer():
    Q.check_target_shape("layers.0.mlp.up_proj", 64, 176, "nf4", 64)
    from paddlenlp_ext.quant.formats import check_target_shape

    with pytest.raises(ValueError, match=r"^layer 'layers\.1\.o': weight_only_int4 .*\[in_features=7, out"):
        check_target_shape("layers.1.o", 7, 64, "weight_only_int4", 64)


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


def _stored_bytes(algo, dq, in_f, out_f, bs=64):
    """Codes + scales of one [in, out] layer, from the format definitions (docs/qlora.md)."""
    codes = in_f * out_f // (1 if algo == "weight_only_int8" else 2)
    if algo.startswith("weight_only"):
        return codes + 4 * out_f  # one f32 scale per output channel
    blocks = out_f * in_f // bs
    return codes + (blocks + 4 * -(-blocks // 256) + 4 if dq else 4 * blocks)  # int8 + f32 per 256 + offset


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
    # [in, out] of q, k, v, o, gate, up, down in each of the 2 layers
    shapes = 2 * [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]
    expected = sum(_stored_bytes(algo, dq, i, o) for i, o in shapes)
    assert stats["bytes_after"] == expected == quantized_state_bytes(model)
    assert stats["bytes_per_param"] == pytest.approx(expected / stats["params"])
    assert stats["path"] == [D.PATH_PORTABLE]
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
            assert l.last_path == D.PATH_PORTABLE and l.quant_weight.grad is None


def test_quantize_model_default_targets_are_the_families_decoder_linears(monkeypatch):
    from paddlenlp_ext.models import targets as T

    monkeypatch.setitem(T.DECODER_LINEAR_TARGETS, "llama", (r".*layers\.\d+\.mlp\.down_proj",))
    stats = quantize_model(_tiny_llama(), "nf4")  # model.config.model_type == "llama"
    assert stats["replaced"] == ["llama.layers.0.mlp.down_proj", "llama.layers.1.mlp.down_proj"]

    class NoConfig(paddle.nn.Layer):  # no config: the generic decoder-block pattern
        def __init__(self):
            super().__init__()

            def block():
                return paddle.nn.LayerDict({"proj": paddle.nn.Linear(64, 16), "embed_proj": paddle.nn.Linear(64, 16)})

            self.layers = paddle.nn.LayerList([block()])
            self.blocks = paddle.nn.LayerList([block()])

    stats = quantize_model(NoConfig(), "nf4")
    assert stats["replaced"] == ["layers.0.proj"]  # not blocks.N, never a name containing "embed"


def test_quantize_model_target_modules_and_bad_shape_is_atomic():
    model = _tiny_llama()
    stats = quantize_model(model, "nf4", target_modules=[r".*mlp\.(gate|up)_proj"])
    assert stats["layers_replaced"] == 4
    assert all(n.endswith(("gate_proj", "up_proj")) for n in stats["replaced"])
    model2 = _tiny_llama()
    model2.llama.layers[1].mlp.add_sublayer("odd", paddle.nn.Linear(63, 8))  # the last target, int4 refuses it
    before = [n for n, l in model2.named_sublayers() if type(l) is paddle.nn.Linear]
    with pytest.raises(ValueError, match=r"layer 'llama\.layers\.1\.mlp\.odd'.*in_features=63"):
        quantize_model(model2, "weight_only_int4")
    after = [n for n, l in model2.named_sublayers() if type(l) is paddle.nn.Linear]
    assert before == after  # nothing was replaced
    with pytest.raises(ValueError, match="invalid regular expression"):
        quantize_model(_tiny_llama(), "nf4", target_modules=["("])
    with pytest.raises(ValueError, match="only defined for nf4/fp4"):
        quantize_model(_tiny_llama(), "weight_only_int4", double_quant=True)


def _tensor_parallel_layer(cls, in_f, out_f):
    """A real Paddle tensor-parallel linear; its __init__ needs an initialized fleet mp group, so the
    instance is set up as that __init__ would on one rank (Layer state + an [in, out] weight)."""
    layer = cls.__new__(cls)
    paddle.nn.Layer.__init__(layer)
    layer.weight = layer.create_parameter([in_f, out_f])
    return layer


@pytest.mark.parametrize("cls_path", [
    "paddle.distributed.fleet.meta_parallel.ColumnParallelLinear",
    "paddle.distributed.fleet.meta_parallel.RowParallelLinear",
    "paddle.distributed.fleet.utils.sequence_parallel_utils.ColumnSequenceParallelLinear",
    "paddle.distributed.fleet.utils.sequence_parallel_utils.RowSequenceParallelLinear",
])  # fmt: skip
def test_tensor_parallel_linears_are_refused_not_skipped(cls_path):
    import importlib

    module, _, name = cls_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    model = _tiny_llama()
    model.llama.layers[1].self_attn.o_proj = _tensor_parallel_layer(cls, 64, 64)
    before = [n for n, l in model.named_sublayers() if type(l) is paddle.nn.Linear]
    if "Sequence" in name:  # sequence-parallel linears: not supported
        why = "tensor-parallel QLoRA .* is not supported yet"
    else:  # tensor-parallel linears are quantized per shard (paddlenlp_ext/parallel), but need a real layer
        why = "not built by its __init__"
    with pytest.raises(
        ValueError,
        match=rf"layer 'llama\.layers\.1\.self_attn\.o_proj' is a tensor-parallel "
        rf"{name}: .*{why}",
    ):
        quantize_model(model, "nf4")
    assert [n for n, l in model.named_sublayers() if type(l) is paddle.nn.Linear] == before  # untouched
    # outside target_modules it does not matter
    stats = quantize_model(model, "nf4", target_modules=[r".*mlp\..*"])
    assert stats["layers_replaced"] == 6


@pytest.mark.parametrize("algo,dq", [("nf4", True), ("fp4", False), ("weight_only_int8", False)])
def test_amp_o2_leaves_the_quantized_layers_float32(algo, dq):
    """paddle.amp.decorate(level="O2") casts every float parameter and buffer of the layers it is not told
    to exclude.  On CPU decorate returns early (O2 needs a GPU/XPU/custom device), so the cast step it runs
    there -- paddle.amp.auto_cast.amp_initialize, with the same arguments -- is called directly as well."""
    from paddle.amp.auto_cast import amp_initialize

    from paddlenlp_ext.models.quantize import amp_excluded_layers

    def float_buffers(model):
        return {
            f"{n}.{b}": t.dtype
            for n, l in model.named_sublayers()
            if isinstance(l, QuantizedLinear)
            for b, t in l.named_buffers()
            if t.dtype in (paddle.float32, paddle.bfloat16)
        }

    model = _tiny_llama()
    quantize_model(model, algo, double_quant=dq, block_size=32)
    q = model.llama.layers[0].mlp.down_proj
    w_before = q.dequantize_weight().numpy()
    excluded = amp_excluded_layers(model)
    assert len(excluded) == 14 and all(isinstance(l, QuantizedLinear) for l in excluded)
    assert paddle.amp.decorate(model, level="O2", dtype="bfloat16", excluded_layers=excluded) is model
    amp_initialize(models=[model], dtype="bfloat16", excluded_layers=excluded)
    assert model.llama.embed_tokens.weight.dtype == paddle.bfloat16  # the cast did run
    kept = float_buffers(model)
    assert kept and set(kept.values()) == {paddle.float32}  # scales, offsets, code-book tables
    np.testing.assert_array_equal(q.dequantize_weight().numpy(), w_before)

    # what the exclusion prevents: the f32 scales / tables turned bf16
    model2 = _tiny_llama()
    quantize_model(model2, algo, double_quant=dq, block_size=32)
    amp_initialize(models=[model2], dtype="bfloat16", excluded_layers=[])
    assert set(float_buffers(model2).values()) == {paddle.bfloat16}


# ------------------------------------------- kernel dispatch (GPU decisions)
# The GPU kernels cannot run here; these tests check the decisions (dispatch.plan_*) for every capability
# combination, that QuantizedLinear / quantize_model execute them, and Paddle's own CPU weight_quantize layout.
GPU80 = D.KernelCaps(weight_only_ops=True, arch=80)
INT8, INT4, NF4 = F.FORMATS["weight_only_int8"], F.FORMATS["weight_only_int4"], F.FORMATS["nf4"]


@pytest.mark.parametrize("fmt,backend,shape,wdtype,on_gpu,caps,expected", [
    (INT8, "auto", (4096, 4096), "float32", True, GPU80, ("paddle_weight_only", 80, "bfloat16")),
    (INT4, "auto", (4096, 4096), "float16", True, GPU80, ("paddle_weight_only", 80, "float16")),
    (INT4, "auto", (128, 32), "float32", True, D.KernelCaps(True, 70), ("paddle_weight_only", 70, "float16")),
    (INT8, "auto", (128, 32), "float32", True, D.KernelCaps(True, 75), ("paddle_weight_only", 75, "float16")),
    (INT8, "paddle_weight_only", (128, 32), "bfloat16", True, D.KernelCaps(True, 90),
     ("paddle_weight_only", 90, "bfloat16")),
    (INT8, "auto", (128, 32), "float32", False, GPU80, ("portable", None, None)),  # weight on CPU
    (INT8, "auto", (128, 32), "float32", True, D.KernelCaps(True, None), ("portable", None, None)),  # no CUDA
    (INT8, "auto", (128, 32), "float32", True, D.KernelCaps(True, 61), ("portable", None, None)),  # SM61
    (INT8, "auto", (128, 32), "float32", True, D.KernelCaps(False, 80), ("portable", None, None)),  # old Paddle
    (INT4, "auto", (128, 24), "float32", True, GPU80, ("portable", None, None)),  # out % 16 != 0
    (INT4, "auto", (96, 32), "float32", True, GPU80, ("portable", None, None)),  # in % 64 != 0
    (NF4, "auto", (4096, 4096), "float32", True, GPU80, ("portable", None, None)),  # nf4: PaddleSlim at forward
    (INT8, "portable", (128, 32), "float32", True, GPU80, ("portable", None, None)),
])  # fmt: skip
def test_plan_build(fmt, backend, shape, wdtype, on_gpu, caps, expected):
    plan = D.plan_build(fmt, backend, *shape, wdtype, on_gpu, caps)
    assert (plan.backend, plan.arch, plan.quantize_dtype) == expected


@pytest.mark.parametrize("fmt,shape,ok", [
    (INT4, (4096, 11008), True), (INT4, (64, 32), True), (INT4, (64, 48), False), (INT4, (64, 16), False),
    (INT8, (64, 48), True), (INT8, (64, 16), True), (INT8, (64, 24), False), (INT8, (96, 64), False),
])  # fmt: skip
def test_weight_only_shapes_follow_paddles_kernel_checks(fmt, shape, ok):
    """int4's stored weight is [out / 2, in] and weight_only_linear wants its first dim % 16: out % 32."""
    assert D.weight_only_shape_ok(fmt, *shape) is ok
    plan = D.plan_build(fmt, "auto", *shape, "bfloat16", True, GPU80)
    assert plan.backend == ("paddle_weight_only" if ok else "portable")
    assert (plan.reason == "") is ok  # the fallback says why
    if not ok:
        assert f"out_features % {32 if fmt is INT4 else 16} == 0" in plan.reason and fmt.name in plan.reason


def test_the_portable_fallback_is_logged(monkeypatch, caplog):
    _as_gpu(monkeypatch)
    q = QuantizedLinear.from_linear(_linear(64, 48), "weight_only_int4")  # 48: fine for int8, not int4
    assert q.backend == "portable"
    assert "portable layout instead of 'paddle_weight_only'" in caplog.text and "% 32 == 0" in caplog.text


@pytest.mark.parametrize("fmt,shape,caps,error", [
    (INT8, (128, 32), D.KernelCaps(True, None), r"unavailable: Paddle is not compiled with CUDA or no GPU"),
    (INT8, (128, 32), D.KernelCaps(True, 61), r"unavailable: GPU arch SM61 is not supported"),
    (INT8, (128, 32), D.KernelCaps(False, 80), r"unavailable: paddle.nn.quant.weight_quantize/weight_only_linear"),
    (INT4, (128, 24), GPU80, r"need in_features % 64 == 0 and out_features % 32 == 0 for weight_only_int4.*"
                             r"out_features=24\]; use backend='portable'"),
    (INT4, (128, 48), GPU80, r"out_features % 32 == 0 for weight_only_int4"),  # 48 % 16 == 0 is not enough
    (INT8, (96, 48), GPU80, r"need in_features % 64 == 0 and out_features % 16 == 0 for weight_only_int8"),
    (NF4, (128, 32), GPU80, r"only supports \('weight_only_int8', 'weight_only_int4'\), got 'nf4'"),
])  # fmt: skip
def test_plan_build_explicit_weight_only_says_why_not(fmt, shape, caps, error):
    with pytest.raises((ValueError, RuntimeError), match=error):
        D.plan_build(fmt, "paddle_weight_only", *shape, "float32", True, caps)


def _never():
    raise AssertionError("PaddleSlim probed although the plan does not depend on it")


@pytest.mark.parametrize("fmt,backend,on_gpu,x_dtype,paddleslim,expected", [
    (INT8, "paddle_weight_only", True, "float16", _never,
     ("paddle_weight_only_linear", {"weight_dtype": "int8", "arch": 80, "group_size": -1})),
    (INT4, "paddle_weight_only", True, "bfloat16", _never,
     ("paddle_weight_only_linear", {"weight_dtype": "int4", "arch": 80, "group_size": -1})),
    (INT4, "paddle_weight_only", True, None, _never,  # quantize_model's plan: x dtype not known yet
     ("paddle_weight_only_linear", {"weight_dtype": "int4", "arch": 80, "group_size": -1})),
    (INT4, "paddle_weight_only", True, "float32", _never,  # no fp32 fused kernel
     ("paddle_weight_dequantize_matmul", {"algo": "weight_only_int4", "weight_dtype": "int4", "arch": 80,
                                          "group_size": -1})),
    (NF4, "portable", True, "float32", lambda: True,
     ("paddleslim_dequant_blockwise_matmul", {"code": None, "blocksize": 32, "quant_type": "nf4"})),
    (F.FORMATS["fp4"], "portable", True, "bfloat16", lambda: True,
     ("paddleslim_dequant_blockwise_matmul", {"code": None, "blocksize": 32, "quant_type": "fp4"})),
    (NF4, "portable", True, "float32", lambda: False, ("portable_dequant_matmul", {})),  # PaddleSlim missing
    (NF4, "portable", False, "float32", _never, ("portable_dequant_matmul", {})),  # x on CPU
    (INT4, "portable", True, "float16", _never, ("portable_dequant_matmul", {})),  # int: no PaddleSlim kernel
])  # fmt: skip
def test_plan_kernel(fmt, backend, on_gpu, x_dtype, paddleslim, expected):
    plan = D.plan_kernel(
        fmt,
        backend,
        x_on_gpu=on_gpu,
        x_dtype=x_dtype,
        arch=80 if backend != "portable" else None,
        block_size=32 if fmt.blockwise else None,
        paddleslim=paddleslim,
    )
    assert plan == expected
    with pytest.raises(RuntimeError, match="needs a GPU input; rebuild it with backend='portable'"):
        D.plan_kernel(
            INT8, "paddle_weight_only", x_on_gpu=False, x_dtype="float16", arch=80, block_size=None, paddleslim=_never
        )


@pytest.mark.parametrize(
    "in_f,expected", [(128, D.PATH_PADDLESLIM), (96, D.PATH_PADDLESLIM), (176, D.PATH_PORTABLE), (175, D.PATH_PORTABLE)]
)
def test_plan_kernel_uses_paddleslim_only_for_flat_blocks(in_f, expected):
    """PaddleSlim decodes flat blocks: a short last block per channel (in % bs != 0) must go portable."""
    plan = D.plan_kernel(
        NF4,
        "portable",
        x_on_gpu=True,
        x_dtype="bfloat16",
        arch=None,
        block_size=32,
        paddleslim=lambda: True,
        in_features=in_f,
    )
    assert plan[0] == expected


def test_layer_hands_its_in_features_to_the_plan(monkeypatch):
    _as_gpu(monkeypatch, paddleslim=True)
    assert QuantizedLinear.from_weight(_w(176, 16), None, "nf4", 64).planned_path() == D.PATH_PORTABLE
    assert QuantizedLinear.from_weight(_w(192, 16), None, "nf4", 64).planned_path() == D.PATH_PADDLESLIM


def _as_gpu(monkeypatch, caps=GPU80, paddleslim=False):
    """Tensors count as on GPU and the machine offers ``caps`` (weight_quantize itself runs on CPU)."""
    monkeypatch.setattr(L, "probe_caps", lambda: caps)
    monkeypatch.setattr(L, "_on_gpu", lambda t: True)
    monkeypatch.setattr(L, "_paddleslim_available", lambda: paddleslim)


@pytest.mark.parametrize("algo", ["weight_only_int8", "weight_only_int4"])
def test_quantize_model_plans_weight_only_and_stores_paddles_layout(monkeypatch, algo):
    model = _tiny_llama()
    w = model.llama.layers[0].mlp.up_proj.weight.numpy().copy()
    _as_gpu(monkeypatch)
    stats = quantize_model(model, algo)
    assert stats["path"] == [D.PATH_WEIGHT_ONLY] and stats["layers_replaced"] == 14
    q = model.llama.layers[0].mlp.up_proj
    assert (q.backend, q.arch, q.quant_scale.dtype) == ("paddle_weight_only", 80, paddle.bfloat16)
    qw, scale = paddle.nn.quant.weight_quantize(paddle.to_tensor(w).astype("bfloat16"), algo=algo, arch=80)
    np.testing.assert_array_equal(q.quant_weight.numpy(), qw.numpy())  # Paddle's op output, stored as is
    np.testing.assert_array_equal(q.quant_scale.astype("float32").numpy(), scale.astype("float32").numpy())
    assert set(q.state_dict()) == {"quant_weight", "quant_scale"}  # Llama linears have no bias
    with pytest.raises(ValueError, match="to_structure needs the portable layout"):
        q.to_structure()


def test_quantize_model_plans_paddleslim_only_when_importable(monkeypatch):
    _as_gpu(monkeypatch, paddleslim=True)
    assert quantize_model(_tiny_llama(), "nf4")["path"] == [D.PATH_PADDLESLIM]
    _as_gpu(monkeypatch, paddleslim=False)
    assert quantize_model(_tiny_llama(), "nf4")["path"] == [D.PATH_PORTABLE]


class _Handed(Exception):
    """Raised by a kernel spy once it has recorded what it was handed (nothing is computed)."""


def test_forward_hands_the_plan_to_the_kernels(monkeypatch):
    calls = []

    def spy(name):
        def record(*args, **kwargs):
            calls.append((name, args, kwargs))
            raise _Handed

        return record

    _as_gpu(monkeypatch, paddleslim=True)
    q4 = QuantizedLinear.from_linear(_linear(128, 32), "weight_only_int4")
    monkeypatch.setattr(paddle.nn.quant, "weight_only_linear", spy("weight_only_linear"))
    with pytest.raises(_Handed):
        q4(paddle.randn([3, 128]).astype("float16"))
    ((_, args, kw),) = calls
    assert args[1] is q4.quant_weight and kw.pop("weight_scale").dtype == paddle.float16 and kw.pop("bias") is not None
    assert kw == {"weight_dtype": "int4", "arch": 80, "group_size": -1} and q4.last_path is None

    calls.clear()
    qnf = QuantizedLinear.from_linear(_linear(128, 24), "nf4", block_size=32, double_quant=True)
    monkeypatch.setattr(L, "paddleslim_ops", lambda: type("Ops", (), {"dequant_blockwise": spy("dequant_blockwise")}))
    with pytest.raises(_Handed):
        qnf(paddle.randn([3, 128]))
    ((_, (qw, code, scales, blocksize, quant_type), _),) = calls
    assert qw is qnf.quant_weight and (code, blocksize, quant_type) == (None, 32, "nf4")
    np.testing.assert_allclose(scales.numpy(), C.block_scales(qnf.to_structure()).reshape(-1), rtol=1e-6)


def test_weight_dequantize_falls_back_only_for_a_missing_kernel(monkeypatch):
    _as_gpu(monkeypatch)
    q = QuantizedLinear.from_linear(_linear(128, 32), "weight_only_int8")
    monkeypatch.setattr(L, "_on_gpu", lambda t: False)
    # CPU Paddle has neither kernel: weight_dequantize's "not registered" leads to the weight_only_linear fallback
    with pytest.raises(RuntimeError, match="kernel `weight_only_linear` is not registered"):
        q.dequantize_weight()

    def broken(*a, **k):
        raise RuntimeError("(InvalidArgument) scale has the wrong shape")

    monkeypatch.setattr(paddle.nn.quant, "weight_dequantize", broken)
    with pytest.raises(RuntimeError, match="wrong shape"):  # a real error is not swallowed
        q.dequantize_weight()


def test_cuda_arch_asks_before_it_reads(monkeypatch):
    def capability():
        raise AssertionError("get_device_capability called without a visible GPU")

    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", capability)
    for compiled, count in [(False, 1), (True, 0)]:
        monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda c=compiled: c)
        monkeypatch.setattr(paddle.device.cuda, "device_count", lambda n=count: n)
        assert L._cuda_arch() is None
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda: (8, 6))
    assert L._cuda_arch() == 86 and L.probe_caps().arch == 86


def test_find_paddleslim_ops_skips_only_what_does_not_load(monkeypatch, tmp_path, caplog):
    """Real modules on sys.path: missing, a .so that is no ELF file, Paddle's custom-op stub on a broken library."""
    import importlib.machinery

    def find():
        importlib.invalidate_caches()  # the files below change between calls
        try:
            return L.find_paddleslim_ops()
        finally:
            for name in L._PADDLESLIM_MODULES:
                sys.modules.pop(name, None)

    so_module = tmp_path / ("paddleslim_ops" + importlib.machinery.EXTENSION_SUFFIXES[0])
    for name in L._PADDLESLIM_MODULES:  # hermetic on a machine where PaddleSlim's ops are installed
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])  # paddle itself is already imported
    assert find() is None and "PaddleSlim" not in caplog.text  # neither installed: None, nothing to report
    (tmp_path / "broken.so").write_bytes(b"not a shared library")
    so_module.write_bytes(b"not a shared library")
    (tmp_path / "custom_setup_ops.py").write_text("def dequant_blockwise(*a):\n    pass\n")
    assert find().__name__ == "custom_setup_ops" and "paddleslim_ops is installed but cannot be loaded" in caplog.text
    so_module.unlink()
    stub = f"paddle.utils.cpp_extension.load_op_meta_info_and_register_op({str(tmp_path / 'broken.so')!r})"
    (tmp_path / "paddleslim_ops.py").write_text(f"import paddle\n{stub}\n")  # what Paddle's setup stub runs
    (tmp_path / "custom_setup_ops.py").write_text("x = 1\n")  # loads, but has no dequant_blockwise
    assert find() is None and "its library does not load" in caplog.text
    (tmp_path / "paddleslim_ops.py").write_text("raise RuntimeError('(InvalidArgument) a bug in the module')\n")
    with pytest.raises(RuntimeError, match="a bug in the module"):  # not a loading problem: raised
        find()


def test_weight_only_backend_unavailable(monkeypatch):
    _as_gpu(monkeypatch, caps=D.KernelCaps(weight_only_ops=True, arch=None))
    with pytest.raises(RuntimeError, match="paddle_weight_only.*unavailable"):
        QuantizedLinear.from_linear(_linear(64, 16), "weight_only_int8", backend="paddle_weight_only")
    with pytest.raises(ValueError, match="only supports"):
        QuantizedLinear.from_linear(_linear(64, 8), "nf4", backend="paddle_weight_only")
    with pytest.raises(ValueError, match="in_features % 64 == 0"):
        QuantizedLinear.from_linear(_linear(48, 8), "weight_only_int8", backend="paddle_weight_only")
    # auto falls back to the portable layout
    assert QuantizedLinear.from_linear(_linear(64, 8), "weight_only_int8").backend == "portable"


def test_formats_import_does_not_import_paddle():
    code = "import sys, paddlenlp_ext.quant as q; q.quantize; assert 'paddle' not in sys.modules, 'paddle imported'"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert Q.SUPPORTED_ALGOS == ("weight_only_int8", "weight_only_int4", "nf4", "fp4")
