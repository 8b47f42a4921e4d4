"""Calibration of the memory planner (paddlenlp_ext.planner) against real CPU runs through the CLI.

    .venv/bin/python -m bench.plan_memory [--runs full-0.3b,lora-0.8b,nf4-0.8b] [--steps 2] [--json out.json]

Every run is ``llm/run_finetune.py`` in its own process, one after the other, through the bench harness
(the kernel's peak RSS of that process, as ``/usr/bin/time -f %M`` reports it):

    full-0.3b  full fine-tuning of a 296,784,896-parameter random-weight Llama (hidden 1024, 18 layers,
               intermediate 2816, 16 heads, vocab 32000; built once into build/llama-0.3b)
    lora-0.8b  LoRA r=8 on the 839,444,480-parameter Llama of bench/big_model.py (build/llama-0.8b)
    nf4-0.8b   the same LoRA on the nf4 + double-quantized base (QLoRA)
    lora-0.8b-512-rc  the LoRA run at 512 tokens with recompute (settings the activation fit never saw)

all (but the last) at batch 1 x 256 tokens (every row padded to 256), fp32 (the CPU build has no bf16 matmul),
AdamW, no recompute, ``--max_steps 2 --save_strategy no --do_eval false``.  Next to each measured
peak the planner's estimate for the same config and overrides (``target="cpu"``) and the ratio;
target: every ratio within 1 +- 0.15.  The planner's framework-overhead term on CPU is the
Paddle + PaddleNLP runtime (RSS before the model is built: imports, tokenizer, data), measured
here in every run and printed next to the constant the planner uses.

``--gpu_table`` prints instead (no runs, no paddle) the planner's table for Llama-2 7B/13B/70B on GPUs
(full bf16 O2 AdamW, LoRA and QLoRA nf4 from llm/config/llama/*_argument.json at batch 1 x 1024 with
recompute and flash attention) across common layouts, next to LLaMA-Factory's published estimates.

The runs take minutes each and 2-8 GB of RAM: the script waits (up to --wait_s) until
MemAvailable exceeds the planner's estimate + 2 GiB before starting a run, and refuses if it never
does.  The models and data are built once by bench/big_model.py (in subprocesses, so this process
never imports paddle).
"""

import argparse
import json
import os
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402

ROOT, GiB = h.ROOT, h.GiB
CLI = os.path.join("llm", "run_finetune.py")
TARGET = 0.15  # |planned / measured - 1| <= 0.15
MARGIN = 2 * GiB  # free memory wanted beyond the planned peak before a run starts

SMALL_DIR = os.path.join(ROOT, "build", "llama-0.3b")
BIG_DIR = os.path.join(ROOT, "build", "llama-0.8b")
DATA_DIR = os.path.join(ROOT, "build", "alpaca_en_demo")
SMALL_SHAPE = h.llama_shape(1024, 2816, 18, 16, 16, vocab_size=32000, max_position_embeddings=2048)

LORA = ["--lora", "true", "--lora_rank", "8"]
# name -> (base config, model dir, extra overrides, what it is)
RUNS = {
    "full-0.3b": ("llm/config/tiny/sft_argument.json", SMALL_DIR, [], "full fine-tuning, 0.30B Llama"),
    "lora-0.8b": ("llm/config/tiny/lora_argument.json", BIG_DIR, LORA, "LoRA r=8, 0.84B Llama"),
    "nf4-0.8b": (
        "llm/config/tiny/lora_argument.json",
        BIG_DIR,
        LORA + ["--weight_quantize_algo", "nf4", "--weight_double_quant", "true"],
        "QLoRA nf4 + double quant, LoRA r=8, 0.84B Llama",
    ),
    # a point outside the activation fit's settings: twice the tokens, and recompute
    "lora-0.8b-512-rc": (
        "llm/config/tiny/lora_argument.json",
        BIG_DIR,
        LORA + ["--max_length", "512", "--src_length", "256", "--recompute", "true"],
        "LoRA r=8, 0.84B Llama, batch 1 x 512, recompute",
    ),
}

BUILD_SMALL = r"""
import json, os, sys
import numpy as np
from bench import big_model
from paddlenlp.transformers import LlamaConfig
model_dir, shape = sys.argv[1], json.loads(sys.argv[2])
if not os.path.isfile(os.path.join(model_dir, big_model.MARKER)):
    os.makedirs(model_dir, exist_ok=True)
    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], **shape)
    shapes = big_model.lazy_shapes(cfg)
    n_shards, total = big_model.write_shards(model_dir, shapes)
    cfg.save_pretrained(model_dir)
    big_model.write_tokenizer(model_dir)
    n = sum(int(np.prod(s)) for s in shapes.values())
    with open(os.path.join(model_dir, big_model.MARKER), "w") as f:
        json.dump({"params": n, "shards": n_shards, "total_bytes": total}, f)
print(open(os.path.join(model_dir, big_model.MARKER)).read())
"""


def common_overrides(model_dir, out_dir, steps, data_dir=DATA_DIR):
    """``llm/run_finetune.py``'s overrides of a memory run (bench/qlora_memory.py adds its LoRA keys)."""
    return h.flags(
        model_name_or_path=model_dir,
        dataset_name_or_path=data_dir,
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_length=256,
        src_length=128,
        pad_to_max_length="true",
        zero_padding="false",
        do_train="true",
        do_eval="false",
        eval_before_train="false",
        evaluation_strategy="no",
        save_strategy="no",
        logging_steps=1,
        warmup_steps=0,
    )


def ensure_models():
    """Build the 0.84B model + data (bench/big_model.py) and the 0.3B model, each in a subprocess."""
    for cmd in (
        h.module("bench.big_model", "--model_dir", BIG_DIR, "--data_dir", DATA_DIR),
        [sys.executable, "-c", BUILD_SMALL, SMALL_DIR, json.dumps(SMALL_SHAPE)],
    ):
        h.run(cmd, name="model build", env=h.clean_env(PYTHONPATH=ROOT), mark=None)


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def wait_for_memory(need, wait_s):
    t0 = time.time()
    while mem_available() < need:
        if time.time() - t0 > wait_s:
            sys.exit(
                f"refusing to start: MemAvailable {mem_available() / GiB:.1f} GiB < {need / GiB:.1f} GiB needed "
                f"(planned peak + {MARGIN / GiB:.0f} GiB) for {wait_s} s; other jobs hold the memory"
            )
        time.sleep(15)


def plan(config, overrides):
    from paddlenlp_ext.planner import estimate_for_run, load_plan_config

    cfg, _ = load_plan_config(os.path.join(ROOT, config), overrides)
    return estimate_for_run(cfg, target="cpu", world_size=1)


def run_one(name, work, steps, wait_s):
    config, model_dir, extra, _ = RUNS[name]
    out_dir = os.path.join(work, name)
    overrides = common_overrides(model_dir, out_dir, steps) + extra
    est = plan(config, overrides)
    wait_for_memory(est.per_device_bytes + MARGIN, wait_s)
    print(f"[{name}] python {CLI} {config} {' '.join(overrides)}", flush=True)
    load0 = os.getloadavg()[0]
    r = h.run(h.cli(CLI, config, *overrides), name=name, out_dir=out_dir, log=os.path.join(work, name + ".log"))
    summary, peak = r.summary, r.peak_rss_bytes
    rec = {
        "run": name,
        "peak_rss_bytes": peak,
        "runtime_bytes": summary["rss_before_model_bytes"],
        "after_load_bytes": summary["rss_after_load_bytes"],
        "planned_bytes": est.per_device_bytes,
        "planned_breakdown": dict(est.breakdown),
        "ratio": est.per_device_bytes / peak,
        "wall_s": round(r.wall_s, 1),
        "loadavg_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "trainable_params": summary.get("trainable_params"),
        "total_params": summary.get("total_params"),
    }
    print(
        f"[{name}] peak {peak / GiB:.2f} GiB, planned {est.per_device_bytes / GiB:.2f} GiB "
        f"(x{rec['ratio']:.3f}) in {rec['wall_s']} s",
        flush=True,
    )
    return rec


def gib(x):
    return f"{x / GiB:.2f}"


# LLaMA-Factory README "Hardware Requirement" (hiyouga/LLaMA-Factory@7638f1070e6ffc0303e30fcdf3d68006334c323d):
# Full 32-bit (AMP) 18x GB, Full 16-bit 8x, LoRA 16-bit 2x, QLoRA 4-bit x/2 for x billion parameters
LLAMA_FACTORY = {"7b": ("120 / 60", "16", "6"), "13b": ("240 / 120", "32", "12"), "70b": ("1200 / 600", "160", "48")}
GPU_METHODS = (
    ("full bf16 O2", "sft_argument.json"),
    ("LoRA r=8 bf16", "lora_argument.json"),
    ("QLoRA nf4+dq r=8", "qlora_argument.json"),
)


def gpu_layouts():
    from paddlenlp_ext.planner import Layout

    return (
        ("1 GPU", Layout()),
        ("8 x sharding stage2", Layout(sharding_stage=2, sharding_degree=8)),
        ("8 x sharding stage3", Layout(sharding_stage=3, sharding_degree=8)),
        ("TP 2", Layout(tp=2)),
        ("TP 4", Layout(tp=4)),
        ("TP 8", Layout(tp=8)),
        ("TP 4 x PP 2", Layout(tp=4, pp=2)),
        ("TP 8 x PP 2", Layout(tp=8, pp=2)),
    )


def gpu_table():
    from paddlenlp_ext.planner import estimate, inputs_from_run, load_plan_config

    layouts = gpu_layouts()
    print(
        "GiB per device (2^30 bytes), planner target gpu; batch 1 x 1024 tokens, recompute, flash attention, "
        "gradient_accumulation_steps 4 (PP: 2 micro-batches in flight on the first stage).  LLaMA-Factory: GB "
        "total, its README's estimate (full: AMP / pure bf16)\n"
    )
    rows = []
    for size in ("7b", "13b", "70b"):
        for i, (label, config) in enumerate(GPU_METHODS):
            cfg, _ = load_plan_config(
                os.path.join(ROOT, "llm", "config", "llama", config),
                h.flags(model_name_or_path=f"meta-llama/Llama-2-{size}", max_length=1024, src_length=512)
                + h.flags(per_device_train_batch_size=1, tensor_parallel_degree=1, sharding=""),
            )
            inp = inputs_from_run(cfg, target="gpu")
            cells = [f"{estimate(inp, lay).per_device_bytes / GiB:.1f}" for _, lay in layouts]
            rows.append([f"Llama-2-{size.upper()}", label, *cells, LLAMA_FACTORY[size][i]])
    print(h.table(["model", "method", *(n for n, _ in layouts), "LLaMA-Factory"], rows))


def report(records, runtime_constant):
    print(
        "\nGiB (2^30 bytes). measured = peak RSS of the CLI run (the bench harness's); planned = "
        "paddlenlp_ext.planner (target cpu)\n"
    )
    print(
        h.table(
            ["run", "what", "measured peak", "planned", "planned / measured", "within +-15%"],
            [
                [
                    r["run"],
                    RUNS[r["run"]][3],
                    gib(r["peak_rss_bytes"]),
                    gib(r["planned_bytes"]),
                    f"{r['ratio']:.3f}",
                    h.verdict(abs(r["ratio"] - 1), TARGET),
                ]
                for r in records
            ],
        )
    )
    print(
        "\nBreakdown (planned) and the measured parts the CLI reports (runtime = RSS before the model; "
        "model = RSS after load/adapters/trainer setup - runtime; step = peak - RSS after load):\n"
    )
    keys = list(records[0]["planned_breakdown"]) if records else []
    print(
        h.table(
            ["run", *keys, "measured runtime", "measured model", "measured step"],
            [
                [
                    r["run"],
                    *(gib(r["planned_breakdown"][k]) for k in keys),
                    gib(r["runtime_bytes"]),
                    gib(r["after_load_bytes"] - r["runtime_bytes"]),
                    gib(r["peak_rss_bytes"] - r["after_load_bytes"]),
                ]
                for r in records
            ],
        )
    )
    runtimes = [r["runtime_bytes"] for r in records]
    if runtimes:
        print(
            f"\nframework overhead on CPU: the planner uses {gib(runtime_constant)} GiB; measured runtime in these "
            f"runs {min(runtimes) / GiB:.2f}-{max(runtimes) / GiB:.2f} GiB"
        )
    worst = max((abs(r["ratio"] - 1) for r in records), default=0)
    print(f"worst |planned/measured - 1| = {worst:.3f} (target <= {TARGET}: {h.verdict(worst, TARGET)})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--wait_s", type=int, default=600, help="how long to wait for free memory before a run")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--gpu_table", action="store_true", help="print the Llama-2 GPU table (no runs) and exit")
    a = p.parse_args()
    if a.gpu_table:
        print("command: .venv/bin/python -m bench.plan_memory --gpu_table\n")
        gpu_table()
        return
    names = [n.strip() for n in a.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"unknown run(s) {unknown}; choose from {list(RUNS)}")
    print("command: .venv/bin/python -m bench.plan_memory " + " ".join(sys.argv[1:]), flush=True)
    ensure_models()
    from paddlenlp_ext.planner.memory import CPU_RUNTIME_BYTES

    with tempfile.TemporaryDirectory() as work:
        records = [run_one(n, work, a.steps, a.wait_s) for n in names]
    report(records, CPU_RUNTIME_BYTES)
    h.write_json(a.json, records)


if __name__ == "__main__":
    main()
