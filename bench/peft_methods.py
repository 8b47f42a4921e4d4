"""Benchmark: full fine-tuning vs LoRA, rsLoRA, LoRA+, PiSSA, VeRA and NEFTune on the tiny model.

Run from the repo root (about 3 minutes on a 2-core CPU):

    .venv/bin/python -m bench.peft_methods

Every method runs the real CLI (`llm/run_finetune.py`) as a subprocess on the tiny
configs (llm/config/tiny/*.json) with the same steps, batch size, seed and data,
evaluating on the dev split before and after training. One table is printed
(markdown): trainable parameters, peak RSS of the training process
(the harness's; for a model this small it is dominated by the Paddle runtime), step time (train_time_s / global_steps, includes the first
step's warm-up), the median step time over the 10-step logging intervals (less
sensitive to load from other processes), eval loss before and after training.

Learning rates are per method family: full fine-tuning 3e-3 and the LoRA family
1e-2 (the tiny configs' own values); VeRA trains only r + out_features scalars per
layer and needs a much larger lr (3e-1 was best of 3e-1 / 1 / 3 at 100 steps). A
second VeRA row at the LoRA lr shows what happens without that.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402

REPO = Path(h.ROOT)
CLI = REPO / "llm" / "run_finetune.py"
LORA_CFG = REPO / "llm" / "config" / "tiny" / "lora_argument.json"
SFT_CFG = REPO / "llm" / "config" / "tiny" / "sft_argument.json"

LR_FULL, LR_LORA, LR_VERA = 3e-3, 1e-2, 3e-1

# name -> (config, learning rate, extra CLI args)
METHODS = {
    "full": (SFT_CFG, LR_FULL, []),
    "lora": (LORA_CFG, LR_LORA, []),
    "rslora": (LORA_CFG, LR_LORA, ["--rslora", "true"]),
    "lora+ (scale 16)": (LORA_CFG, LR_LORA, ["--lora_plus_scale", "16"]),
    "pissa": (LORA_CFG, LR_LORA, ["--pissa", "true"]),
    "vera": (LORA_CFG, LR_VERA, ["--vera", "true", "--lora", "false"]),
    "vera @ LoRA lr": (LORA_CFG, LR_LORA, ["--vera", "true", "--lora", "false"]),
    "neftune + lora": (LORA_CFG, LR_LORA, ["--neftune", "true", "--neftune_noise_alpha", "5"]),
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def shared_args(args, lr: str) -> list:
    """The overrides every method runs with (``lr``: the method's learning rate as text)."""
    return h.flags(
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        seed=args.seed,
        learning_rate=lr,
        eval_before_train="true",
    )


def run_method(name, python, args, out_root: Path):
    config, lr, extra = METHODS[name]
    out = out_root / slug(name)
    cmd = [
        python,
        str(CLI),
        str(config),
        "--output_dir",
        str(out),
        *shared_args(args, f"{lr:g}"),
        "--do_eval",
        "true",
        "--logging_steps",
        "10",
        "--model_name_or_path",
        str(args.model),
        "--dataset_name_or_path",
        str(args.data),
        *extra,
    ]
    r = h.run(cmd, name=name, out_dir=str(out), check=False)
    if not r.ok:
        print(f"!! {name} failed (exit {r.returncode}): {shlex.join(cmd)}\n{r.tail()}", file=sys.stderr, flush=True)
        return {"name": name, "lr": lr, "failed": True, "wall": r.wall_s}
    s = r.summary
    # per logging interval (10 steps): robust to the first step's warm-up and to short load spikes
    intervals = sorted(x["interval_runtime"] / 10 for x in r.trainer_state()["log_history"] if "interval_runtime" in x)
    return {
        "name": name,
        "lr": lr,
        "failed": False,
        "wall": r.wall_s,
        "method": s["method"],
        "trainable": s["trainable_params"],
        "total": s["total_params"],
        "rss": r.peak_rss_bytes,
        "step_ms": 1000.0 * s["train_time_s"] / s["global_steps"],
        "steps": s["global_steps"],
        "median_ms": 1000.0 * intervals[len(intervals) // 2] if intervals else float("nan"),
        "tok_s": s["tokens_per_second"],
        "before": s["eval_loss_before_train"],
        "after": s["eval_loss"],
        "train_loss": s["train_loss"],
    }


def table(rows):
    head = [
        "method",
        "run_summary method",
        "lr",
        "trainable params",
        "peak RSS (MiB)",
        "step time (ms)",
        "median step (ms)",
        "eval loss before",
        "eval loss after",
    ]
    body = []
    for r in rows:
        if r["failed"]:
            body.append([r["name"], "FAILED", f"{r['lr']:g}"] + [""] * (len(head) - 3))
            continue
        body.append(
            [
                r["name"],
                f"`{r['method']}`",
                f"{r['lr']:g}",
                f"{r['trainable']:,} ({100.0 * r['trainable'] / r['total']:.2f}%)",
                f"{r['rss'] / h.MiB:.0f}",
                f"{r['step_ms']:.0f}",
                f"{r['median_ms']:.0f}",
                f"{r['before']:.3f}",
                f"{r['after']:.3f}",
            ]
        )
    return h.table(head, body)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size (tiny configs: 16)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--model", default=str(REPO / "build" / "tiny-llama"))
    p.add_argument("--data", default=str(REPO / "llm" / "data" / "advertise"))
    p.add_argument("--out", default=str(REPO / "output" / "bench_peft"), help="one output_dir per method under here")
    h.names_arg(p, "--methods", METHODS)
    args = p.parse_args(argv)

    python = sys.executable
    shown = os.path.relpath(python, REPO) if python.startswith(str(REPO)) else python
    print("command: " + shlex.join([shown, "-m", "bench.peft_methods", *(sys.argv[1:] if argv is None else argv)]))
    print(
        "each method: "
        + shlex.join(
            [
                shown,
                "llm/run_finetune.py",
                "llm/config/tiny/{sft,lora}_argument.json",
                *shared_args(args, "LR"),
                "[method flags]",
            ]
        ),
        flush=True,
    )
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"no tiny model at {args.model}: run `.venv/bin/python llm/tools/make_tiny_model.py` first")
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)

    rows, t0 = [], time.time()
    for name in args.methods:
        row = run_method(name, python, args, out_root)
        rows.append(row)
        status = "FAILED" if row["failed"] else f"eval {row['before']:.3f} -> {row['after']:.3f}"
        print(f"  {name:<18} {status}  ({row['wall']:.1f} s)", flush=True)
    print(
        f"\n{args.steps} steps, batch {args.batch_size}, seed {args.seed}, tiny model "
        f"({Path(args.model).name}), data {Path(args.data).name}; total {time.time() - t0:.0f} s\n"
    )
    print(table(rows))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
