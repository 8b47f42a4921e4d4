"""Benchmark: the C heap policy of a training run (``training/heap.py``), policy by policy.

    .venv/bin/python -m bench.heap_policy MODEL_DIR [--lengths 180,420,...] [--repeats 1]

Each policy runs in its own process (glibc's heap settings are per process), interleaved: the model
(a PaddleNLP Llama, e.g. ``bench/cpu_setup.py``'s 0.26B one in build/bench_e2e/llama-0.25b) with LoRA
r8 on every decoder linear and the library patches of a real run, then forward + backward of our SFT
loss on one row per ``--lengths`` entry (random tokens, a quarter of each row unsupervised; gradients
cleared every 4 micro-steps, as at accumulation 4), after one warm-up micro-step.  Policies:

* ``mmap1m``: the first policy (every block of 1 MiB or more its own mmap, trim threshold 16 MiB);
* ``mmap1m+trim``: the same, and ``malloc_trim(0)`` after every micro-step;
* ``ours``: ``training/heap.py`` now (blocks under 16 MiB from the heap, ``release_free_memory`` after
  every micro-step, as ``callbacks.HeapTrim`` does in a run);
* ``glibc``: glibc's defaults (dynamic mmap threshold), no trim.

Printed per policy: wall time of the micro-steps, user and system CPU, minor page faults, peak RSS
over the micro-steps (VmHWM after a reset: ``bench/harness.py``'s ``reset_peak``), RSS after them, and whether the losses
are bitwise those of the first policy; then ours / mmap1m.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402

ROOT = h.ROOT
POLICIES = ("mmap1m", "mmap1m+trim", "ours", "glibc")
LENGTHS = "180,420,260,610,150,330,900,240,512,200,700,300"


def child(model_dir: str, policy: str, lengths) -> dict:
    """One policy's run, in this process (called with ``--child``)."""
    import time

    from paddlenlp_ext.runtime.cpu_env import setup_cpu

    setup_cpu()
    from paddlenlp_ext.training import heap

    lib = heap._libc()
    if policy.startswith("mmap1m"):
        lib.mallopt(heap.M_MMAP_THRESHOLD, 1 << 20)
        lib.mallopt(heap.M_TRIM_THRESHOLD, 16 << 20)
    elif policy == "ours":
        assert heap.limit_heap_retention()
    trim = policy in ("ours", "mmap1m+trim")

    import numpy as np
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM

    from paddlenlp_ext.adapters.api import apply_adapters
    from paddlenlp_ext.adapters.config import AdapterConfig
    from paddlenlp_ext.integrations.dense_attention import fast_dense_attention
    from paddlenlp_ext.integrations.rms_norm import fast_rms_norm
    from paddlenlp_ext.integrations.rotary import fast_rotary
    from paddlenlp_ext.training.loss import global_token_loss

    with fast_rms_norm(), fast_rotary(), fast_dense_attention():
        paddle.seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
        apply_adapters(model, AdapterConfig(method="lora", r=8, alpha=16))
        model.train()
        rng = np.random.default_rng(1)
        rows = []
        for n in [lengths[0]] + list(lengths):  # the first: warm-up
            ids = paddle.to_tensor(rng.integers(3, 32000, (1, n)))
            labels = ids.clone()
            labels[:, : n // 4] = -100
            rows.append(({"input_ids": ids, "labels": labels}, n - n // 4))

        def micro_step(row):
            inputs, supervised = row
            loss = global_token_loss(model, dict(inputs), supervised, 1, 1)
            loss.backward()
            if trim:
                heap.release_free_memory()
            return float(loss)

        micro_step(rows[0])
        model.clear_gradients()
        assert h.reset_peak(), "cannot reset VmHWM (/proc/self/clear_refs)"  # the peak of the micro-steps only
        r0, t0 = h.usage(), time.perf_counter()
        losses = []
        for i, row in enumerate(rows[1:]):
            losses.append(micro_step(row))
            if i % 4 == 3:
                model.clear_gradients()
        wall, r1 = time.perf_counter() - t0, h.usage()
    return {
        "policy": policy,
        "wall_s": wall,
        "user_s": r1.ru_utime - r0.ru_utime,
        "sys_s": r1.ru_stime - r0.ru_stime,
        "minflt": r1.ru_minflt - r0.ru_minflt,
        "peak_mb": h.rss_peak() / 2**20,
        "after_mb": h.rss_now() / 2**20,
        "losses": losses,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--lengths", default=LENGTHS, help="tokens of each micro-step's row, comma-separated")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    if a.child:
        print(json.dumps(child(a.model_dir, a.child, lengths)))
        return 0
    policies = [x for x in a.policies.split(",") if x]
    bad = [x for x in policies if x not in POLICIES]
    if bad:
        p.error(f"unknown policies {bad}: choose from {POLICIES}")
    runs = []
    for i in range(a.repeats):
        for policy in policies:
            r = h.run(
                h.module("bench.heap_policy", a.model_dir, "--lengths", a.lengths, "--child", policy),
                name=policy,
                env=h.clean_env(PYTHONPATH=ROOT),
                mark=None,
            )
            run = json.loads(next(ln for ln in r.output.splitlines()[::-1] if ln.startswith('{"policy"')))
            runs.append(run)
            print(
                f"  {policy} #{i + 1}: wall {run['wall_s']:.1f} s, user {run['user_s']:.1f} s, sys {run['sys_s']:.1f} s, "
                f"{run['minflt'] / 1e6:.2f} M faults, peak {run['peak_mb']:,.0f} MB",
                flush=True,
            )
    first = runs[0]["losses"]
    print(f"\n{len(lengths)} micro-steps of {min(lengths)}-{max(lengths)} tokens, {a.model_dir}\n")
    med, body = {}, []
    for policy in policies:
        rs = [r for r in runs if r["policy"] == policy]
        med[policy] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("wall_s", "user_s", "sys_s", "minflt", "peak_mb", "after_mb")
        }
        m = med[policy]
        body.append(
            [
                policy,
                len(rs),
                f"{m['wall_s']:.1f} s",
                f"{m['user_s']:.1f} s",
                f"{m['sys_s']:.1f} s",
                f"{m['minflt'] / 1e6:.2f} M",
                f"{m['peak_mb']:,.0f} MB",
                f"{m['after_mb']:,.0f} MB",
                "yes" if all(r["losses"] == first for r in rs) else "NO",
            ]
        )
    if "ours" in med and "mmap1m" in med:
        o, b = med["ours"], med["mmap1m"]
        body.append(
            [
                "ours / mmap1m",
                "",
                f"{o['wall_s'] / b['wall_s']:.2f}x",
                "",
                f"{o['sys_s'] / max(b['sys_s'], 1e-9):.2f}x",
                f"{o['minflt'] / max(b['minflt'], 1):.2f}x",
                f"{o['peak_mb'] / b['peak_mb']:.2f}x",
                "",
                "",
            ]
        )
    print(
        h.table(
            [
                "policy",
                "runs",
                "wall",
                "user CPU",
                "system CPU",
                "minor faults",
                "peak RSS",
                "RSS after",
                "losses as first",
            ],
            body,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
