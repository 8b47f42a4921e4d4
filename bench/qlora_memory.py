"""Benchmark: QLoRA memory and speed through the real CLI on a 0.84B-parameter Llama.

    .venv/bin/python -m bench.qlora_memory [--runs lora-fp32,nf4-dq,fp4,int8,int4] [--steps 3]
        [--model_dir build/llama-0.8b] [--data_dir build/alpaca_en_demo] [--json out.json] [--keep]

The model (random weights, 839,444,480 parameters, 3.36 GB fp32 in 5 safetensors shards of <= 1 GB,
the real Llama-2 tokenizer) and the Alpaca demo data are built once by ``bench/big_model.py`` (in a
subprocess) and cached.  Then every configuration runs in its own process, one after the other,
through the bench harness (``bench/harness.py``):

    python llm/run_finetune.py llm/config/tiny/lora_argument.json
        --model_name_or_path MODEL --dataset_name_or_path DATA --output_dir TMP/RUN
        --max_steps 3 --per_device_train_batch_size 1 --max_length 256 --src_length 128
        --pad_to_max_length true --do_eval false --save_strategy no --lora true --lora_rank 8 ...

(every row padded to 256 tokens, so all steps do the same work; no evaluation, no checkpoint; the
final save writes only the LoRA adapter).  Runs: ``lora-fp32`` (LoRA on the fp32 base: the baseline)
and LoRA on a quantized base: ``nf4-dq`` (nf4 + double quantization), ``fp4``, ``int8``
(weight_only_int8), ``int4`` (weight_only_int4).

Measured per run:

* peak RSS of the run: the harness's (the kernel's ru_maxrss of that process, as ``/usr/bin/time -f %M``);
* from ``output_dir/run_summary.json`` written by the CLI: RSS before the model (imports + tokenizer
  + tokenized data: "runtime"), RSS after load (model loaded, quantized, adapters applied, trainer
  built; minus runtime = "weights"), peak - RSS after load ("step overhead": activations, gradients,
  optimizer state, and for quantized runs whatever of the load peak was not reached again),
  per-step wall times and the CLI's wall time (non-step time = wall - sum(steps) = load + setup +
  final save);
* median step time of steps 2..N (step 1 includes one-off warm-up).

Targets of QLoRA, printed PASS/FAIL: nf4-dq peak <= 0.45x lora-fp32, int4 <= 0.45x,
int8 <= 0.6x, nf4-dq median step time <= 1.3x.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402
from bench import plan_memory  # noqa: E402

ROOT, GB = h.ROOT, h.GiB
BASE_CONFIG = os.path.join("llm", "config", "tiny", "lora_argument.json")

BASELINE = "lora-fp32"
RUNS = {
    "lora-fp32": [],
    "nf4-dq": ["--weight_quantize_algo", "nf4", "--weight_double_quant", "true"],
    "fp4": ["--weight_quantize_algo", "fp4"],
    "int8": ["--weight_quantize_algo", "weight_only_int8"],
    "int4": ["--weight_quantize_algo", "weight_only_int4"],
}
# (run, metric, max ratio to the baseline)
TARGETS = [("nf4-dq", "peak", 0.45), ("int4", "peak", 0.45), ("int8", "peak", 0.6), ("nf4-dq", "step", 1.3)]


def common_overrides(model_dir, data_dir, output_dir, steps):
    return plan_memory.common_overrides(model_dir, output_dir, steps, data_dir) + h.flags(lora="true", lora_rank=8)


# ---------------------------------------------------------------- build


def ensure_model(model_dir, data_dir):
    """Run bench/big_model.py in a subprocess (keeps paddle out of this process); returns its info."""
    fd, info_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    t0 = time.time()
    h.run(
        h.module("bench.big_model", "--model_dir", model_dir, "--data_dir", data_dir, "--info-json", info_path),
        name="model build",
        mark=None,
    )
    with open(info_path) as f:
        info = json.load(f)
    os.unlink(info_path)
    info["ensure_seconds"] = round(time.time() - t0, 1)
    return info


# ---------------------------------------------------------------- one run


def code_fingerprint():
    """Hash of every .py under paddlenlp_ext/ and llm/: the checkout is edited concurrently, and rows
    measured with different code are not comparable."""
    h = hashlib.sha1()
    for top in ("paddlenlp_ext", "llm"):
        for d, dirs, files in sorted(os.walk(os.path.join(ROOT, top))):
            dirs.sort()
            for f in sorted(x for x in files if x.endswith(".py")):
                path = os.path.join(d, f)
                h.update(path.encode())
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:12]


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run_one(name, model_dir, data_dir, work, steps, extra=(), args=None):
    """One CLI run of the configuration ``name`` (its arguments: ``args``, default ``RUNS[name]``)."""
    out_dir = os.path.join(work, name)
    args = RUNS[name] if args is None else args
    overrides = common_overrides(model_dir, data_dir, out_dir, steps) + list(args) + list(extra)
    print(f"[{name}] python {h.cli('llm/run_finetune.py')[1]} {BASE_CONFIG} {' '.join(overrides)}", flush=True)
    code_before, load_before = code_fingerprint(), os.getloadavg()[0]
    r = h.run(
        h.cli("llm/run_finetune.py", BASE_CONFIG, *overrides),
        name=name,
        out_dir=out_dir,
        log=os.path.join(work, f"{name}.log"),
        check=False,
    )
    rec = {
        "run": name,
        "returncode": r.returncode,
        "process_wall_s": round(r.wall_s, 1),
        "log": os.path.join(work, f"{name}.log"),
        "args": list(args),
        "code_before": code_before,
        "code_after": code_fingerprint(),
        "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if not r.ok or r.summary is None:
        rec["error"] = "\n".join(
            ln for ln in r.tail(200).splitlines() if "Warning" not in ln and "warnings.warn" not in ln
        )[-3000:]
        print(f"[{name}] FAILED (exit {r.returncode}); last lines of {rec['log']}:\n{rec['error']}\n", flush=True)
        return rec
    rec["summary"] = r.summary
    rec["peak_rss_bytes"] = r.peak_rss_bytes
    rec["output_dir_bytes"] = dir_bytes(out_dir)
    rec.update(derive(rec["summary"], rec["peak_rss_bytes"]))
    print(
        f"[{name}] done in {rec['process_wall_s']} s: peak {rec['peak_rss_bytes'] / GB:.2f} GB, "
        f"median step {fmt(rec['median_step_s'], '.2f')} s",
        flush=True,
    )
    return rec


def derive(s, peak):
    """Memory breakdown and timing from a run_summary.json and the measured peak."""
    steps = s.get("step_times_s") or []
    later = steps[1:] or steps
    before, after = s.get("rss_before_model_bytes"), s.get("rss_after_load_bytes")
    out = {
        "runtime_bytes": before,
        "weights_bytes": after - before if None not in (before, after) else None,
        "step_overhead_bytes": peak - after if after is not None else None,
        "rss_after_first_step_bytes": s.get("rss_after_first_step_bytes"),
        "median_step_s": h.median(later),
        "non_step_s": round(s["wall_time_s"] - sum(steps), 2) if "wall_time_s" in s else None,
        "train_loss": s.get("train_loss"),
    }
    q = s.get("quantization") or {}
    params, qbytes = q.get("params", q.get("params_quantized")), q.get("bytes_after", q.get("bytes_quantized"))
    out["bytes_per_param"] = q.get("bytes_per_param") or (qbytes / params if params and qbytes else None)
    out["load_peak_bytes"] = q.get("peak_rss_bytes")  # process peak right after loading (streaming loader)
    return out


# ---------------------------------------------------------------- report

fmt, ratio = h.fmt, h.ratio


def add_ratios(records):
    base = records.get(BASELINE)
    for rec in records.values():
        ok = "summary" in rec and base is not None and "summary" in base
        rec["peak_ratio"] = ratio(rec.get("peak_rss_bytes"), base.get("peak_rss_bytes")) if ok else None
        rec["step_ratio"] = ratio(rec.get("median_step_s"), base.get("median_step_s")) if ok else None


def gb(x):
    return fmt(None if x is None else x / GB, ".2f")


COLUMNS = [
    "run",
    "peak GB",
    "x base",
    "runtime",
    "weights",
    "step ovh",
    "load pk",
    "after st1",
    "B/param",
    "load s",
    "step s",
    "x base",
    "loss",
    "out MB",
]


def table_row(rec):
    if "summary" not in rec:
        return [rec["run"], f"FAILED (exit {rec['returncode']})"] + [""] * (len(COLUMNS) - 2)
    return [
        rec["run"],
        gb(rec["peak_rss_bytes"]),
        fmt(rec["peak_ratio"], ".2f") + "x",
        gb(rec["runtime_bytes"]),
        gb(rec["weights_bytes"]),
        gb(rec["step_overhead_bytes"]),
        gb(rec["load_peak_bytes"]),
        gb(rec["rss_after_first_step_bytes"]),
        fmt(rec["bytes_per_param"], ".3f"),
        fmt(rec["non_step_s"], ".1f"),
        fmt(rec["median_step_s"], ".2f"),
        fmt(rec["step_ratio"], ".2f") + "x",
        fmt(rec["train_loss"], ".3f"),
        fmt(rec["output_dir_bytes"] / 1e6, ".1f"),
    ]


def print_table(records):
    print(h.table(COLUMNS, [table_row(rec) for rec in records.values()]))


def check_targets(records):
    results = []
    for run, metric, limit in TARGETS:
        rec = records.get(run)
        value = None if rec is None else rec.get("peak_ratio" if metric == "peak" else "step_ratio")
        status = "n/a" if value is None else h.verdict(value, limit)
        what = "peak RSS" if metric == "peak" else "median step time"
        results.append(
            dict(
                run=run,
                metric=metric,
                limit=limit,
                value=value,
                status=status,
                text=f"{run:7s} {what:16s} <= {limit:.2f}x {BASELINE}: {fmt(value, '.2f')}x  {status}",
            )
        )
    return results


def print_report(records, targets, build):
    print()
    print(
        f"model: {build['params']:,} params, {build['shards']} safetensors shards, "
        f"{build['total_bytes'] / 1e9:.2f} GB fp32; built in {build['build_seconds']} s"
        f"{' (now)' if build.get('built_now') else ' (cached)'}"
    )
    print("memory in GiB (2^30 bytes); runtime = RSS before the model (imports + tokenizer + data); weights = RSS")
    print("after load/quantize/adapters/trainer - runtime; step ovh = peak - RSS after load; after st1 = RSS after")
    print("step 1; B/param = bytes per quantized linear weight; load s = CLI wall - sum(step times); step s =")
    print("median of steps 2..N; load pk = process peak right after the model load (when the CLI reports it);")
    print("out MB = output_dir size (adapter + metadata)")
    print()
    print_table(records)
    print()
    for t in targets:
        print(t["text"])
    print()
    print_conditions(records)


def print_conditions(records):
    """Machine load, and whether the code changed between the rows."""
    print(
        "1-min load average before/after each run (2 cores; > 2 means other processes competed for CPU): "
        + ", ".join(f"{r['run']} {r['loadavg_1min_before_after']}" for r in records.values())
    )
    codes = {c for r in records.values() for c in (r["code_before"], r["code_after"])}
    if len(codes) > 1:
        print(
            "WARNING: paddlenlp_ext/ or llm/ changed during the benchmark (code fingerprints "
            + ", ".join(f"{r['run']} {r['code_before']}->{r['code_after']}" for r in records.values())
            + "): rows measured with different code are not comparable; run again"
        )
    else:
        print(f"code fingerprint (paddlenlp_ext/ + llm/ *.py): {codes.pop() if codes else '-'} for every run")


# ---------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", action="store_true", help="keep the output dirs and logs")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (>= 2)")
    p.add_argument("--model_dir", default=os.path.join(ROOT, "build", "llama-0.8b"))
    p.add_argument("--data_dir", default=os.path.join(ROOT, "build", "alpaca_en_demo"))
    p.add_argument("--workdir", default=None, help="parent of the temporary output dirs")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument(
        "--extra",
        default="",
        help="more CLI overrides for every run, e.g. '--recompute true' "
        "(the same for the baseline and the quantized runs)",
    )
    a = p.parse_args(argv)
    a.extra = a.extra.split()
    a.runs = [r.strip() for r in a.runs.split(",") if r.strip()]
    unknown = [r for r in a.runs if r not in RUNS]
    if unknown or a.steps < 2:
        p.error(f"unknown runs {unknown} (choose from {list(RUNS)})" if unknown else "--steps must be >= 2")
    return a


def main(argv=None):
    a = parse_args(argv)
    model_dir, data_dir = os.path.abspath(a.model_dir), os.path.abspath(a.data_dir)
    build = ensure_model(model_dir, data_dir)
    work = tempfile.mkdtemp(prefix="qlora_memory_", dir=a.workdir)
    print(f"outputs and logs in {work}", flush=True)
    records = {}
    try:
        for name in a.runs:
            records[name] = run_one(name, model_dir, data_dir, work, a.steps, a.extra)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    add_ratios(records)
    targets = check_targets(records)
    if a.extra:
        print(f"every run with: {' '.join(a.extra)}")
    print_report(records, targets, build)
    h.write_json(
        a.json,
        {
            "model": build,
            "steps": a.steps,
            "extra": a.extra,
            "baseline": BASELINE,
            "runs": records,
            "targets": targets,
            "workdir": work if a.keep else None,
        },
        default=str,
    )
    return 0 if all("summary" in r for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
