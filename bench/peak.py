"""Benchmark: this machine's limits: fp32 matmul peak through Paddle (MKL sgemm) and memory copy bandwidth.

    .venv/bin/python -m bench.peak [--shape JSON] [--vocab 32000] [--tokens 256,1024] [--square 4096]
                                   [--copy-mib 256] [--repeats 5] [--json F]

Runs with the CPU set-up every CLI of this repository applies (``paddlenlp_ext/runtime/cpu_env.py``: the
MKL/OpenMP threads and MKL's code path, decided before Paddle loads), so the peak is what a training
run of ours can reach on this machine.  It prints the CPU model and its ISA (AVX2, AVX-512 and its BF16
and VNNI extensions, AMX), then:

* **matmul**: ``paddle.matmul`` of fp32 tensors at the training shapes of a model (``--shape``: the
  end-to-end benchmark's 0.26B Llama by default) for ``--tokens`` tokens per micro-step, ``[T, in] x
  [in, out]`` for the attention projection (q/k/v/o), the MLP's up/gate and down projections, the LM head
  and a LoRA A matrix (rank 8, a thin product), and at a ``--square`` x ``--square`` shape; each
  ``--repeats`` times after a warm-up; GFLOP/s = ``2 * M * K * N`` over the best (and the median) time,
  and over the least CPU time per thread (the process's CPU seconds / threads: on a machine shared
  with other load, the wall time also counts the turns other processes took on the cores, the CPU
  time does not; it still counts OpenMP's spin-waits, so it is a hint, not the peak).
  The **peak** is the best GFLOP/s of all of them but the thin LoRA product (the square shape's, as a
  rule).
* **copy bandwidth**: a ``--copy-mib`` MiB fp32 array copied into another one already allocated (so no
  page faults are timed), by numpy (one thread) and by Paddle (``paddle.assign`` into an existing
  tensor); GB/s = bytes read + bytes written over the best time.

``--json`` writes all of it; ``bench/e2e.py`` runs this module to put each toolkit's FLOP/s against the
peak.  On a shared machine the best of several repeats is the wall-time figure least disturbed by the
other load; the load average is printed with the figures: measure the limit on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402
from bench.cpu_setup import MODEL_SHAPE  # noqa: E402
from bench.flops import decoder_linears  # noqa: E402
from paddlenlp_ext.runtime.cpu_env import parse_cpuinfo  # noqa: E402

#: the ISA flags worth naming, in /proc/cpuinfo's spelling
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info(cpuinfo: str) -> dict:
    """The CPU's model name, vendor, the ISA flags of :data:`ISA_FLAGS` it has, and its ISA class
    (``avx512`` when it has avx512f, else ``avx2``, else ``baseline``): the key the regression guard files
    its figures under.

    >>> cpu_info("vendor_id\\t: AuthenticAMD\\nmodel name\\t: AMD EPYC 7B13\\nflags\\t\\t: fpu avx2 fma avx512f avx512_bf16\\n")
    {'model': 'AMD EPYC 7B13', 'vendor': 'AuthenticAMD', 'flags': ['avx2', 'fma', 'avx512f', 'avx512_bf16'], 'isa': 'avx512'}
    """
    vendor, flags = parse_cpuinfo(cpuinfo)
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "unknown"
    )
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "baseline"
    return {"model": model, "vendor": vendor, "flags": [f for f in ISA_FLAGS if f in flags], "isa": isa}


def this_cpu() -> dict:
    """:func:`cpu_info` of this machine (``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_info(f.read())
    except OSError:
        return {"model": "unknown", "vendor": "", "flags": [], "isa": "baseline"}


def matmul_shapes(shape: dict, vocab: int, tokens: int, rank: int = 8) -> list:
    """(label, M, K, N) of the forward products of one micro-step of ``tokens`` tokens:

    >>> matmul_shapes({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}, 100, 16)[:2]
    [('q/k/v/o [16, 64] x [64, 64]', 16, 64, 64), ('up/gate [16, 64] x [64, 128]', 16, 64, 128)]
    """
    lin = decoder_linears(shape)
    hidden = shape["hidden_size"]
    picks = [
        ("q/k/v/o", *lin["q_proj"]),
        ("up/gate", *lin["up_proj"]),
        ("down", *lin["down_proj"]),
        ("LM head", hidden, vocab),
        (f"LoRA A r{rank}", hidden, rank),
    ]
    return [(f"{name} [{tokens}, {k}] x [{k}, {n}]", tokens, k, n) for name, k, n in picks]


def best_and_median(fn, repeats: int) -> tuple:
    """(best, median, least CPU) seconds of ``fn()`` over ``repeats`` timed calls after one untimed; the
    CPU seconds are this process's, all threads (``time.process_time``)."""
    times, cpu = h.time_calls(fn, repeats)
    return min(times), h.median(times), min(cpu)


def measure_matmul(m: int, k: int, n: int, repeats: int) -> dict:
    import numpy as np
    import paddle

    rng = np.random.default_rng(0)
    x = paddle.to_tensor(rng.standard_normal((m, k), dtype=np.float32))
    w = paddle.to_tensor(rng.standard_normal((k, n), dtype=np.float32))

    # a CPU kernel is synchronous: the product is done when the call returns (no copy out is timed)
    best, med, cpu = best_and_median(lambda: paddle.matmul(x, w), repeats)
    flops = 2.0 * m * k * n
    threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
    # per CPU time: what the threads did while they ran (time spent waiting for another process's turn on
    # a shared core is not counted; OpenMP's spin-waits are, so it is no upper bound either)
    return {
        "gflops": flops / best / 1e9,
        "gflops_median": flops / med / 1e9,
        "best_s": best,
        "gflops_cpu": flops / (cpu / threads) / 1e9 if cpu > 0 else None,
    }


def peak_of(results: list) -> float:
    """The peak: the best GFLOP/s of the products whose every side is at least 256 (a thin product, such as
    LoRA's rank-8 one, takes microseconds, and its timing is mostly the call's own overhead):

    >>> peak_of([{"m": 256, "k": 1024, "n": 8, "gflops": 80.0}, {"m": 4096, "k": 4096, "n": 4096, "gflops": 60.0}])
    60.0
    """
    return max(r["gflops"] for r in results if min(r["m"], r["k"], r["n"]) >= 256)


def measure_copy(mib: int, repeats: int) -> dict:
    import numpy as np
    import paddle

    n = mib * h.MiB // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.zeros(n, dtype=np.float32)
    moved = 2.0 * n * 4  # read + written
    best_np = best_and_median(lambda: np.copyto(dst, src), repeats)[0]
    ps, pd = paddle.to_tensor(src), paddle.zeros([n], dtype="float32")
    best_pd = best_and_median(lambda: paddle.assign(ps, output=pd), repeats)[0]
    return {"numpy_gbs": moved / best_np / 1e9, "paddle_gbs": moved / best_pd / 1e9, "mib": mib}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=json.loads, default=MODEL_SHAPE, help="LlamaConfig shape keys as JSON")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", default="256,1024", help="tokens per micro-step, comma-separated")
    p.add_argument("--square", type=int, default=4096)
    p.add_argument("--copy-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    from paddlenlp_ext.runtime.cpu_env import setup_cpu

    decision = setup_cpu()  # before paddle loads: the threads and code path our CLI runs with
    import paddle

    paddle.set_device("cpu")
    cpu = this_cpu()
    threads = os.environ.get("OMP_NUM_THREADS")
    print(
        f"CPU: {cpu['model']} ({cpu['vendor']}), ISA {cpu['isa']}: {' '.join(cpu['flags']) or '-'}; "
        f"{threads} threads; paddle {paddle.__version__}; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    print(decision.text, flush=True)
    shapes = [s for t in a.tokens.split(",") if t for s in matmul_shapes(a.shape, a.vocab, int(t))]
    shapes.append((f"square [{a.square}, {a.square}] x [{a.square}, {a.square}]", a.square, a.square, a.square))
    rows, results = [], []
    for label, m, k, n in shapes:
        r = measure_matmul(m, k, n, a.repeats)
        results.append({"label": label, "m": m, "k": k, "n": n, **r})
        rows.append(
            [
                label,
                h.fmt(r["gflops"], ".1f"),
                h.fmt(r["gflops_median"], ".1f"),
                h.fmt(r["gflops_cpu"], ".1f"),
                f"{r['best_s'] * 1e3:.2f} ms",
            ]
        )
        print(f"  {label}: {r['gflops']:.1f} GFLOP/s", flush=True)
    peak = peak_of(results)
    copy = measure_copy(a.copy_mib, a.repeats)
    print()
    print(
        h.table(
            [
                "fp32 matmul (paddle.matmul, MKL)",
                "GFLOP/s (best)",
                "GFLOP/s (median)",
                "GFLOP/s per thread CPU time",
                "best time",
            ],
            rows,
        )
    )
    print(
        f"\npeak: {peak:.1f} GFLOP/s; copy bandwidth ({a.copy_mib} MiB, read + written): "
        f"{copy['numpy_gbs']:.1f} GB/s numpy (1 thread), {copy['paddle_gbs']:.1f} GB/s paddle.assign"
    )
    h.write_json(
        a.json,
        {
            "cpu": cpu,
            "threads": threads,
            "paddle": paddle.__version__,
            "matmul": results,
            "peak_gflops": peak,
            "copy": copy,
            "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
