"""Packed documents through ``flashmask_attention``: the per-document path of kernels/varlen.py.

Against the dense masked reference (the docstring mask of Paddle's flashmask_attention): outputs and
q/k/v gradients within 1e-6; the routing (documents -> varlen, anything else -> block-sparse); and the
segmentation of start rows.
"""

import numpy as np
import paddle
import pytest

from paddlenlp_ext.kernels import flashmask_attention, flashmask_stats, tiled_flashmask_attention
from paddlenlp_ext.kernels.reference import docstring_dense_mask, reference_attention
from paddlenlp_ext.kernels.varlen import document_segments, varlen_causal_attention
from tests.test_attention import make_qkv, packed_causal_lts, random_bounds

TOL = 1e-6


def test_segments_of_packed_rows():
    rng = np.random.default_rng(0)
    lts = packed_causal_lts(1, 100, nseg=5, pad=7, rng=rng)[0, 0, :, 0]
    segs = document_segments(lts)
    docs = [(s, e) for s, e, d in segs if d]
    # each document ends at its start row; this helper's padding columns are 1-token documents
    assert [e for _, e in docs] == sorted(set(int(x) for x in lts[:93])) + list(range(94, 101))
    assert sum(e - s for s, e, _ in segs) == 100
    # our collator's padding (start row = own index: seen by no row) is one dead run
    from paddlenlp_ext.data.packed_row import build_packed_row

    row = build_packed_row([{"input_ids": [1, 2, 3], "labels": [2, 3, 4]}, {"input_ids": [5], "labels": [6]}], 8, 0)
    assert document_segments(row["attn_mask_startend_row_indices"]) == [(0, 3, True), (3, 4, True), (4, 8, False)]


def test_segments_refuse_other_layouts():
    assert document_segments(np.array([2, 3, 3])) is None  # column 0 seen by row 1, not row 2
    assert document_segments(np.array([5, 5, 5])) is None  # bound past the row
    rng = np.random.default_rng(1)
    assert document_segments(random_bounds(1, 1, 64, "causal1", rng)[0, 0, :, 0]) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2)])
def test_varlen_matches_dense_reference(seed, hq, hk):
    rng = np.random.default_rng(seed)
    b, s = 2, 160
    lts = packed_causal_lts(b, s, nseg=int(rng.integers(2, 6)), pad=int(rng.integers(0, 12)), rng=rng)
    q, k, v = make_qkv(b, s, hq, hk, 16, seed)
    tiled_flashmask_attention(q[:, :32], k[:, :32], v[:, :32], causal=True)  # known last tile statistics
    before = flashmask_stats()
    out = flashmask_attention(q, k, v, paddle.to_tensor(lts), causal=True)
    ref = reference_attention(q, k, v, docstring_dense_mask(lts, True))
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=TOL, rtol=0)
    dout = paddle.to_tensor(np.random.default_rng(9).standard_normal(out.shape).astype("float32"))
    for name, g, rg in zip("qkv", paddle.grad([out], [q, k, v], [dout]), paddle.grad([ref], [q, k, v], [dout])):
        np.testing.assert_allclose(g.numpy(), rg.numpy(), atol=TOL, rtol=0, err_msg=f"d{name}")
    assert flashmask_stats() == before  # the block-sparse kernel did not run


def test_routing():
    """Documents take the varlen path (same numbers as calling it directly); other bounds the tile kernel."""
    rng = np.random.default_rng(4)
    lts = packed_causal_lts(1, 96, nseg=3, pad=5, rng=rng)
    q, k, v = make_qkv(1, 96, 2, 2, 8, 4)
    direct = varlen_causal_attention(q, k, v, [document_segments(lts[0, 0, :, 0])], 1 / np.sqrt(8))
    np.testing.assert_array_equal(
        flashmask_attention(q, k, v, paddle.to_tensor(lts), causal=True).numpy(), direct.numpy()
    )
    other = random_bounds(1, 1, 96, "causal1", rng).astype(np.int32)
    out = flashmask_attention(q, k, v, paddle.to_tensor(other), causal=True)
    ref = reference_attention(q, k, v, docstring_dense_mask(other, True))
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=1e-5, rtol=0)
    # lse asked: the tile kernel answers (varlen keeps no lse), same output
    out2, lse = flashmask_attention(q, k, v, paddle.to_tensor(lts), causal=True, return_softmax_lse=True)
    np.testing.assert_allclose(out2.numpy(), direct.numpy(), atol=1e-5, rtol=0)


def test_padding_rows_are_zero_without_gradient():
    lts = np.array([[[[2], [2], [2], [3]]]], dtype=np.int32)  # doc [0, 2), then 2 dead columns ([2] and [3])
    q, k, v = make_qkv(1, 4, 2, 2, 4, 0)
    out = flashmask_attention(q, k, v, paddle.to_tensor(lts), causal=True)
    assert np.all(out.numpy()[0, 2:] == 0)
    (gq,) = paddle.grad([out.sum()], [q])
    assert np.all(gq.numpy()[0, 2:] == 0)
