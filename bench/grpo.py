"""Benchmark: GRPO's rollout phase, the rollout engine vs ``model.generate``, on the same step with the same seeds.

    .venv/bin/python -m bench.grpo [--repeats 2] [--batch 2] [--accumulation 1] [--scratch build/bench_grpo]
                                   [--json out.json]

1. Builds (once) the random 0.26B Llama of ``bench/cpu_setup.py`` (hidden 1024, 16 layers, vocab 32000, fp32,
   the Llama-2 SentencePiece tokenizer of the shared data) under ``--scratch``.
2. Runs a worker process through the harness (``harness.run``: peak RSS, wall time).  The worker loads the
   GRPO toy's config (``llm/config/tiny/grpo_argument.json``: G = 8 completions per prompt, at most 20 tokens,
   temperature 1.0, seed 42) with the model, ``--batch`` prompts per micro-batch and ``--accumulation``
   micro-batches per step, renders the toy's prompts (``llm/data/grpo_tiny``) as ``llm/run_grpo.py`` does
   (``grpo.run.build_prompts``), and times the sampling of one optimizer step's rollout
   (``grpo.sampling.sample_step``, as ``GRPOTrainer`` calls it) with ``rollout_engine: generate`` (today's
   path: one ``model.generate`` per prompt's group) and ``rollout_engine: engine`` (the whole step as one
   batch), interleaved (generate,
   engine, generate, engine, ...; one untimed warm-up round, then ``--repeats`` timed rounds).
3. Prints each engine's round times, their medians, completion tokens per second, the ratio, whether both
   engines drew exactly the same tokens (every row of every round), the worker's peak RSS and the load
   average before and after (the machine is shared: interleaving spreads other load over both engines).

Exit 0 when the engine is at least 2x faster (median over median), else 1; the share of identical rows is
reported, not gated.  Equal tokens need equal logits: the sampler draws exactly what ``generate`` draws from the same logits, but
MKL picks its matrix kernels by shape, so a row's logits in a batch of another shape can differ in the last
bits (measured: up to ~2.5e-6), and a draw that falls that close to a boundary between two tokens flips; the
row differs from there on (the other rows do not: each group's random numbers do not depend on its tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402

ROOT = h.ROOT
CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "grpo_argument.json")
TARGET = 2.0  # the "at least 2x faster"


def worker(args) -> None:
    """In the worker process: load, render, time both engines, print one ``RESULT {json}`` line."""
    import tempfile

    from paddlenlp_ext.runtime.cpu_env import setup_cpu

    print(setup_cpu().text, flush=True)  # the CLIs' CPU set-up (threads, MKL code path), before paddle loads
    from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer

    from paddlenlp_ext.config.parse import load_config
    from paddlenlp_ext.grpo.run import build_prompts
    from paddlenlp_ext.grpo.sampling import sample_step

    out = tempfile.mkdtemp(prefix="bench_grpo_")
    cfg = load_config(
        CONFIG,
        [
            "--model_name_or_path",
            args.model,
            "--output_dir",
            out,
            "--per_device_train_batch_size",
            str(args.batch),
            "--gradient_accumulation_steps",
            str(args.accumulation),
        ],
        mode="grpo",
    )
    o = cfg.alignment
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset, _ = build_prompts(cfg, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    model.eval()
    eos_ids = [int(tokenizer.eos_token_id)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    plan = [list(range(k * args.batch, (k + 1) * args.batch)) for k in range(args.accumulation)]  # one step

    def rollout(engine):  # as GRPOTrainer._make_rollout samples a step's first turns
        return sample_step(
            model,
            dataset.ids,
            plan,
            engine=engine,
            group=o.num_generations,
            step=0,
            seed=int(cfg.training["seed"]),
            max_new_tokens=o.max_completion_length,
            temperature=o.temperature,
            top_p=o.top_p,
            eos_ids=eos_ids,
            pad_id=pad_id,
        )

    rounds = {"generate": [], "engine": []}

    def variant(engine):
        def call():
            result = rollout(engine)
            rounds[engine].append(result)
            return result

        return call

    times, _ = h.interleave(
        {"generate": variant("generate"), "engine": variant("engine")}, args.repeats, warmup=1, log=True
    )
    # row by row: identical, or the index of the first token where the two engines' rows differ
    pairs = [
        (a, b) for ga, gb in zip(rounds["generate"], rounds["engine"]) for ma, mb in zip(ga, gb) for a, b in zip(ma, mb)
    ]
    diverge = [
        next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs if a != b
    ]
    tokens = sum(len(c) for micro in rounds["engine"][-1] for c in micro)
    print(
        "RESULT "
        + json.dumps(
            {
                "times": times,
                "same_tokens": not diverge,
                "rows_compared": len(pairs),
                "rows_differing": len(diverge),
                "first_difference_at": diverge,
                "completion_tokens": tokens,
                "rows": sum(len(micro) for micro in rounds["engine"][-1]),
                "prompt_tokens": [len(dataset.ids[i]) for indices in plan for i in indices],
                "group": o.num_generations,
                "max_completion_length": o.max_completion_length,
                "temperature": o.temperature,
                "top_p": o.top_p,
            }
        ),
        flush=True,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="prompts per micro-batch (the toy config's 2)")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--scratch", default=os.path.join(ROOT, "build", "bench_grpo"))
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    h.require_shared(h.TOKENIZER_MODEL, what="bench/grpo.py")
    from bench.cpu_setup import ensure_model

    model_dir = os.path.join(args.scratch, "llama-0.25b")
    built = ensure_model(model_dir)
    load_before = os.getloadavg()
    run = h.run(
        h.module(
            "bench.grpo",
            "--worker",
            "--model",
            model_dir,
            "--repeats",
            args.repeats,
            "--batch",
            args.batch,
            "--accumulation",
            args.accumulation,
        ),
        name="grpo rollout worker",
        env=h.clean_env(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1"),
        mark=None,
        on_line=lambda line: line.startswith("  round") and print(line, flush=True),
    )
    load_after = os.getloadavg()
    result = json.loads(next(line for line in run.output.splitlines() if line.startswith("RESULT "))[7:])
    t = result["times"]
    med = {k: h.median(v) for k, v in t.items()}
    speed = h.ratio(med["generate"], med["engine"])
    rows = [
        [k, " / ".join(h.fmt(x) for x in t[k]), h.fmt(med[k]), h.fmt(result["completion_tokens"] / med[k], ".1f")]
        for k in ("generate", "engine")
    ]
    print(
        f"\nmodel: {built['params']:,} parameters (random Llama, fp32), vocab {built['vocab']}; one GRPO step: "
        f"{args.accumulation} x {args.batch} prompts (prompt tokens {result['prompt_tokens']}) x G "
        f"{result['group']} = {result['rows']} completions of <= {result['max_completion_length']} tokens, "
        f"temperature {result['temperature']}, top_p {result['top_p']}"
    )
    print(h.table(["rollout_engine", "rollout s per round", "median s", "completion tokens/s"], rows))
    print(
        f"engine vs generate: {h.fmt(speed)}x faster (target >= {TARGET}x: {h.verdict(speed, TARGET, at_least=True)})"
    )
    print(
        f"same sampled tokens: {result['rows_compared'] - result['rows_differing']} of {result['rows_compared']} "
        f"rows (every round) identical"
        + (
            f"; the others first differ at token {result['first_difference_at']} "
            "(float rounding of the batched forward, docs/benchmarks.md)"
            if result["rows_differing"]
            else ""
        )
    )
    print(
        f"worker peak RSS {run.peak_rss_bytes / h.GiB:.2f} GiB, wall {run.wall_s:.0f} s; load average before "
        f"{load_before[0]:.2f} / after {load_after[0]:.2f} (1 min), {os.cpu_count()} CPUs"
    )
    h.write_json(
        args.json,
        {
            **result,
            "median": med,
            "speedup": speed,
            "load_before": load_before,
            "load_after": load_after,
            "peak_rss_bytes": run.peak_rss_bytes,
        },
        indent=1,
    )
    return 0 if speed is not None and speed >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
