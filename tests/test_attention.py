"""paddlenlp_ext.kernels.flashmask_attention vs a dense masked reference.

The reference mask is built by a literal port of the ``flashmask_to_densemask``
loop in Paddle's flashmask_attention docstring, independent of the interval
normalization used by the implementation.
"""

import math
import zlib

import numpy as np
import paddle
import pytest

from paddlenlp_ext.kernels import (
    BLOCK_SIZE,
    dense_mask_from_startend,
    flashmask_attention,
    flashmask_stats,
    tiled_flashmask_attention,
)
from paddlenlp_ext.kernels.reference import docstring_dense_mask, reference_attention

TOL = 1e-5


def make_qkv(b, s, hq, hk, d, seed, sk=None):
    rng = np.random.default_rng(seed)
    sk = sk or s
    tensors = [
        paddle.to_tensor(rng.standard_normal(shape).astype("float32"))
        for shape in ((b, s, hq, d), (b, sk, hk, d), (b, sk, hk, d))
    ]
    for t in tensors:
        t.stop_gradient = False
    return tensors


def packed_causal_lts(b, s, nseg, pad, rng):
    """LTS for packed rows: column j masked from the end of its example on.
    The last `pad` columns are padding; each forms its own 1-token example."""
    lts = np.zeros((b, 1, s, 1), dtype=np.int32)
    for bi in range(b):
        n = s - pad
        cuts = sorted(rng.choice(np.arange(1, n), nseg - 1, replace=False))
        edges = [0, *cuts, n]
        for st, en in zip(edges[:-1], edges[1:]):
            lts[bi, 0, st:en, 0] = en
        for j in range(n, s):
            lts[bi, 0, j, 0] = j + 1
    return lts


def random_bounds(b, h, s, form, rng):
    """Random bounds for each form, including empty/inverted intervals and edges."""

    def col(low=0):
        return rng.integers(low, s + 1, size=(b, h, s))

    j = np.arange(s)
    if form == "causal1":
        lts = np.maximum(col(), j)  # LTS below the diagonal, as in real masks
        lts[..., ::7] = s  # some columns without a lower mask
        return lts[..., None]
    if form == "causal2":
        lts = np.maximum(col(), j)
        lte = np.minimum(lts + rng.integers(0, s // 2, size=lts.shape), s)
        lte[..., ::5] = lts[..., ::5]  # empty interval
        return np.stack([lts, lte], -1)
    if form == "noncausal2":
        lts, ute = col(), col()
        lts[..., ::6] = s
        ute[..., ::4] = 0
        return np.stack([lts, ute], -1)
    if form == "noncausal4":
        a, c = col(), col()
        lts = a
        lte = np.minimum(a + rng.integers(0, s, size=a.shape), s)
        uts = c
        ute = np.minimum(c + rng.integers(0, s // 3, size=c.shape), s)
        lte[..., ::5] = np.maximum(lts[..., ::5] - 1, 0)  # inverted (or empty) interval
        return np.stack([lts, lte, uts, ute], -1)
    raise ValueError(form)


def check_against_reference(q, k, v, sri_np, causal, masked=None, **kw):
    sri = None if sri_np is None else paddle.to_tensor(sri_np.astype(np.int32))
    out, _ = tiled_flashmask_attention(q, k, v, sri, causal=causal, **kw)
    if masked is None and sri_np is not None:
        masked = docstring_dense_mask(sri_np, causal)
    ref = reference_attention(q, k, v, masked)
    assert not bool(paddle.isnan(out).any())
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=TOL, rtol=0)

    dout = paddle.to_tensor(np.random.default_rng(1).standard_normal(out.shape).astype("float32"))
    grads = paddle.grad([out], [q, k, v], [dout])
    ref_grads = paddle.grad([ref], [q, k, v], [dout])
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert not bool(paddle.isnan(g).any()), name
        np.testing.assert_allclose(g.numpy(), rg.numpy(), atol=TOL, rtol=0, err_msg=f"d{name}")
    return out, grads


# ---------------------------------------------------------------------------
# Packed causal rows (the training use case)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (4, 1)])
def test_packed_causal_random_segmentations(seed, hq, hk):
    rng = np.random.default_rng(seed)
    b, s = 2, 200
    lts = packed_causal_lts(b, s, nseg=int(rng.integers(2, 7)), pad=int(rng.integers(0, 20)), rng=rng)
    q, k, v = make_qkv(b, s, hq, hk, 16, seed)
    # 48 does not divide 200: uneven last tile, tiles straddling segment edges.
    check_against_reference(q, k, v, lts, causal=True, block_q=48, block_k=48)


def test_packed_causal_default_block_size():
    rng = np.random.default_rng(7)
    lts = packed_causal_lts(1, 300, nseg=4, pad=13, rng=rng)
    q, k, v = make_qkv(1, 300, 4, 2, 16, 7)
    check_against_reference(q, k, v, lts, causal=True)  # BLOCK_SIZE tiles


def test_cost_scales_with_segment_lengths():
    """Aligned segments: only the diagonal tiles are computed."""
    s, bs, nseg, h = 1024, 128, 8, 2
    lts = np.repeat(np.arange(bs, s + 1, bs), bs).astype(np.int32).reshape(1, 1, s, 1)
    q, k, v = make_qkv(1, s, h, h, 8, 0)
    # the block-sparse kernel itself (flashmask_attention sends packed documents to kernels/varlen.py)
    tiled_flashmask_attention(q, k, v, paddle.to_tensor(lts), causal=True)
    st = flashmask_stats()
    assert st["score_elems"] == h * nseg * bs * bs  # == sum of squared segment lengths
    assert st["tiles_skipped"] == (s // bs) ** 2 - nseg


def test_cost_random_segments_is_exactly_the_visible_tiles():
    """Unaligned segments: exactly the tiles with a visible entry are computed.

    The expected count comes from the docstring dense mask, not from the
    kernel's min/max classification: a dropped tile lowers the count, a
    fully masked tile that is computed anyway raises it.  For packed causal bounds
    with square tiles the classification is exact: a column is fully masked in
    a tile only by the causal part (j >= tile bottom) or by its LTS (<= tile
    top), never by a mix of both within a tile.
    """
    rng = np.random.default_rng(3)
    s, bs, h = 2048, BLOCK_SIZE, 2
    lts = packed_causal_lts(1, s, nseg=16, pad=0, rng=rng)
    q, k, v = make_qkv(1, s, h, h, 8, 0)
    with paddle.no_grad():  # the block-sparse kernel (flashmask_attention routes documents to varlen)
        tiled_flashmask_attention(q, k, v, paddle.to_tensor(lts), causal=True)
    nb = s // bs
    tile_visible = (~docstring_dense_mask(lts, True)[0, 0]).reshape(nb, bs, nb, bs).any(axis=(1, 3))  # [nqb, nkb]
    st = flashmask_stats()
    assert st["tiles_skipped"] == int((~tile_visible).sum())
    assert st["score_elems"] == h * bs * bs * int(tile_visible.sum())
    # The documented cost claim: a segment of length L touches at most
    # ceil(L / bs) + 1 tile rows/cols.
    lengths = np.diff(np.concatenate([[0], np.unique(lts[0, 0, :, 0])]))
    assert st["score_elems"] <= h * bs * bs * sum((math.ceil(L / bs) + 1) ** 2 for L in lengths)


# ---------------------------------------------------------------------------
# Every bound form, broadcast and per-head, with GQA
# ---------------------------------------------------------------------------
FORMS = [("causal1", True), ("causal2", True), ("noncausal2", False), ("noncausal4", False)]


@pytest.mark.parametrize("form,causal", FORMS)
@pytest.mark.parametrize("bound_heads", ["broadcast", "per_q_head", "per_kv_head"])
def test_bound_forms(form, causal, bound_heads):
    # crc32, not hash(): str hashes are salted per process, so hash() would
    # draw different bounds on every run.
    rng = np.random.default_rng(zlib.crc32(repr((form, bound_heads)).encode()))
    b, s, hq, hk = 2, 96, 4, 2
    h = {"broadcast": 1, "per_q_head": hq, "per_kv_head": hk}[bound_heads]
    sri = random_bounds(b, h, s, form, rng)
    q, k, v = make_qkv(b, s, hq, hk, 8, 5)
    check_against_reference(q, k, v, sri, causal=causal, block_q=32, block_k=32)


@pytest.mark.parametrize("form,causal", FORMS)
def test_docstring_examples_dense_mask(form, causal):
    """dense_mask_from_startend agrees with the docstring conversion."""
    rng = np.random.default_rng(11)
    sri = random_bounds(2, 3, 40, form, rng)
    visible = dense_mask_from_startend(paddle.to_tensor(sri.astype(np.int32)), 40, causal)
    np.testing.assert_array_equal(visible.numpy(), ~docstring_dense_mask(sri, causal))
    add = dense_mask_from_startend(paddle.to_tensor(sri.astype(np.int32)), 40, causal, additive=True).numpy()
    assert set(np.unique(add)) <= {0.0, -np.inf}
    np.testing.assert_array_equal(add == 0, visible.numpy())


def test_docstring_document_mask_noncausal():
    lts = [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]
    ute = [0, 0, 0, 0, 4, 4, 4, 7, 7, 7]
    sri = np.stack([lts, ute], -1).reshape(1, 1, 10, 2)
    expected = np.zeros((10, 10), bool)
    for st, en in ((0, 4), (4, 7), (7, 10)):
        expected[st:en, st:en] = True
    visible = dense_mask_from_startend(paddle.to_tensor(sri.astype(np.int32)), 10, False).numpy()[0, 0]
    np.testing.assert_array_equal(visible, expected)
    q, k, v = make_qkv(1, 10, 2, 2, 8, 0)
    check_against_reference(q, k, v, sri, causal=False, block_q=4, block_k=4)


# ---------------------------------------------------------------------------
# No bounds, fully masked rows, options
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_no_startend(causal):
    q, k, v = make_qkv(2, 70, 4, 2, 8, 3)
    masked = np.triu(np.ones((70, 70), bool), 1)[None, None] if causal else None
    check_against_reference(q, k, v, None, causal=causal, masked=masked, block_q=32, block_k=16)


def test_fully_masked_rows_are_zero():
    b, s = 1, 64
    # Non-causal: every column masks rows [20, 40) -> those rows see nothing.
    sri = np.zeros((b, 1, s, 4), np.int32)
    sri[..., 0], sri[..., 1] = 20, 40  # LTS, LTE
    sri[..., 2], sri[..., 3] = 0, 0  # empty upper interval
    q, k, v = make_qkv(b, s, 2, 2, 8, 4)
    out, grads = check_against_reference(q, k, v, sri, causal=False, block_q=16, block_k=16)
    assert float(out[:, 20:40].abs().max()) == 0.0
    assert float(grads[0][:, 20:40].abs().max()) == 0.0  # dq of empty rows
    _, lse = flashmask_attention(q, k, v, paddle.to_tensor(sri), return_softmax_lse=True)
    assert bool(paddle.isinf(lse[:, :, 20:40]).all()) and bool((lse[:, :, 20:40] > 0).all())


def test_fully_masked_rows_inside_partial_tiles():
    """Empty rows that share a tile with visible rows (online-softmax -inf path)."""
    s = 50
    sri = np.zeros((1, 2, s, 4), np.int32)
    sri[:, 0, :, 0], sri[:, 0, :, 1] = 7, 9  # head 0: rows 7, 8 empty
    sri[:, 1, :, 0], sri[:, 1, :, 1] = 30, 33  # head 1: rows 30..32 empty
    q, k, v = make_qkv(1, s, 2, 1, 8, 9)
    out, _ = check_against_reference(q, k, v, sri, causal=False, block_q=16, block_k=16)
    assert float(out[0, 7:9, 0].abs().max()) == 0.0 and float(out[0, 30:33, 1].abs().max()) == 0.0


def test_softmax_lse_and_seed_offset():
    rng = np.random.default_rng(0)
    lts = packed_causal_lts(1, 64, nseg=3, pad=0, rng=rng)
    q, k, v = make_qkv(1, 64, 2, 2, 8, 0)
    out, lse, seed = flashmask_attention(
        q, k, v, paddle.to_tensor(lts), causal=True, return_softmax_lse=True, return_seed_offset=True
    )
    assert lse.shape == [1, 2, 64] and seed.numpy().tolist() == [0, 0]
    masked = docstring_dense_mask(lts, True)
    s = paddle.matmul(q.transpose([0, 2, 1, 3]), k.transpose([0, 2, 1, 3]), transpose_y=True) / math.sqrt(8)
    s = paddle.where(paddle.to_tensor(masked), paddle.full_like(s, -np.inf), s)
    np.testing.assert_allclose(lse.numpy(), paddle.logsumexp(s, -1).numpy(), atol=1e-5)


def test_window_size_matches_sliding_window():
    s, w = 40, 5
    q, k, v = make_qkv(1, s, 2, 2, 8, 2)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    masked = ((j > i) | (j < i - w))[None, None]
    out, _ = tiled_flashmask_attention(q, k, v, causal=True, window_size=w, block_q=16, block_k=16)
    np.testing.assert_allclose(out.numpy(), reference_attention(q, k, v, masked).numpy(), atol=TOL)
    masked = ((j > i + 3) | (j < i - w))[None, None]
    out, _ = tiled_flashmask_attention(q, k, v, causal=False, window_size=(w, 3), block_q=16, block_k=16)
    np.testing.assert_allclose(out.numpy(), reference_attention(q, k, v, masked).numpy(), atol=TOL)


def test_block_mask_per_head():
    s, hq = 300, 2  # 3 x 3 blocks of 128
    rng = np.random.default_rng(5)
    lts = packed_causal_lts(1, s, nseg=2, pad=0, rng=rng)
    lts = np.repeat(lts, hq, axis=1)  # block_mask heads == bound heads
    bm = np.ones((1, hq, 3, 3), np.int32)
    bm[0, 0, 2, 0] = 0  # drop one block for head 0 only
    bm[0, :, 1, 1] = 0  # and one for both heads
    q, k, v = make_qkv(1, s, hq, hq, 8, 6)
    masked = docstring_dense_mask(lts, True)
    dense_bm = np.kron(bm, np.ones((128, 128), np.int32))[:, :, :s, :s] == 0
    check_against_reference(q, k, v, lts, causal=True, masked=masked | dense_bm, block_mask=paddle.to_tensor(bm))


def test_half_precision_inputs():
    """fp16 in, fp16 out and grads, against the fp32 reference on the same
    (fp16-rounded) inputs: the kernel computes in fp32, so only the final
    rounding to fp16 (at most 2**-11 relative; rtol 1e-3 is twice that) separates them."""
    rng = np.random.default_rng(0)
    lts = packed_causal_lts(1, 64, nseg=3, pad=4, rng=rng)
    q16, k16, v16 = (x.detach().astype("float16") for x in make_qkv(1, 64, 4, 2, 8, 0))
    q32, k32, v32 = (x.astype("float32") for x in (q16, k16, v16))
    for x in (q16, k16, v16, q32, k32, v32):
        x.stop_gradient = False
    out16 = flashmask_attention(q16, k16, v16, paddle.to_tensor(lts), causal=True)
    ref = reference_attention(q32, k32, v32, docstring_dense_mask(lts, True))
    assert out16.dtype == paddle.float16
    np.testing.assert_allclose(out16.astype("float32").numpy(), ref.numpy(), rtol=1e-3, atol=TOL)
    dout = np.random.default_rng(1).standard_normal(out16.shape).astype("float32")
    grads = paddle.grad([out16], [q16, k16, v16], [paddle.to_tensor(dout).astype("float16")])
    ref_grads = paddle.grad([ref], [q32, k32, v32], [paddle.to_tensor(dout).astype("float16").astype("float32")])
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert g.dtype == paddle.float16, name
        np.testing.assert_allclose(g.astype("float32").numpy(), rg.numpy(), rtol=1e-3, atol=TOL, err_msg=f"d{name}")


def test_softmax_scale():
    """softmax_scale c is the same as the default 1/sqrt(d) on q * c * sqrt(d)."""
    rng = np.random.default_rng(8)
    lts = packed_causal_lts(1, 80, nseg=3, pad=5, rng=rng)
    q, k, v = make_qkv(1, 80, 4, 2, 8, 8)
    c = 0.7
    out, _ = tiled_flashmask_attention(
        q, k, v, paddle.to_tensor(lts), causal=True, softmax_scale=c, block_q=32, block_k=32
    )
    ref = reference_attention(q * (c * math.sqrt(8)), k, v, docstring_dense_mask(lts, True))
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=TOL, rtol=0)
    dout = paddle.to_tensor(np.random.default_rng(1).standard_normal(out.shape).astype("float32"))
    for name, g, rg in zip("qkv", paddle.grad([out], [q, k, v], [dout]), paddle.grad([ref], [q, k, v], [dout])):
        np.testing.assert_allclose(g.numpy(), rg.numpy(), atol=TOL, rtol=0, err_msg=f"d{name}")


def test_errors():
    q, k, v = make_qkv(1, 16, 2, 2, 8, 0)
    one = paddle.full([1, 1, 16, 1], 16, dtype="int32")
    with pytest.raises(NotImplementedError):
        flashmask_attention(q, k, v, one, causal=True, dropout=0.1)
    np.testing.assert_array_equal(  # eval ignores dropout
        flashmask_attention(q, k, v, one, causal=True, dropout=0.1, training=False).numpy(),
        flashmask_attention(q, k, v, one, causal=True).numpy(),
    )
    with pytest.raises(ValueError):
        flashmask_attention(q, k, v, one, causal=False)  # non-causal needs 2 or 4 bounds
    with pytest.raises(ValueError):
        flashmask_attention(q, k, v, paddle.full([1, 1, 16, 4], 16, dtype="int32"), causal=True)
    with pytest.raises(ValueError):
        flashmask_attention(q, k, v, paddle.full([1, 3, 16, 1], 16, dtype="int32"), causal=True)
