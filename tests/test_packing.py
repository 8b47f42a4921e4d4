"""Tests for sequence packing: data.binpack, data.packed_row, data.packing (pure numpy, a few seconds)."""

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paddlenlp_ext.data import binpack, packed_row, packing
from paddlenlp_ext.data.binpack import (
    DEFAULT_GROUP_SIZE,
    batch_padding_ratio,
    best_fit_decreasing,
    greedy_pack,
    pack_in_order,
    padding_ratio,
    shuffle_packs,
)
from paddlenlp_ext.data.packed_row import build_packed_row, collate_packed, startend_to_dense_mask
from paddlenlp_ext.data.packing import PackedDataset

ROOT = str(Path(__file__).resolve().parents[1])


def _realistic_lengths(n, cap, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(150), 0.7, n)), 17, cap).astype(np.int64)


def _check_partition(packs, lengths, cap):
    flat = [i for p in packs for i in p]
    assert sorted(flat) == list(range(len(lengths))), "every index exactly once"
    for p in packs:
        assert len(p) > 0
        assert sum(lengths[i] for i in p) <= cap


def _ex(n, base=0, labels=None):
    ids = list(range(base + 1, base + 1 + n))
    return {"input_ids": ids, "labels": labels if labels is not None else ids[1:] + [2]}


# --------------------------------------------------------------------------- docstrings
@pytest.mark.parametrize("module, examples", [(binpack, 13), (packed_row, 12), (packing, 4)])
def test_docstring_examples(module, examples):
    res = doctest.testmod(module, verbose=False)
    assert res.attempted >= examples  # the worked examples are there, and they all hold
    assert res.failed == 0


def test_no_paddle_import():
    # the packing modules must stay paddle-free; check in a fresh interpreter (other tests may import paddle)
    code = (
        "import sys, paddlenlp_ext.data.binpack, paddlenlp_ext.data.packed_row, paddlenlp_ext.data.packing; "
        "sys.exit(int(any(m.split('.')[0] == 'paddle' for m in sys.modules)))"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# --------------------------------------------------------------------------- worked examples
def test_worked_examples():
    assert pack_in_order([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    assert best_fit_decreasing([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    assert pack_in_order([6, 5, 2, 3], 8) == [[0], [1, 2], [3]]
    assert best_fit_decreasing([6, 5, 2, 3], 8) == [[0, 2], [1, 3]]
    assert greedy_pack([6, 5, 2, 3], 8) == [[0, 2], [1, 3]]
    assert greedy_pack([6, 5, 2, 3], 8, group_size=2) == [[0], [1], [2, 3]]
    # best fit: the 3 goes into the bin with 3 left, not the one with 4 left
    assert best_fit_decreasing([5, 4, 3], 8) == [[0, 2], [1]]
    assert pack_in_order([], 8) == [] and best_fit_decreasing([], 8) == [] and greedy_pack([], 8) == []
    assert pack_in_order([8, 8], 8) == [[0], [1]]


def test_bfd_tie_breaks_are_stable():
    # equal lengths keep data order, and equal remaining room goes to the oldest bin
    assert best_fit_decreasing([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert best_fit_decreasing([3, 3, 3, 3, 3, 3], 9) == [[0, 1, 2], [3, 4, 5]]


# --------------------------------------------------------------------------- properties
@pytest.mark.parametrize("cap", [7, 64, 1024])
def test_bfd_capacity_and_partition(cap):
    rng = np.random.default_rng(cap)
    for _ in range(20):
        lengths = rng.integers(1, cap + 1, size=rng.integers(1, 300)).tolist()
        packs = best_fit_decreasing(lengths, cap)
        _check_partition(packs, lengths, cap)
        # BFD is never worse than in-order first fit on the same data
        assert len(packs) <= len(pack_in_order(lengths, cap))
        # best fit is an any-fit rule: a row is opened only when the example fits no open row, so no two
        # rows could be merged (the two emptiest rows together exceed capacity)
        loads = sorted(sum(lengths[i] for i in p) for p in packs)
        assert len(loads) < 2 or loads[0] + loads[1] > cap


def test_pack_in_order_is_contiguous():
    lengths = _realistic_lengths(3000, 1024).tolist()
    packs = pack_in_order(lengths, 1024)
    _check_partition(packs, lengths, 1024)
    assert [i for p in packs for i in p] == list(range(len(lengths)))
    for a, b in zip(packs, packs[1:]):  # a new row starts only when the next example doesn't fit
        assert sum(lengths[i] for i in a) + lengths[b[0]] > 1024


def test_greedy_pack_windows():
    lengths = _realistic_lengths(5000, 2048, seed=1)
    g = 700
    packs = greedy_pack(lengths, 2048, group_size=g)
    _check_partition(packs, lengths.tolist(), 2048)
    for p in packs:  # no pack mixes windows
        assert len({i // g for i in p}) == 1
    # window order is kept: the window id never decreases along the pack list
    wins = [p[0] // g for p in packs]
    assert wins == sorted(wins)
    # each window equals BFD on that window alone, shifted
    for w0 in range(0, len(lengths), g):
        sub = best_fit_decreasing(lengths[w0 : w0 + g], 2048)
        got = [[i - w0 for i in p] for p in packs if p[0] // g == w0 // g]
        assert got == sub
    # one window covering everything == plain BFD
    assert greedy_pack(lengths, 2048, group_size=len(lengths)) == best_fit_decreasing(lengths, 2048)


def test_greedy_padding_target():
    lengths = _realistic_lengths(200_000, 2048, seed=2)
    packs = greedy_pack(lengths, 2048)
    _check_partition(packs, lengths, 2048)
    assert padding_ratio(packs, lengths, 2048) <= 0.005
    assert padding_ratio(packs, lengths, 2048) * 5 <= padding_ratio(pack_in_order(lengths, 2048), lengths, 2048)
    assert DEFAULT_GROUP_SIZE == 2048


def _python_lines_run(module, fn, *args):
    """Python lines executed inside ``module`` while ``fn(*args)`` runs: a machine-independent measure of work."""
    count = 0

    def in_module(frame, event, arg):
        nonlocal count
        count += event == "line"
        return in_module

    def on_call(frame, event, arg):
        return in_module if frame.f_code.co_filename == module.__file__ else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        fn(*args)
    finally:
        sys.settrace(previous)
    return count


def test_bfd_work_is_linear_in_the_number_of_examples():
    # Speed is timed in bench/packing.py (1M lengths); here the work itself is counted, which is deterministic.
    # One window of n examples: each example costs a constant number of Python steps (the best-fit search is a
    # C bisect, not a Python scan over the open rows), so 4x the examples is ~4x the lines, not ~16x.
    small = _python_lines_run(binpack, best_fit_decreasing, _realistic_lengths(2_000, 2048, seed=4), 2048)
    large = _python_lines_run(binpack, best_fit_decreasing, _realistic_lengths(8_000, 2048, seed=4), 2048)
    assert 2_000 <= small and large <= 4.5 * small, (small, large)


def test_determinism():
    lengths = _realistic_lengths(4000, 1024, seed=3)
    assert greedy_pack(lengths, 1024) == greedy_pack(list(lengths), 1024)  # list or array input alike
    packs = greedy_pack(lengths, 1024)
    a = shuffle_packs(packs, seed=7, epoch=1)
    # a resumed run is another process: packs and order must not depend on it (hash seed, pid, time)
    code = (
        "import json, sys, numpy as np; from paddlenlp_ext.data.binpack import greedy_pack, shuffle_packs; "
        "lengths = np.array(json.loads(sys.stdin.read())); packs = greedy_pack(lengths, 1024); "
        "print(json.dumps([packs, shuffle_packs(packs, seed=7, epoch=1)]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(lengths.tolist()),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    )
    assert json.loads(other.stdout) == [packs, a]
    assert a != shuffle_packs(packs, seed=7, epoch=2)
    assert a != shuffle_packs(packs, seed=8, epoch=1)
    assert sorted(map(tuple, a)) == sorted(map(tuple, packs))


# --------------------------------------------------------------------------- errors
def test_overlong_raises_with_index():
    for fn in (pack_in_order, best_fit_decreasing, greedy_pack):
        with pytest.raises(ValueError, match="example 2 "):
            fn([3, 4, 9, 2, 10], 8)
        with pytest.raises(ValueError, match="example 1 "):
            fn([3, 0, 2], 8)
    ex = [_ex(3), _ex(5), _ex(9)]
    with pytest.raises(ValueError, match="example 2 "):
        PackedDataset(ex, max_length=8, pad_token_id=0)
    with pytest.raises(ValueError, match="example 1"):
        PackedDataset([_ex(3), {"input_ids": [1, 2], "labels": [1]}], max_length=8, pad_token_id=0)
    with pytest.raises(ValueError, match="max_length"):
        build_packed_row([_ex(5), _ex(4)], 8, 0)
    with pytest.raises(ValueError):
        greedy_pack([1, 2], 8, group_size=0)


# --------------------------------------------------------------------------- rows and masks
def test_build_packed_row_hand_checked():
    a = {"input_ids": [11, 12, 13], "labels": [12, 13, 2]}
    b = {"input_ids": [21, 22], "labels": [-100, 2]}
    r = build_packed_row([a, b], 8, pad_token_id=0)
    assert r["input_ids"].tolist() == [11, 12, 13, 21, 22, 0, 0, 0]
    assert r["labels"].tolist() == [12, 13, 2, -100, 2, -100, -100, -100]
    assert r["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert r["attn_mask_startend_row_indices"].tolist() == [3, 3, 3, 5, 5, 5, 5, 5]
    assert r["input_ids"].dtype == np.int64 and r["labels"].dtype == np.int64
    assert r["position_ids"].dtype == np.int64
    assert r["attn_mask_startend_row_indices"].dtype == np.int32
    # a full row has no padding
    full = build_packed_row([a, b, {"input_ids": [31, 32, 33], "labels": [32, 33, 2]}], 8, 0)
    assert full["attn_mask_startend_row_indices"].tolist() == [3, 3, 3, 5, 5, 8, 8, 8]
    assert full["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]


def test_dense_mask_is_block_diagonal_causal_and_padding_masked():
    rng = np.random.default_rng(5)
    L = 64
    for _ in range(10):
        lens = []
        while True:
            n = int(rng.integers(1, 20))
            if sum(lens) + n > L:
                break
            lens.append(n)
        exs = [_ex(n, base=100 * k) for k, n in enumerate(lens)]
        r = build_packed_row(exs, L, pad_token_id=0)
        m = startend_to_dense_mask(r["attn_mask_startend_row_indices"])
        assert m.shape == (L, L) and m.dtype == np.bool_
        seg = np.full(L, -1)
        off = 0
        for k, n in enumerate(lens):
            seg[off : off + n] = k
            off += n
        real = seg >= 0
        expected = np.tril(np.ones((L, L), dtype=bool)) & (seg[:, None] == seg[None, :]) & real[:, None] & real[None, :]
        np.testing.assert_array_equal(m, expected)
        # no row ever sees a padding key, and padding rows see nothing
        assert not m[:, ~real].any()
        assert not m[~real].any()
        # padding labels are ignored; a label never crosses a boundary: the last position of each example
        # holds that example's own (pre-shifted) label, not the next example's first token
        assert (r["labels"][~real] == -100).all()
        off = 0
        for ex in exs:
            n = len(ex["input_ids"])
            assert r["labels"][off + n - 1] == ex["labels"][-1]
            np.testing.assert_array_equal(r["position_ids"][off : off + n], np.arange(n))
            off += n
        # the collated [B,1,L,1] form gives the same dense mask
        b = collate_packed([r])
        np.testing.assert_array_equal(startend_to_dense_mask(b["attn_mask_startend_row_indices"][0]), m)


def test_collate_shapes_and_dtypes():
    rows = [build_packed_row([_ex(3), _ex(2)], 8, 0), build_packed_row([_ex(8)], 8, 0)]
    b = collate_packed(rows)
    assert b["input_ids"].shape == (2, 8) and b["input_ids"].dtype == np.int64
    assert b["labels"].shape == (2, 8) and b["labels"].dtype == np.int64
    assert b["position_ids"].shape == (2, 8) and b["position_ids"].dtype == np.int64
    assert b["attn_mask_startend_row_indices"].shape == (2, 1, 8, 1)
    assert b["attn_mask_startend_row_indices"].dtype == np.int32
    assert b["attn_mask_startend_row_indices"][1, 0, :, 0].tolist() == [8] * 8
    with pytest.raises(ValueError):
        collate_packed([rows[0], build_packed_row([_ex(3)], 4, 0)])


# --------------------------------------------------------------------------- stats
def test_padding_ratio_helpers():
    assert padding_ratio([[0, 1], [2, 3]], [5, 3, 4, 2], 8) == 0.125
    assert padding_ratio([], [], 8) == 0.0
    assert batch_padding_ratio([5, 3, 4, 2], 2) == pytest.approx(1 - 14 / 18)
    # last partial batch is padded to its own size: (4,4,1)->12, (7)->7
    assert batch_padding_ratio([4, 4, 1, 7], 3) == pytest.approx(1 - 16 / 19)
    assert batch_padding_ratio([3, 3, 3], 1) == 0.0


def test_packed_dataset_stats_and_epochs():
    lens = [6, 5, 2, 3, 4]
    exs = []
    for k, n in enumerate(lens):
        labels = [-100] * (n // 2) + list(range(n - n // 2))  # first half of each example unsupervised
        exs.append(_ex(n, base=10 * k, labels=labels))
    ds = PackedDataset(exs, max_length=8, pad_token_id=0, greedy=True, seed=3)
    # BFD: 6->A(2 left) 5->B(3) 4->C(4) 3->B(0) 2->A(0)
    assert sorted(ds.packs) == [[0, 2], [1, 3], [4]]
    s = ds.stats()
    assert s == {
        "examples": 5,
        "packs": 3,
        "tokens": 20,
        "padding_ratio": pytest.approx(1 - 20 / 24),
        "supervised_tokens": 3 + 3 + 1 + 2 + 2,
        "supervised_fraction": pytest.approx(11 / 20),
    }
    assert len(ds) == 3
    # every row is consistent with its pack
    for i in range(len(ds)):
        row = ds[i]
        pack = ds.packs[i]
        n_real = sum(lens[k] for k in pack)
        assert row["input_ids"].shape == (8,)
        assert (row["labels"][n_real:] == -100).all()
        assert row["input_ids"][: lens[pack[0]]].tolist() == exs[pack[0]]["input_ids"]
    # epochs: deterministic, content unchanged
    ds2 = PackedDataset(exs, max_length=8, pad_token_id=0, greedy=True, seed=3)
    orders = []
    for ep in range(6):
        ds.set_epoch(ep)
        ds2.set_epoch(ep)
        assert ds.packs == ds2.packs
        assert sorted(ds.packs) == [[0, 2], [1, 3], [4]]
        orders.append(tuple(map(tuple, ds.packs)))
    assert len(set(orders)) > 1
    ds.set_epoch(2)
    again = tuple(map(tuple, ds.packs))
    assert again == orders[2]
    # in-order zero padding, no shuffle
    ds3 = PackedDataset(exs, max_length=8, pad_token_id=0, greedy=False, shuffle=False)
    assert ds3.packs == [[0], [1, 2], [3, 4]]
    assert ds3.stats()["packs"] == 3
    b = collate_packed([ds3[i] for i in range(len(ds3))])
    assert b["input_ids"].shape == (3, 8)
    assert b["attn_mask_startend_row_indices"][1, 0, :, 0].tolist() == [5, 5, 5, 5, 5, 7, 7, 7]
