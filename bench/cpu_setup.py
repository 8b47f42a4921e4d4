"""Benchmark: the CPU set-up of ``paddlenlp_ext/runtime/cpu_env.py`` on vs off, through the CLI.

    .venv/bin/python -m bench.cpu_setup [--steps 8] [--repeats 2] [--scratch build/bench_cpu_setup] [--json out.json]

The same LoRA fine-tune runs through ``llm/run_finetune.py`` in separate processes, interleaved
(off, on, off, on, ...), ``--repeats`` times each:

* **off**: ``PADDLENLP_EXT_CPU_SETUP=0`` (Paddle's defaults: ``OMP_NUM_THREADS=1``, MKL's own dispatch),
* **on**: the set-up as every CLI runs it (the configuration line's ``cpu:`` text is printed).

Both start from an environment without ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` /
``MKL_DEBUG_CPU_TYPE`` / ``MKL_ENABLE_INSTRUCTIONS``.

Model: a random PaddleNLP ``LlamaForCausalLM`` (hidden 1024, intermediate 2816, 16 layers, 16 heads,
vocab 32000: 0.26B parameters, fp32), built once with ``LlamaConfig`` + ``save_pretrained`` in the
scratch dir, with the Llama-2 SentencePiece tokenizer of ``../shared/data/llama2_tokenizer.model``
(or PADDLENLP_EXT_SHARED_DATA); data: ``alpaca_en_demo.json`` there as {src, tgt} lines (``bench/big_model.py``'s
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
import sys

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402
from bench.big_model import write_data  # noqa: E402
from paddlenlp_ext.runtime.cpu_env import CODE_PATH_VARS, SWITCH, THREAD_VARS  # noqa: E402

ROOT, SHARED, ALPACA, TOKENIZER_MODEL = h.ROOT, h.SHARED, h.ALPACA, h.TOKENIZER_MODEL
CLI = os.path.join(ROOT, "llm", "run_finetune.py")
CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json")
MODEL_SHAPE = h.llama_shape(1024, 2816, 16, 16, 16, max_position_embeddings=2048)
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
        r = h.run(
            [sys.executable, "-c", BUILD, model_dir, TOKENIZER_MODEL, h.TINY_MODEL, json.dumps(shape or MODEL_SHAPE)],
            name="model build",
            env=h.clean_env(PYTHONPATH=ROOT),
            mark=None,
        )
        print(r.output.strip().splitlines()[-1], flush=True)
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


def lora_knobs(steps: int) -> list:
    """The training settings of every ours-side run here and in bench/e2e.py (SFT and DPO; its TRL side
    uses the same values, bench/e2e_runs.py): batch 1 x 4 accumulated, lr 1e-4 without warm-up, LoRA r8 / 16,
    a loss every step, no eval, nothing saved, seed 42."""
    knobs = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, learning_rate="1e-4", warmup_steps=0)
    quiet = dict(logging_steps=1, do_eval="false", save_strategy="no", disable_tqdm="true", seed=42)
    return h.flags(overwrite_output_dir="true", max_steps=steps, **knobs, lora_rank=8, lora_alpha=16, **quiet)


def ab_runs(names, repeats: int, run, line) -> dict:
    """Each of ``names`` run ``repeats`` times, interleaved (a, b, a, b, ...) so the machine's other load
    spreads over all of them: ``{name: [run(name, 0), run(name, 1), ...]}``, ``line(name, i, result)``
    printed after each run and a blank line after the last."""
    runs = {name: [] for name in names}
    for i in range(repeats):
        for name in names:
            runs[name].append(run(name, i))
            print(line(name, i, runs[name][-1]), flush=True)
    print()
    return runs


def finetune_args(model_dir: str, data_dir: str, out_dir: str, steps: int) -> list:
    """``llm/run_finetune.py``'s arguments of these benchmarks (after the config file)."""
    where = h.flags(model_name_or_path=model_dir, dataset_name_or_path=data_dir, output_dir=out_dir)
    return where + lora_knobs(steps) + h.flags(max_length=1024, src_length=1024, eval_before_train="false")


def run_once(
    setting: str,
    model_dir: str,
    data_dir: str,
    out_dir: str,
    steps: int,
    extra=(),
    cli=CLI,
    config=CONFIG,
    args=None,
    root=ROOT,
) -> dict:
    """One run of our CLI (default ``llm/run_finetune.py`` with :func:`finetune_args`; ``extra``: more
    ``--key value`` arguments, e.g. packing) with the CPU set-up ``on`` or ``off``, from the checkout ``root``."""
    env = h.clean_env(THREAD_VARS + CODE_PATH_VARS + (SWITCH,), PYTHONPATH=root)
    if setting == "off":
        env[SWITCH] = "0"
    args = finetune_args(model_dir, data_dir, out_dir, steps) if args is None else args
    cpu_text = []
    r = h.run(
        [sys.executable, cli, config, *args, *extra],
        name=f"{setting} run",
        env=env,
        out_dir=out_dir,
        on_line=lambda line: cpu_text.extend(CPU_LINE.findall(line)),
    )
    return {
        "setting": setting,
        "cpu_line": cpu_text[0] if cpu_text else None,
        **read_run(r),
        "env": r.summary["cpu"]["env"],
    }


def read_run(r: h.Run) -> dict:
    """A finished CLI run's numbers: run_summary.json, the logged losses, the harness's peak RSS and CPU%."""
    s = r.summary
    losses = r.losses()
    sup = s.get("supervised_tokens_trained", s.get("answer_tokens_trained"))  # DPO: the answers' tokens
    return {
        "sup_tok_s": sup / s["train_time_s"],
        "step_s": r.median_step_s(),
        "pairs_s": s["pairs_trained"] / s["train_time_s"] if s.get("pairs_trained") else None,
        "peak_rss_gib": r.peak_rss_bytes / h.GiB,
        "cpu_pct": r.cpu_pct,
        "final_loss": losses[-1],
        "losses": losses,
        "supervised_tokens": sup,
        "train_time_s": s["train_time_s"],
        "padding": ((s.get("data") or {}).get("train") or {}).get("padding_ratio"),
        "summary": s,
    }


def loss_rel_diff(runs_a, runs_b) -> float:
    """Largest relative difference between paired runs' per-step losses:
    ``loss_rel_diff([{"losses": [1.0, 2.0]}], [{"losses": [1.0, 2.5]}])`` -> ``0.2``."""
    return max(
        abs(x - y) / max(abs(y), 1e-12) for ra, rb in zip(runs_a, runs_b) for x, y in zip(ra["losses"], rb["losses"])
    )


COLUMNS = ("sup_tok_s", "step_s", "peak_rss_gib", "cpu_pct")


def cells(r: dict) -> list:
    """A run's (or a mean's) supervised tok/s, step time, peak RSS and CPU% cells."""
    return [
        h.fmt(r["sup_tok_s"], ".1f"),
        h.fmt(r["step_s"]) + " s",
        h.fmt(r["peak_rss_gib"]) + " GiB",
        h.fmt(r["cpu_pct"], ".0f") + "%",
    ]


def compare(runs: dict, label: str, base: str, ours: str) -> str:
    """The side-by-side table of two settings' runs (``runs``: setting -> runs): each setting's means (every
    run's supervised tok/s in brackets), and the ratios ours / base."""
    head = [label, "runs", "supervised tok/s", "step time", "peak RSS", "CPU% in steps", "final loss"]
    means = {k: {c: h.mean(rs, c) for c in COLUMNS + ("final_loss",)} for k, rs in runs.items()}
    rows = [
        [
            k,
            len(rs),
            cells(means[k])[0] + f" ({', '.join(h.fmt(r['sup_tok_s'], '.1f') for r in rs)})",
            *cells(means[k])[1:],
            h.fmt(means[k]["final_loss"], ".6f"),
        ]
        for k, rs in runs.items()
    ]
    rows.append([f"{ours} / {base}", "", *h.ratio_cells(means[ours], means[base], COLUMNS[:3]), "", ""])
    return h.table(head, rows)


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
    print(
        f"model {model_dir} ({info['params']:,} parameters, vocab {info['vocab']}), data {data_dir}, "
        f"{a.steps} steps of 1 x 4 at max_length 1024, LoRA r8, fp32",
        flush=True,
    )
    runs = ab_runs(
        ("off", "on"),
        a.repeats,
        lambda setting, i: run_once(
            setting, model_dir, data_dir, os.path.join(a.scratch, f"run_{setting}_{i}"), a.steps
        ),
        lambda setting, i, r: (
            f"  {setting} #{i + 1}: {r['sup_tok_s']:.1f} supervised tok/s, step {r['step_s']:.2f} s, "
            f"CPU {h.fmt(r['cpu_pct'], '.0f')}%, loss {r['final_loss']:.6f} ({r['cpu_line']})"
        ),
    )
    print(compare(runs, "setting", "off", "on"))
    diff = loss_rel_diff(runs["on"], runs["off"])
    print(
        f"\nper-step losses, on vs off: largest relative difference {diff:.2e} "
        f"over {len(runs['on'][0]['losses'])} steps x {len(runs['on'])} pairs"
    )
    print("cpu line (on):", runs["on"][0]["cpu_line"], "| env:", runs["on"][0]["env"])
    h.write_json(a.json, {"runs": runs, "loss_rel_diff": diff, "model": info, "steps": a.steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
