"""Benchmark (issue 26 item 3): our training step, this checkout vs an older one, through the CLI.

    git archive <old-commit> paddlenlp_ext llm | tar -x -C build/step_before
    .venv/bin/python bench/step_speed.py --before build/step_before [--steps 4] [--repeats 2] [--packing]

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
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_setup import CONFIG, STEP_LINE, cpu_seconds, ensure_data, ensure_model, read_run  # noqa: E402


def run_once(root: str, model_dir: str, data_dir: str, out_dir: str, steps: int, extra) -> dict:
    env = {**os.environ, "PYTHONPATH": root}
    cmd = [sys.executable, os.path.join(root, "llm", "run_finetune.py"), CONFIG, "--model_name_or_path", model_dir,
           "--dataset_name_or_path", data_dir, "--output_dir", out_dir, "--overwrite_output_dir", "true",
           "--max_steps", str(steps), "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4",
           "--learning_rate", "1e-4", "--warmup_steps", "0", "--lora_rank", "8", "--lora_alpha", "16",
           "--max_length", "1024", "--src_length", "1024", "--logging_steps", "1", "--do_eval", "false",
           "--eval_before_train", "false", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "42", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marks, tail = [], []
    for line in proc.stdout:
        tail = (tail + [line.rstrip("\n")])[-40:]
        if STEP_LINE.match(line):
            try:
                marks.append((time.perf_counter(), cpu_seconds(proc.pid)))
            except OSError:  # the process ended between the line and the read
                pass
    err = proc.stderr.read()
    if proc.wait() != 0:
        sys.exit(f"run in {root} failed:\n" + "\n".join(tail) + "\n" + err[-4000:])
    return read_run(out_dir, marks)

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
    runs = {"before": [], "after": []}
    for i in range(a.repeats):
        for name, root in roots.items():
            r = run_once(root, model_dir, data_dir, os.path.join(a.scratch, f"run_{name}_{i}"), a.steps, extra)
            runs[name].append(r)
            print(f"  {name} #{i + 1}: {r['sup_tok_s']:.1f} supervised tok/s, step {r['step_s']:.2f} s, "
                  f"RSS {r['peak_rss_gib']:.2f} GiB, CPU {r['cpu_pct'] or 0:.0f}%, losses {r['losses']}", flush=True)
    print("\n| checkout | runs | supervised tok/s | step time | peak RSS | CPU% in steps |\n|---|---|---|---|---|---|")
    means = {}
    for name, rows in runs.items():
        means[name] = {k: statistics.mean(r[k] for r in rows) for k in ("sup_tok_s", "step_s", "peak_rss_gib")}
        cpu = statistics.mean(r["cpu_pct"] or 0 for r in rows)
        each = ", ".join(f"{r['sup_tok_s']:.1f}" for r in rows)
        print(f"| {name} | {len(rows)} | {means[name]['sup_tok_s']:.1f} ({each}) | {means[name]['step_s']:.2f} s "
              f"| {means[name]['peak_rss_gib']:.2f} GiB | {cpu:.0f}% |")
    b, f = means["before"], means["after"]
    print(f"| after / before | | {f['sup_tok_s'] / b['sup_tok_s']:.2f}x | {f['step_s'] / b['step_s']:.2f}x "
          f"| {f['peak_rss_gib'] / b['peak_rss_gib']:.2f}x | |")
    diff = max(abs(x - y) / abs(y) for ra, rb in zip(runs["after"], runs["before"])
               for x, y in zip(ra["losses"], rb["losses"]))
    print(f"\nper-step losses, after vs before: largest relative difference {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
