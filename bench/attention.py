"""Benchmark of paddlenlp_ext.kernels.flashmask_attention (CPU) vs dense masked attention.

Prints:
  1. max abs error vs a dense reference (forward, dq, dk, dv) for random
     segmentations and every bound form (broadcast / per-head bounds, GQA);
  2. a NaN check on fully masked rows;
  3. forward+backward time at seq 4096 with 16 packed segments (batch 1,
     8 heads, head_dim 64, fp32): ours vs dense, side by side, with the ratio;
  4. memory: the mask-related tensors ours allocates (O(seq) bounds + per-tile
     temporaries) vs the dense mask, plus measured peak host allocations.

Run (< 3 min on 2 cores):  .venv/bin/python -m bench.attention
"""

import argparse
import math
import os
import shlex
import sys
import time

import numpy as np

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import paddle  # noqa: E402
from paddle.base import core  # noqa: E402

from bench import harness  # noqa: E402

from paddlenlp_ext import kernels as fm  # noqa: E402
from paddlenlp_ext.kernels.reference import docstring_dense_mask, reference_attention  # noqa: E402


# ---------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------
def dense_attention(q, k, v, additive_mask):
    """softmax(Q K^T / sqrt(d) + M) V, GQA by repeating k/v; M broadcasts over heads."""
    g = q.shape[2] // k.shape[2]
    if g > 1:
        k = paddle.repeat_interleave(k, g, axis=2)
        v = paddle.repeat_interleave(v, g, axis=2)
    s = paddle.matmul(q.transpose([0, 2, 1, 3]), k.transpose([0, 2, 1, 3]), transpose_y=True)
    s = s * (1.0 / math.sqrt(q.shape[-1]))  # [b, h, sq, sk]
    if additive_mask is not None:
        s = s + additive_mask
    p = paddle.nn.functional.softmax(s, -1)
    return paddle.matmul(p, v.transpose([0, 2, 1, 3])).transpose([0, 2, 1, 3])


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------
def packed_lts(batch, seq, nseg, pad, rng):
    """Causal document mask for packed rows: LTS = end of the column's example."""
    lts = np.zeros((batch, 1, seq, 1), np.int32)
    for b in range(batch):
        n = seq - pad
        cuts = sorted(rng.choice(np.arange(1, n), nseg - 1, replace=False))
        edges = [0, *cuts, n]
        for st, en in zip(edges[:-1], edges[1:]):
            lts[b, 0, st:en, 0] = en
        lts[b, 0, n:, 0] = np.arange(n, seq) + 1  # padding: each column its own example
    return lts


def random_bounds(batch, heads, seq, form, rng):
    j = np.arange(seq)

    def col():
        return rng.integers(0, seq + 1, size=(batch, heads, seq))

    if form == "causal LTS":
        return packed_lts(batch, seq, int(rng.integers(2, 9)), int(rng.integers(0, 32)), rng).repeat(heads, 1)
    if form == "causal LTS,LTE":
        lts = np.maximum(col(), j)
        lte = np.minimum(lts + rng.integers(0, seq // 2, size=lts.shape), seq)
        return np.stack([lts, lte], -1)
    if form == "non-causal LTS,UTE":
        lts, ute = col(), col()
        lts[..., ::6], ute[..., ::4] = seq, 0
        return np.stack([lts, ute], -1)
    if form == "non-causal LTS,LTE,UTS,UTE":
        lts, uts = col(), col()
        lte = np.minimum(lts + rng.integers(0, seq, size=lts.shape), seq)
        ute = np.minimum(uts + rng.integers(0, seq // 3, size=uts.shape), seq)
        return np.stack([lts, lte, uts, ute], -1)
    raise ValueError(form)


def qkv(batch, seq, hq, hk, d, seed, grad=True):
    rng = np.random.default_rng(seed)
    out = []
    for h in (hq, hk, hk):
        t = paddle.to_tensor(rng.standard_normal((batch, seq, h, d)).astype("float32"))
        t.stop_gradient = not grad
        out.append(t)
    return out


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------
def accuracy(args):
    print("\n== 1. max abs error vs dense reference (fp32; batch 2, seq 300, 8 q heads, 2 kv heads, head_dim 32)")
    print(f"{'bound form':30s} {'bound heads':12s} {'fwd':>9s} {'dq':>9s} {'dk':>9s} {'dv':>9s}")
    worst = 0.0
    forms = [
        ("causal LTS", True),
        ("causal LTS,LTE", True),
        ("non-causal LTS,UTE", False),
        ("non-causal LTS,LTE,UTS,UTE", False),
    ]
    b, s, hq, hk, d = 2, 300, 8, 2, 32
    cases = []
    for form, causal in forms:
        for heads_name, h in (("1 (bcast)", 1), (f"{hk} (per kv)", hk), (f"{hq} (per q)", hq)):
            cases.append((form, causal, heads_name, h))
    cases += [("None (causal)", True, "-", 0), ("None (full)", False, "-", 0)]
    for i, (form, causal, heads_name, h) in enumerate(cases):
        rng = np.random.default_rng(100 + i)
        q, k, v = qkv(b, s, hq, hk, d, seed=i)
        if h:
            sri = random_bounds(b, h, s, form, rng).astype(np.int32)
            masked = docstring_dense_mask(sri, causal)
            sri_t = paddle.to_tensor(sri)
        else:
            sri_t = None
            masked = np.triu(np.ones((s, s), bool), 1)[None, None] if causal else np.zeros((1, 1, s, s), bool)
        out = fm.flashmask_attention(q, k, v, sri_t, causal=causal)
        ref = reference_attention(q, k, v, masked)
        dout = paddle.to_tensor(rng.standard_normal(out.shape).astype("float32"))
        g = paddle.grad([out], [q, k, v], [dout])
        rg = paddle.grad([ref], [q, k, v], [dout])
        errs = [float((out - ref).abs().max())] + [float((x - y).abs().max()) for x, y in zip(g, rg)]
        worst = max(worst, *errs)
        print(f"{form:30s} {heads_name:12s} " + " ".join(f"{e:9.2e}" for e in errs))
    print(f"worst: {worst:.2e}  ({'OK' if worst <= 1e-5 else 'ABOVE'} 1e-5)")


def fully_masked(args):
    print("\n== 2. fully masked rows")
    s = 256
    sri = np.zeros((1, 2, s, 4), np.int32)
    sri[:, 0, :, 0], sri[:, 0, :, 1] = 100, 140  # head 0: rows 100..139 see no key
    sri[:, 1, :, 0], sri[:, 1, :, 1] = 0, 5  # head 1: rows 0..4 see no key
    q, k, v = qkv(1, s, 2, 2, 32, seed=0)
    out = fm.flashmask_attention(q, k, v, paddle.to_tensor(sri), causal=False)
    out.sum().backward()
    nan = any(bool(paddle.isnan(x).any()) for x in (out, q.grad, k.grad, v.grad))
    zero_out = float(out[0, 100:140, 0].abs().max()) + float(out[0, 0:5, 1].abs().max())
    zero_dq = float(q.grad[0, 100:140, 0].abs().max()) + float(q.grad[0, 0:5, 1].abs().max())
    print(f"NaN in out/dq/dk/dv: {nan}; max |out| on empty rows: {zero_out}; max |dq| on empty rows: {zero_dq}")


def _timed(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), min(times)


def _peak_extra(fn):
    """Peak host bytes allocated by fn above what was allocated before it."""
    base = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    fn()
    return core.host_memory_stat_peak_value("Allocated", 0) - base


def timing_and_memory(args):
    s, h, d, nseg = args.seq, args.heads, args.head_dim, args.segments
    print(
        f"\n== 3. forward+backward, batch 1, seq {s}, {nseg} packed segments (causal LTS), "
        f"{h} heads, head_dim {d}, fp32; ours = the block-sparse tile kernel"
    )
    rng = np.random.default_rng(0)
    lts = packed_lts(1, s, nseg, 0, rng)
    lengths = np.diff(np.concatenate([[0], np.unique(lts)]))
    sri = paddle.to_tensor(lts)
    q, k, v = qkv(1, s, h, h, d, seed=1)
    dout = paddle.to_tensor(np.random.default_rng(2).standard_normal((1, s, h, d)).astype("float32"))

    def ours():  # the block-sparse tile kernel (whole causal documents take kernels/varlen.py in a run)
        out, _ = fm.tiled_flashmask_attention(q, k, v, sri, causal=True)
        paddle.grad([out], [q, k, v], [dout])

    dense_mask = fm.dense_mask_from_startend(sri, s, True, additive=True)  # [1, 1, s, s] fp32, built once

    def dense():
        out = dense_attention(q, k, v, dense_mask)
        paddle.grad([out], [q, k, v], [dout])

    ours()  # warm-up (allocator, kernels)
    t_ours, t_ours_min = _timed(ours, args.reps)
    st = fm.flashmask_stats()
    dense()
    t_dense, t_dense_min = _timed(dense, max(1, args.reps // 2))
    print(f"segment lengths: {lengths.tolist()}")
    print(
        f"score entries computed: ours {st['score_elems']:,} vs dense {st['dense_score_elems']:,} "
        f"({st['score_elems'] / st['dense_score_elems']:.3f}); sum(L^2)*heads = {int((lengths**2).sum()) * h:,}"
    )
    print(
        f"tiles ({fm.BLOCK_SIZE}x{fm.BLOCK_SIZE}, up to {fm.KV_MERGE} key blocks fused): "
        f"{st['tiles_total']} total, {st['tiles_skipped']} skipped, "
        f"{st['tiles_visible']} unmasked + {st['tiles_partial']} partial computed"
    )
    print(
        harness.table(
            ["", "ours", "dense", "dense / ours"],
            [
                ["fwd+bwd median (s)", f"{t_ours:.3f}", f"{t_dense:.3f}", f"{t_dense / t_ours:.1f}x"],
                ["fwd+bwd best (s)", f"{t_ours_min:.3f}", f"{t_dense_min:.3f}", f"{t_dense_min / t_ours_min:.1f}x"],
            ],
        )
    )
    print(f"target >= 4x: {harness.verdict(t_dense / t_ours, 4, at_least=True)}")

    print("\n== 4. memory")
    mib = 1024**2
    ours_mask = st["bounds_bytes"] + st["peak_tile_mask_bytes"]
    dense_bool = st["dense_mask_bytes"]
    print(
        f"ours, mask-related: bounds {st['bounds_bytes'] / 1024:.1f} KiB (O(seq): host int64 intervals + "
        f"per-block min/max + device int32) + largest tile mask {st['peak_tile_mask_bytes'] / 1024:.1f} KiB "
        f"= {ours_mask / mib:.3f} MiB"
    )
    print(
        f"dense mask (seq x seq per bound head): {dense_bool / mib:.1f} MiB as bool, "
        f"{4 * dense_bool / mib:.1f} MiB as fp32 additive (x{h} if per-head) "
        f"-> ours is {4 * dense_bool / ours_mask:.0f}x smaller than the fp32 mask"
    )
    print(
        f"largest per-tile score temporary (all heads): {st['peak_tile_score_bytes'] / mib:.2f} MiB "
        f"vs dense scores {4 * st['dense_score_elems'] / mib:.0f} MiB"
    )
    peak_ours = _peak_extra(ours)
    peak_dense = _peak_extra(dense)
    print(
        f"measured peak host allocation during fwd+bwd (excl. inputs and the prebuilt dense mask): "
        f"ours {peak_ours / mib:.1f} MiB, dense {peak_dense / mib:.1f} MiB"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--segments", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of ours (dense: half)")
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    print("command: cd " + shlex.quote(os.getcwd()) + " && " + " ".join(shlex.quote(a) for a in [exe, *sys.argv]))
    print(
        f"paddle {paddle.__version__}, device {paddle.get_device()}, threads: "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, cpus={os.cpu_count()}"
    )
    t0 = time.time()
    if not args.skip_accuracy:
        accuracy(args)
        fully_masked(args)
    timing_and_memory(args)
    print(f"\ntotal bench time {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
