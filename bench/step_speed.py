"""Benchmark: our training step, this checkout vs an older one, through the CLI.

    git archive <old-commit> paddlenlp_ext llm | tar -x -C build/step_before
    .venv/bin/python -m bench.step_speed --before build/step_before [--steps 4] [--repeats 2] [--packing]

The same LoRA fine-tune as ``bench/cpu_setup.py`` (random PaddleNLP Llama, hidden 1024 /
intermediate 2816 / 16 layers, Llama-2 tokenizer, alpaca_en_demo, LoRA r8 / alpha 16 on every
decoder linear, lr 1e-4, max_length 1024, batch 1 x accumulation 4, fp32, the CPU set-up on) runs
through ``llm/run_finetune.py`` of the old checkout (``--before``: a directory holding its
``paddlenlp_ext`` and ``llm``, put first on PYTHONPATH) and of this one, in separate processes,
interleaved (before, after, before, after, ...).  ``--packing`` adds ``zero_padding`` +
``greedy_zero_padding`` (``--flash-mask`` also ``use_flash_attention`` + ``flash_mask``: the CPU
FlashMask kernel instead of the dense mask).  Printed: supervised tokens/s, median step time,
peak RSS and CPU% per run, the means, the after/before ratios and the largest relative
difference between the per-step losses of the two checkouts (the speed-ups must not change them).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.cpu_setup import ROOT, ab_runs, compare, ensure_data, ensure_model, loss_rel_diff, run_once  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="directory with the old checkout's paddlenlp_ext and llm")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--packing", action="store_true", help="zero_padding + greedy_zero_padding")
    p.add_argument("--flash-mask", action="store_true", help="with --packing: use_flash_attention + flash_mask")
    p.add_argument("--scratch", default=os.path.join(ROOT, "build", "bench_step_speed"))
    a = p.parse_args(argv)
    model_dir = os.path.join(a.scratch, "llama-0.25b")
    ensure_model(model_dir)
    data_dir = ensure_data(a.scratch)
    extra = ["--zero_padding", "true", "--greedy_zero_padding", "true"] if a.packing else []
    if a.flash_mask:
        extra += ["--use_flash_attention", "true", "--flash_mask", "true"]
    roots = {"before": os.path.abspath(a.before), "after": ROOT}
    runs = ab_runs(
        roots,
        a.repeats,
        lambda name, i: run_once(
            "on",
            model_dir,
            data_dir,
            os.path.join(a.scratch, f"run_{name}_{i}"),
            a.steps,
            extra,
            cli=os.path.join(roots[name], "llm", "run_finetune.py"),
            root=roots[name],
        ),
        lambda name, i, r: (
            f"  {name} #{i + 1}: {r['sup_tok_s']:.1f} supervised tok/s, step {r['step_s']:.2f} s, "
            f"RSS {r['peak_rss_gib']:.2f} GiB, CPU {r['cpu_pct'] or 0:.0f}%, losses {r['losses']}"
        ),
    )
    print(compare(runs, "checkout", "before", "after"))
    print(
        f"\nper-step losses, after vs before: largest relative difference "
        f"{loss_rel_diff(runs['after'], runs['before']):.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
