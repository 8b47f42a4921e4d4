"""Benchmark (issue 26 item 2): the CPU set-up of ``paddlenlp_ext/cli/cpu_env.py`` on vs off, through the CLI.

    .venv/bin/python bench/cpu_setup.py [--steps 8] [--repeats 2] [--scratch build/bench_cpu_setup] [--json out.json]

The same LoRA fine-tune runs through ``llm/run_finetune.py`` in separate processes, interleaved
(off, on, off, on, ...), ``--repeats`` times each:

* **off**: ``PADDLENLP_EXT_CPU_SETUP=0`` (Paddle's defaults: ``OMP_NUM_THREADS=1``, MKL's own dispatch),
* **on**: the set-up as every CLI runs it (the configuration line's ``cpu:`` text is printed).

Both start from an environment without ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` /
``MKL_DEBUG_CPU_TYPE`` / ``MKL_ENABLE_INSTRUCTIONS``.

Model: a random PaddleNLP ``LlamaForCausalLM`` (hidden 1024, intermediate 2816, 16 layers, 16 heads,
vocab 32000: 0.26B parameters, fp32), built once with ``LlamaConfig`` + ``save_pretrained`` in the
scratch dir, with the Llama-2 SentencePiece tokenizer of ``../shared/data/llama2_tokenizer.model``
(or /work/shared/data); data: ``alpaca_en_demo.json`` there as {src, tgt} lines (``bench/big_model.py``'s
converter).  Without the shared data: the tiny model's tokenizer (vocab of build/tiny-llama) and llm/data/advertise.
Settings: LoRA r8 / alpha 16 on every decoder linear, lr 1e-4, max_length 1024, batch 1 x
accumulation 4, ``--steps`` optimizer steps, fp32, no eval, no save.

Per run: supervised tokens/s (supervised tokens over the training time of run_summary.json), the median
step time (steps 2..N), peak RSS, CPU% of the process from the first to the last step line (its
utime+stime from /proc over the wall time), and the final logged loss.  Then the means of each setting,
the on/off ratios and the largest relative difference between the two settings' per-step losses.
The machine may be shared: interleaving spreads other load over both settings; compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from big_model import write_data  # noqa: E402
from paddlenlp_ext.cli.cpu_env import CODE_PATH_VARS, SWITCH, THREAD_VARS  # noqa: E402

#: the shared demo data: next to the repository (CI), else the machine's copy
SHARED = next((d for d in (os.path.join(os.path.dirname(ROOT), "shared", "data"), "/work/shared/data")
               if os.path.isdir(d)), os.path.join(os.path.dirname(ROOT), "shared", "data"))
ALPACA = os.path.join(SHARED, "alpaca_en_demo.json")
TOKENIZER_MODEL = os.path.join(SHARED, "llama2_tokenizer.model")
CLI = os.path.join(ROOT, "llm", "run_finetune.py")
CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json")
TINY = os.path.join(ROOT, "build", "tiny-llama")
MODEL_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                   num_key_value_heads=16, max_position_embeddings=2048)
STEP_LINE = re.compile(r"^step +(\d+)/(\d+) ")
CPU_LINE = re.compile(r"\| (cpu: .*)$")

BUILD = r"""
import json, os, sys
import paddle
from paddlenlp.transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaTokenizer
out, spm, tiny, shape = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
if os.path.isfile(spm):
    tok = LlamaTokenizer(vocab_file=spm)
else:
    tok = AutoTokenizer.from_pretrained(tiny)
paddle.seed(0)
cfg = LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=len(tok), **shape)
model = LlamaForCausalLM(cfg)
model.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
params = sum(int(p.numel()) for p in model.parameters())
json.dump({"params": params, "vocab": len(tok)}, open(os.path.join(out, "bench_build.json"), "w"))
print(f"built {out}: {params:,} parameters, vocab {len(tok)}")
"""


def ensure_model(model_dir: str, shape: dict = None) -> dict:
    """Build the random Llama (``shape``: LlamaConfig keys, default :data:`MODEL_SHAPE`) once into ``model_dir``."""
    marker = os.path.join(model_dir, "bench_build.json")
    if not os.path.isfile(marker):
        os.makedirs(model_dir, exist_ok=True)
        r = subprocess.run([sys.executable, "-c", BUILD, model_dir, TOKENIZER_MODEL, TINY, json.dumps(shape or MODEL_SHAPE)],
                           cwd=ROOT, text=True, capture_output=True, env={**os.environ, "PYTHONPATH": ROOT})
        if r.returncode != 0:
            sys.exit("model build failed:\n" + r.stderr[-3000:])
        print(r.stdout.strip().splitlines()[-1], flush=True)
    with open(marker) as f:
        return json.load(f)


def ensure_data(scratch: str) -> str:
    if not os.path.isfile(ALPACA):
        print(f"note: {ALPACA} absent: llm/data/advertise instead", flush=True)
        return os.path.join(ROOT, "llm", "data", "advertise")
    data_dir = os.path.join(scratch, "alpaca")
    if not os.path.isfile(os.path.join(data_dir, "train.json")):
        write_data(data_dir, source=ALPACA)
    return data_dir


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (its threads included), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def finetune_args(model_dir: str, data_dir: str, out_dir: str, steps: int) -> list:
    """``llm/run_finetune.py``'s arguments of these benchmarks (after the config file)."""
    return ["--model_name_or_path", model_dir, "--dataset_name_or_path", data_dir,
            "--output_dir", out_dir, "--overwrite_output_dir", "true", "--max_steps", str(steps),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4", "--learning_rate", "1e-4",
            "--warmup_steps", "0", "--lora_rank", "8", "--lora_alpha", "16", "--max_length", "1024",
            "--src_length", "1024", "--logging_steps", "1", "--do_eval", "false", "--eval_before_train", "false",
            "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "42"]


def run_once(setting: str, model_dir: str, data_dir: str, out_dir: str, steps: int, extra=(), cli=CLI,
             config=CONFIG, args=None) -> dict:
    """One run of our CLI (default ``llm/run_finetune.py`` with :func:`finetune_args`; ``extra``: more
    ``--key value`` arguments, e.g. packing)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS + CODE_PATH_VARS + (SWITCH,)}
    env["PYTHONPATH"] = ROOT
    if setting == "off":
        env[SWITCH] = "0"
    args = finetune_args(model_dir, data_dir, out_dir, steps) if args is None else args
    cmd = [sys.executable, cli, config, *args, *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marks, cpu_text, tail = [], None, []
    for line in proc.stdout:  # the step lines as they come, with the process's CPU time at that moment
        line = line.rstrip("\n")
        tail = (tail + [line])[-40:]
        if STEP_LINE.match(line):
            try:
                marks.append((time.perf_counter(), cpu_seconds(proc.pid)))
            except OSError:  # the process ended between the line and the read
                pass
        elif CPU_LINE.search(line):
            cpu_text = CPU_LINE.search(line).group(1)
    err = proc.stderr.read()
    if proc.wait() != 0:
        sys.exit(f"{setting} run failed:\n" + "\n".join(tail) + "\n" + err[-4000:])
    r = read_run(out_dir, marks)
    return {"setting": setting, "cpu_line": cpu_text, **r, "env": r["summary"]["cpu"]["env"]}


def read_run(out_dir: str, marks) -> dict:
    """A finished CLI run's numbers: run_summary.json, the logged losses, and the CPU% between the
    first and the last step line (``marks``: (wall time, process CPU seconds) at each step line)."""
    with open(os.path.join(out_dir, "run_summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        losses = [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]
    cpu_pct = None
    if len(marks) >= 2 and marks[-1][0] > marks[0][0]:
        cpu_pct = 100.0 * (marks[-1][1] - marks[0][1]) / (marks[-1][0] - marks[0][0])
    steady = s["step_times_s"][1:] or s["step_times_s"]
    sup = s.get("supervised_tokens_trained", s.get("answer_tokens_trained"))  # DPO: the answers' tokens
    return {"sup_tok_s": sup / s["train_time_s"], "step_s": statistics.median(steady),
            "pairs_s": s["pairs_trained"] / s["train_time_s"] if s.get("pairs_trained") else None,
            "peak_rss_gib": s["peak_rss_bytes"] / 2 ** 30, "cpu_pct": cpu_pct, "final_loss": losses[-1],
            "losses": losses, "supervised_tokens": sup, "train_time_s": s["train_time_s"],
            "padding": ((s.get("data") or {}).get("train") or {}).get("padding_ratio"),
            "summary": s}

def mean(rows, key):
    vals = [r[key] for r in rows if r[key] is not None]
    return sum(vals) / len(vals) if vals else None


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def table(runs) -> str:
    lines = ["| run | setting | supervised tok/s | step time | peak RSS | CPU% in steps | final loss |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        lines.append(f"| {i} | {r['setting']} | {r['sup_tok_s']:.1f} | {r['step_s']:.2f} s | {r['peak_rss_gib']:.2f} GiB "
                     f"| {fmt(r['cpu_pct'], '.0f')}% | {r['final_loss']:.6f} |")
    by = {s: [r for r in runs if r["setting"] == s] for s in ("off", "on")}
    for s in ("off", "on"):
        lines.append(f"| mean | {s} | {mean(by[s], 'sup_tok_s'):.1f} | {mean(by[s], 'step_s'):.2f} s "
                     f"| {mean(by[s], 'peak_rss_gib'):.2f} GiB | {fmt(mean(by[s], 'cpu_pct'), '.0f')}% "
                     f"| {mean(by[s], 'final_loss'):.6f} |")
    ratio = mean(by["on"], "sup_tok_s") / mean(by["off"], "sup_tok_s")
    lines.append(f"| ratio | on / off | {ratio:.2f}x | {mean(by['on'], 'step_s') / mean(by['off'], 'step_s'):.2f}x "
                 f"| {mean(by['on'], 'peak_rss_gib') / mean(by['off'], 'peak_rss_gib'):.2f}x | | |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    p.add_argument("--repeats", type=int, default=2, help="runs per setting, interleaved (default 2)")
    p.add_argument("--scratch", default=os.path.join(ROOT, "build", "bench_cpu_setup"))
    p.add_argument("--json", help="write the runs here")
    a = p.parse_args(argv)
    model_dir = os.path.join(a.scratch, "llama-0.25b")
    info = ensure_model(model_dir)
    data_dir = ensure_data(a.scratch)
    print(f"model {model_dir} ({info['params']:,} parameters, vocab {info['vocab']}), data {data_dir}, "
          f"{a.steps} steps of 1 x 4 at max_length 1024, LoRA r8, fp32", flush=True)
    runs = []
    for i in range(a.repeats):
        for setting in ("off", "on"):
            t0 = time.time()
            r = run_once(setting, model_dir, data_dir, os.path.join(a.scratch, f"run_{setting}_{i}"), a.steps)
            runs.append(r)
            print(f"  {setting} #{i + 1}: {r['sup_tok_s']:.1f} supervised tok/s, step {r['step_s']:.2f} s, "
                  f"CPU {fmt(r['cpu_pct'], '.0f')}%, loss {r['final_loss']:.6f} ({time.time() - t0:.0f} s; "
                  f"{r['cpu_line']})", flush=True)
    print()
    print(table(runs))
    on = [r["losses"] for r in runs if r["setting"] == "on"]
    off = [r["losses"] for r in runs if r["setting"] == "off"]
    diff = max(abs(x - y) / max(abs(y), 1e-12) for a_, b_ in zip(on, off) for x, y in zip(a_, b_))
    print(f"\nper-step losses, on vs off: largest relative difference {diff:.2e} "
          f"over {len(on[0])} steps x {len(on)} pairs")
    print("cpu line (on):", runs[1]["cpu_line"], "| env:", runs[1]["env"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "loss_rel_diff": diff, "model": info, "steps": a.steps}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
