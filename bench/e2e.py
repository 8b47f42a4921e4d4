"""Benchmark: our whole fine-tune vs PaddleNLP's own llm/run_finetune.py vs TRL + PEFT.

    .venv/bin/python -m bench.e2e [--cases lora,packed] [--steps 10] [--packed-steps N] [--repeats 2] [--scratch DIR]
        [--paddlenlp-llm DIR] [--paddlenlp-cpu-env] [--trl-python PY] [--model 0.25b|0.8b|ernie] [--json F]
        [--peak-json F | --no-peak]
    .venv/bin/python -m bench.e2e --quick [--tolerance 0.15] [--fail-on-slowdown] [--record]

Every toolkit trains the same random 0.26B Llama (``bench/cpu_setup.py``'s: hidden 1024, intermediate
2816, 16 layers; ``--model 0.8b``: hidden 2048, intermediate 5504, 14 layers, 0.84B parameters;
Llama-2 tokenizer, built with PaddleNLP; for transformers saved once more in the Hugging Face layout:
names ``llama.*`` -> ``model.*``, Linear weights transposed; ``--model ernie``: the ERNIE-4.5-shaped
``Ernie4_5ForCausalLM`` of ``bench/ernie_shape.py``, hidden 1024, 18 layers, GQA 16/2, head_dim 128, vocab
103424, tied embeddings, 0.36B parameters, built and saved by transformers, which both toolkits read as
it is; no PaddleNLP column: PaddleNLP 3.0.0b4 has no ERNIE 4.5 model) on the same alpaca
{src, tgt} rows, loss on the answer only, LoRA r8 / alpha 16 on every decoder linear, lr 1e-4 linear
decay, no warm-up, max_length 1024, batch 1 x accumulation 4, ``--steps`` optimizer steps, fp32, each
run in its own process, interleaved (every toolkit of every case once, then again).  Ours and TRL do
the same work: no gradient checkpointing on either side (TRL 0.22's SFTConfig turns it on by default;
the bench turns it off, as ours runs), and unpacked, TRL takes the examples in ours' order (seed 42,
``bench/e2e_trl.py``'s ``order_seed``), so every optimizer step of both trains the same four examples;
each run's processed and supervised tokens are printed side by side (the SFT cases; the DPO worker keeps
TRL's DPOConfig defaults).  Cases:

* ``lora``: no packing.
* ``packed``: ours ``zero_padding`` + ``greedy_zero_padding`` with ``use_flash_attention`` +
  ``flash_mask`` (on CPU: per-document attention, kernels/varlen.py); PaddleNLP its ``zero_padding`` +
  ``greedy_zero_padding`` (dense mask: its FlashMask has no CPU kernel); TRL ``packing=True``.
* ``lora_b4`` / ``packed_b4``: ours only, as ``lora`` / ``packed`` at batch 4 x accumulation 1 (the same
  rows per optimizer step): where an unpacked batch carries padding, so packing has something to remove
  (``config/packing_payoff.py`` stays silent there).
* ``qlora``: ours with an nf4 base (``weight_quantize_algo nf4``); compare with ours in ``lora``.
* ``dpo``: LoRA DPO (sigmoid, beta 0.1, reference = adapters off) on dpo_en_demo.json (``bench/dpo.py``'s
  conversion), max_length 1024: ours ``llm/run_dpo.py`` vs TRL ``DPOTrainer`` (``bench/e2e_trl_dpo.py``;
  prompt = the turns joined by newlines); pairs/s instead of supervised tokens/s.

Ours runs as a user runs it (``llm/run_finetune.py`` with its CPU set-up).  **PaddleNLP** runs its own
``llm/run_finetune.py`` at 3.0.0b4 from ``--paddlenlp-llm DIR`` (or ``$PADDLENLP_LLM``): PaddleNLP's
``llm/run_finetune.py`` and ``llm/utils/{__init__,argument,data}.py`` (they are not in the pip package;
get them from the PaddleNLP repository at tag v3.0.0-beta4; they are not part of this repository),
through ``bench/e2e_paddlenlp.py``, with Paddle's defaults (``--paddlenlp-cpu-env``: with the thread
and MKL variables our CPU set-up chooses).  Without the directory the column is skipped, with the
reason.  **TRL** runs in its own venv (``SCRATCH/venv-trl``: ``pip install torch==2.13.0 transformers
peft trl sentencepiece protobuf``; ``--trl-python`` names an interpreter that has them) with torch's
default threads, through ``bench/e2e_trl.py``; skipped with the reason when it cannot be set up.

Printed first: the CPU model and its ISA, and this machine's fp32 matmul peak, measured by
``bench/peak.py`` in its own process at this model's shapes (``--peak-json F``: a measurement of
before; ``--no-peak``: none).  Then per case and toolkit: supervised tokens/s (supervised tokens over the
training time; each run's in brackets), the achieved GFLOP/s and its fraction of the peak, median step
time (steps 2..N), peak RSS, CPU% during the steps, padding (ours), final loss; then ours / each other
toolkit, and packed / unpacked per toolkit.

**GFLOP/s** = supervised tokens/s x FLOPs per supervised token, the same for every toolkit of a case
(``bench/flops.py``: the matmuls of forward and backward from the model's shape; LoRA r8: a frozen base
weight costs 4 FLOPs per weight and token, a LoRA weight 6, the LM head 4, attention ``12 * hidden *
c`` per layer with ``c`` the mean causal context of a token; over the supervised share of the processed
tokens; ``bench/limits.py`` reads both from the training rows with the model's tokenizer).  At 0.26B on
alpaca_en_demo (mean causal context ~160 tokens, 89% of the tokens supervised) that is ~1.12 GFLOP per
supervised token: 89 supervised tok/s is ~100 GFLOP/s.  QLoRA's dequantisation and DPO are not counted.

**``--quick``**, the regression guard: ours only, cases ``lora`` and ``packed``, 2 steps, 1 repeat, no
peak measurement; prints supervised tok/s and peak RSS against the last figures recorded for this
CPU's ISA class (``avx512`` / ``avx2``) in docs/benchmarks.md's guard table (``bench/guard.py``),
flagging a case slower (or heavier) than the tolerance allows (``--tolerance``, default 0.15);
``--fail-on-slowdown`` exits 1 then; ``--record`` adds this run's rows to the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402
from bench.cpu_setup import MODEL_SHAPE, ROOT, ensure_data, ensure_model, lora_knobs, run_once  # noqa: E402
from bench.dpo import convert_dpo_demo  # noqa: E402
from bench.e2e_report import limit_lines, ratios_across, table  # noqa: E402
from bench.e2e_runs import (  # noqa: E402
    ACCUMULATION,
    ALPHA,
    MAX_LENGTH,
    RANK,
    SEED,
    hf_copy,
    paddlenlp_llm,
    run_paddlenlp,
    run_trl,
    trl_python,
)
from bench.ernie_shape import ERNIE_SHAPE, ensure_ernie  # noqa: E402
from bench.flops import DECODER_LINEARS, achieved  # noqa: E402
from bench.guard import GuardTableError, append_rows, compare, parse_baselines, record_rows, report  # noqa: E402
from bench.limits import data_stats, flops_per_supervised_token, load_peak, measure_peak, model_spm  # noqa: E402
from bench.peak import this_cpu  # noqa: E402

fmt = h.fmt
DPO_CLI = os.path.join(ROOT, "llm", "run_dpo.py")
DPO_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "dpo_lora_argument.json")
STEPS_DEFAULT = 10
CASES = ("lora", "packed", "qlora", "dpo", "lora_b4", "packed_b4")
SHAPES = {
    "0.25b": MODEL_SHAPE,
    "0.8b": dict(MODEL_SHAPE, hidden_size=2048, intermediate_size=5504, num_hidden_layers=14),
    "ernie": ERNIE_SHAPE,
}
BATCH4 = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"]
OURS_ARGS = {
    "lora": [],
    "qlora": ["--weight_quantize_algo", "nf4"],
    "packed": h.PACKED,
}
OURS_ARGS.update(lora_b4=BATCH4, packed_b4=OURS_ARGS["packed"] + BATCH4)


def model_path(scratch: str, model: str) -> str:
    """Where ``--model`` lives in the scratch dir: ``model_path("/s", "0.25b")`` -> ``"/s/llama-0.25b"``,
    ``model_path("/s", "ernie")`` -> ``"/s/ernie-0.36b"``."""
    return os.path.join(scratch, "ernie-0.36b" if model == "ernie" else f"llama-{model}")


def ensure_dpo_data(scratch: str) -> str:
    """dpo_en_demo.json as PaddleNLP preference lines (bench/dpo.py's converter), once."""
    out = os.path.join(scratch, "dpo")
    if not os.path.isfile(os.path.join(out, "train.json")):
        convert_dpo_demo(h.DPO_DEMO, out)
    return out


def dpo_args(model_dir: str, data_dir: str, out_dir: str, steps: int) -> list:
    """``llm/run_dpo.py``'s arguments: the SFT runs' settings (bench/cpu_setup.py) on preference data."""
    where = h.flags(model_name_or_path=model_dir, train_dataset_path=data_dir, dev_dataset_path=data_dir)
    lengths = h.flags(max_seq_len=MAX_LENGTH, max_prompt_len=MAX_LENGTH // 2)
    return where + h.flags(output_dir=out_dir) + lora_knobs(steps) + lengths


def machine_limit(a, info: dict, data_dir: str) -> dict:
    """The CPU (model, ISA), the measured matmul peak (bench/peak.py; None with --no-peak), the training
    data's token statistics and the FLOPs per supervised token of each case (bench/flops.py: LoRA r8 on
    the seven decoder linears; QLoRA's dequantisation not counted; DPO not counted)."""
    shape = SHAPES[a.model]
    peak = load_peak(a.peak_json) if a.peak_json else None
    if peak is None and not a.no_peak:
        peak = measure_peak(os.path.join(a.scratch, f"peak-{a.model}.json"), shape, info["vocab"])
    cpu = peak["cpu"] if peak else this_cpu()
    spm = model_spm(model_path(a.scratch, a.model))
    train = os.path.join(data_dir, "train.json")
    stats = data_stats(train, spm, MAX_LENGTH) if spm and os.path.isfile(train) else None
    per_sup = (
        {}
        if stats is None
        else {c: flops_per_supervised_token(shape, info["vocab"], stats, RANK) for c in CASES if c != "dpo"}
    )
    print(
        f"CPU: {cpu['model']}, ISA {cpu['isa']} ({' '.join(cpu['flags']) or '-'}); load average "
        f"{os.getloadavg()[0]:.2f}; matmul peak {fmt(peak and peak['peak_gflops'], '.1f')} GFLOP/s",
        flush=True,
    )
    return {
        "cpu": cpu,
        "peak": peak,
        "peak_flops": peak["peak_gflops"] * 1e9 if peak else None,
        "stats": stats,
        "per_sup_token": per_sup,
    }


def quick_guard(a, runs: list, cpu: dict) -> int:
    """``--quick``: this run against the last recorded figures of this ISA in docs/benchmarks.md; 1 when a
    case is flagged and ``--fail-on-slowdown``."""
    docs = os.path.join(ROOT, "docs", "benchmarks.md")
    with open(docs, encoding="utf-8") as f:
        text = f.read()
    now = {r["case"]: {"sup_tok_s": r["sup_tok_s"], "peak_rss_gib": r["peak_rss_gib"]} for r in runs}
    try:
        baselines = parse_baselines(text)
    except GuardTableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    verdicts = compare(now, baselines, cpu["isa"], a.tolerance)
    print(f"\nregression guard ({cpu['isa']}, {cpu['model']}): against docs/benchmarks.md's recorded figures\n")
    print(report(verdicts, cpu["isa"], a.tolerance))
    git = h.run(["git", "rev-parse", "--short", "HEAD"], name="git", mark=None, check=False)
    rows = record_rows(
        now,
        cpu["isa"],
        time.strftime("%Y-%m-%d", time.gmtime()),
        git.output.strip() if git.ok else "-",
        f"load average {os.getloadavg()[0]:.1f}",
        "bench.e2e --quick",
    )
    if a.record:
        with open(docs, "w", encoding="utf-8") as f:
            f.write(append_rows(text, rows))
        print("\nrecorded in docs/benchmarks.md:")
    else:
        print("\nthis run's rows (--record adds them to docs/benchmarks.md):")
    print("\n".join(rows))
    flagged = [v["case"] for v in verdicts if v["flags"]]
    return 1 if flagged and a.fail_on_slowdown else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="lora,packed", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--toolkits", default="ours,paddlenlp,trl")
    p.add_argument("--steps", type=int, default=STEPS_DEFAULT)
    p.add_argument(
        "--packed-steps",
        type=int,
        help="optimizer steps of the packed case (default --steps): its steps hold ~5x the examples",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scratch", default=os.path.join(ROOT, "build", "bench_e2e"))
    p.add_argument(
        "--model",
        choices=sorted(SHAPES),
        default="0.25b",
        help="0.25b: the end-to-end benchmark's model; 0.8b: hidden 2048 / intermediate 5504 / 14 layers "
        "(839M parameters, bench/big_model.py's shape); ernie: the ERNIE-4.5-shaped 0.36B "
        "Ernie4_5ForCausalLM of bench/ernie_shape.py (transformers layout; no PaddleNLP column; "
        "TRL in this interpreter unless --trl-python)",
    )
    p.add_argument("--paddlenlp-llm", help="PaddleNLP's llm/ dir (run_finetune.py + utils/) at v3.0.0-beta4")
    p.add_argument("--paddlenlp-cpu-env", action="store_true", help="give PaddleNLP our CPU set-up's variables")
    p.add_argument(
        "--trl-python",
        help="an interpreter with torch, transformers, peft and trl (default: "
        "SCRATCH/venv-trl, set up when absent; --model ernie: this interpreter)",
    )
    p.add_argument(
        "--trl-defaults",
        action="store_true",
        help="TRL as it ships (gradient checkpointing on, its own example order), as the TRL figures measured "
        "before 2026-11-28; default: the same work as ours",
    )
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--peak-json", help="bench/peak.py's --json of this machine, instead of measuring the peak")
    p.add_argument("--no-peak", action="store_true", help="no matmul peak measurement (no fraction of peak)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the regression guard: ours only, lora and packed, 2 steps, "
        "1 repeat, no peak; compared with the figures recorded in docs/benchmarks.md for this ISA",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.15,
        help="--quick: a slowdown (or more peak RSS) beyond this fraction is flagged (default 0.15)",
    )
    p.add_argument("--fail-on-slowdown", action="store_true", help="--quick: exit 1 when a case is flagged")
    p.add_argument(
        "--record",
        action="store_true",
        help="--quick: add this run's figures to docs/benchmarks.md as the last recorded ones of this ISA",
    )
    a = p.parse_args(argv)
    if a.quick:
        fixed = {
            "--cases": a.cases != "lora,packed",
            "--toolkits": a.toolkits != "ours,paddlenlp,trl",
            "--steps": a.steps != STEPS_DEFAULT,
            "--packed-steps": a.packed_steps is not None,
            "--repeats": a.repeats != 2,
            "--model": a.model != "0.25b",
        }
        if any(fixed.values()):  # the recorded figures are of exactly this run
            p.error(
                f"--quick runs ours on the 0.25b model, lora and packed, 2 steps, once (the recorded figures' "
                f"run): drop {', '.join(k for k, v in fixed.items() if v)}"
            )
        a.cases, a.toolkits, a.steps, a.packed_steps, a.repeats = "lora,packed", "ours", 2, 2, 1
        a.no_peak = a.no_peak or not a.peak_json
    elif a.record or a.fail_on_slowdown:
        p.error("--record and --fail-on-slowdown go with --quick")
    cases = [c for c in a.cases.split(",") if c]
    toolkits = set(a.toolkits.split(","))
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown case(s) {bad}: choose from {CASES}")
    a.scratch = os.path.abspath(a.scratch)  # the TRL worker runs in its output directory
    ernie = a.model == "ernie"
    if ernie and a.trl_python is None:
        a.trl_python = sys.executable  # the venv whose transformers saves the model has trl too
    model_dir = model_path(a.scratch, a.model)
    data_dir = ensure_data(a.scratch)
    dpo_dir = ensure_dpo_data(a.scratch) if "dpo" in cases else None
    py, trl_why = trl_python(a.scratch, a.trl_python) if "trl" in toolkits else (None, "not asked")
    info = ensure_ernie(model_dir) if ernie else ensure_model(model_dir, SHAPES[a.model])
    llm_dir, pn_why = paddlenlp_llm(a.paddlenlp_llm) if "paddlenlp" in toolkits else (None, "not asked")
    if ernie and llm_dir:
        llm_dir, pn_why = None, "PaddleNLP 3.0.0b4 has no ERNIE 4.5 model (--model ernie)"
    # the ERNIE-shaped model is in transformers' layout already: TRL reads the same directory
    hf_dir = (
        (model_dir if ernie else hf_copy(model_dir, os.path.join(a.scratch, f"llama-{a.model}-hf"))) if py else None
    )
    limit = machine_limit(a, info, data_dir)
    load = os.getloadavg()
    print(
        f"model {model_dir} ({info['params']:,} parameters), data {data_dir}, {a.steps} steps of 1 x "
        f"{ACCUMULATION} (cases *_b4: 4 x 1) at max_length {MAX_LENGTH}, LoRA r{RANK}/{ALPHA} on "
        f"{'/'.join(DECODER_LINEARS)}, fp32, cases {cases}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"on {os.cpu_count()} CPUs",
        flush=True,
    )
    if py and a.trl_defaults:
        print("TRL as it ships: gradient checkpointing on, its own example order (--trl-defaults)", flush=True)
    elif py:
        print(
            "same work, ours and TRL: no gradient checkpointing on either side; unpacked cases: TRL takes "
            f"ours' example order (seed {SEED}), the same 4 examples per optimizer step; packed cases: both "
            "pack (ours greedy zero padding, TRL packing=True); processed / supervised tokens per run below",
            flush=True,
        )
    for name, why in (("TRL", trl_why), ("PaddleNLP", pn_why)):
        if why:
            print(f"{name} column skipped: {why}", flush=True)
    plan = []
    for case in cases:
        if "ours" in toolkits:
            plan.append((case, "ours"))
        if llm_dir and case in ("lora", "packed"):
            plan.append((case, "paddlenlp"))
        if py and case in ("lora", "packed", "dpo"):
            plan.append((case, "trl"))
    runs = []
    for i in range(a.repeats):
        for case, who in plan:
            t0 = time.time()
            steps = a.packed_steps if case.startswith("packed") and a.packed_steps else a.steps
            out_dir = os.path.join(a.scratch, f"{who}_{case}_{i}")
            if who == "ours" and case == "dpo":
                r = run_once(
                    "on",
                    model_dir,
                    dpo_dir,
                    out_dir,
                    steps,
                    cli=DPO_CLI,
                    config=DPO_CONFIG,
                    args=dpo_args(model_dir, dpo_dir, out_dir, steps),
                )
                r.update(toolkit="ours", detail="llm/run_dpo.py")
            elif who == "ours":
                r = run_once("on", model_dir, data_dir, out_dir, steps, OURS_ARGS[case])
                r.update(
                    toolkit="ours",
                    detail="llm/run_finetune.py" + (", nf4" if case == "qlora" else ""),
                    supervised_fraction=r["summary"].get("supervised_token_fraction"),
                    tokens=r["summary"].get("tokens_trained"),
                )
            elif who == "paddlenlp":
                r = run_paddlenlp(llm_dir, model_dir, data_dir, out_dir, steps, case == "packed", a.paddlenlp_cpu_env)
            else:
                r = run_trl(
                    py,
                    hf_dir,
                    dpo_dir if case == "dpo" else data_dir,
                    out_dir,
                    steps,
                    case == "packed",
                    dpo=case == "dpo",
                    use_fast=not ernie,
                    same_work=case != "dpo" and not a.trl_defaults,
                )
                # ernie: transformers' slow tokenizer over the same SentencePiece model ours reads (the fast
                # conversion needs protobuf, which the shared venv lacks)
            r.update(
                case=case,
                repeat=i,
                **achieved(r.get("sup_tok_s"), limit["per_sup_token"].get(case), limit["peak_flops"]),
            )
            runs.append({k: v for k, v in r.items() if k != "summary"})
            speed = f"{r['pairs_s']:.2f} pairs/s" if case == "dpo" else f"{r['sup_tok_s']:.1f} supervised tok/s"
            print(
                f"  {case} {r['toolkit']} #{i + 1}: {speed}, step {r['step_s']:.2f} s, "
                f"RSS {r['peak_rss_gib']:.2f} GiB, CPU {fmt(r['cpu_pct'], '.0f')}%, loss {r['final_loss']:.4f}, "
                f"tokens {fmt(r.get('tokens'), '.0f')} (supervised {fmt(r.get('supervised_tokens'), '.0f')})"
                + (f", {r['work']}" if r.get("work") else "")
                + f" ({time.time() - t0:.0f} s, load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    print()
    for case in cases:
        print("\n".join(table(runs, case)) + "\n")
    print("\n".join(ratios_across(runs)))
    print(limit_lines(limit, runs))
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    versions = next((r["versions"] for r in runs if r.get("versions")), None)
    if versions:
        print("TRL side:", versions)
    h.write_json(
        a.json,
        {
            "runs": runs,
            "steps": a.steps,
            "trl_skipped": trl_why,
            "paddlenlp_skipped": pn_why,
            "cpu": limit["cpu"],
            "peak": limit["peak"],
            "data": limit["stats"],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
    )
    return quick_guard(a, runs, limit["cpu"]) if a.quick else 0


if __name__ == "__main__":
    sys.exit(main())
