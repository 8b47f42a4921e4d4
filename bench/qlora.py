"""Benchmark of QLoRA: memory per parameter, RSS and step time of a quantized base + LoRA,
and the eval-loss change when a trained tiny model is quantized.

Run from the repo root (about 4 minutes on a 2-core CPU):

    .venv/bin/python -m bench.qlora

Part 0 -- the kernels on one ``[2048, 5504]`` fp32 weight (``--part0-shape``), in this process:

* quantize throughput (parameters per second) of ``paddlenlp_ext.quant.quantize`` per format
  (best of ``--part0-repeats``; CPU time of the process and wall time);
* x ``[256, 2048]`` (``--part0-tokens``) through the layer, forward + backward (gradient to x only,
  the frozen-base case of LoRA): ``QuantizedLinear`` (dequantize, matmul, free; dequantize again in
  backward) against a plain fp32 ``paddle.matmul`` on the float weight, and one dequantization alone.

Part 1 -- a random-init PaddleNLP ``LlamaForCausalLM`` of about 106M parameters
(vocab 32000, hidden 768, 8 layers, intermediate 2048, 12 heads; fp32), one subprocess
per configuration (bf16 is only reported as its theoretical 2 bytes/param: the CPU build
has no bf16 matmul):

* bytes per parameter of the base linear weights (the 56 decoder ``nn.Linear`` layers that
  ``quantize_model`` replaces; embeddings, lm_head and norms stay fp32 in every
  configuration), from ``quantize_model`` stats and checked against
  ``quantized_state_bytes(model)``;
* with LoRA (r=8, alpha=16, all decoder linears) on top: RSS and the step time of
  ``--warmup`` + ``--steps`` training steps (AdamW over the LoRA parameters, random token
  batch ``--batch`` x ``--seq``, forward + backward + step; median of the timed steps).

How RSS is measured (Linux ``/proc/self/status``, through ``bench/harness.py``): the model is
built LAYER BY LAYER -- constructed under ``paddle.LazyGuard()`` + PaddleNLP's
``no_init_weights()`` so that no parameter memory exists yet, then every decoder layer is
materialised with PaddleNLP's own initialisation (normal(0, initializer_range), o_proj /
down_proj scaled by 1/sqrt(2 * layers)) and its linears are quantized immediately, before the
next layer exists. So at most one decoder layer (28 MiB) is ever held in fp32 and the build
peak is a truthful picture of loading a quantized base. Reported per configuration:

* ``after imports``: current RSS after importing paddle + paddlenlp (the runtime, identical
  for every configuration);
* ``after build``: current RSS after build + quantization + ``gc.collect()``;
* ``build peak``: VmHWM (process peak RSS) at that point;
* ``train peak``: VmHWM over the training steps only -- the high-water mark is reset
  (``bench/harness.py``'s ``reset_peak``: ``echo 5 > /proc/self/clear_refs``) right before the
  first step, so it does not include the build; where the kernel does not allow it the column says so;
* ``steady``: current RSS after the last step.

A second table (``--naive``) shows what the numbers look like the naive way: build the full
fp32 model first, then ``quantize_model`` it. There the process peak contains the whole
fp32 model, and the current RSS afterwards shows whether the freed fp32 memory went back
to the OS.

Part 2 -- the tiny model is fully fine-tuned with the CLI
(``llm/run_finetune.py llm/config/tiny/sft_argument.json``, 150 steps) into a temp dir and
then evaluated with the CLI (``--do_train false``) unquantized and with each quantized base
(nf4/fp4 at the default block size 64, whose last block of down_proj's 176 inputs is 48 long, and
at block size 16).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402
from bench import qlora_tables as tables  # noqa: E402
from bench.qlora_worker import CONFIGS, part0, shape_text, worker  # noqa: E402

REPO = Path(h.ROOT)
CLI = REPO / "llm" / "run_finetune.py"
SFT_CFG = REPO / "llm" / "config" / "tiny" / "sft_argument.json"

THEORETICAL = {"bf16": 2.0}

# part 2: name -> extra CLI args for the eval-only run
EVAL_CONFIGS = {
    "unquantized": [],
    "weight_only_int8": ["--weight_quantize_algo", "weight_only_int8"],
    "weight_only_int4": ["--weight_quantize_algo", "weight_only_int4"],
    "nf4 (bs 64)": ["--weight_quantize_algo", "nf4"],
    "nf4 (bs 64) + double quant": ["--weight_quantize_algo", "nf4", "--weight_double_quant", "true"],
    "nf4 (bs 16)": ["--weight_quantize_algo", "nf4", "--weight_blocksize", "16"],
    "nf4 (bs 16) + double quant": [
        "--weight_quantize_algo",
        "nf4",
        "--weight_blocksize",
        "16",
        "--weight_double_quant",
        "true",
    ],
    "fp4 (bs 16)": ["--weight_quantize_algo", "fp4", "--weight_blocksize", "16"],
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


# =============================================================== driver
def run_worker(name, mode, args, python):
    cmd = [
        python,
        "-m",
        "bench.qlora",
        "--worker",
        name,
        "--mode",
        mode,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--rank",
        str(args.rank),
        "--block-size",
        str(args.block_size),
        "--seed",
        str(args.seed),
    ]
    r = h.run(cmd, name=name, mark=None, check=False)
    for line in r.output.splitlines()[::-1]:
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT ") :])
            res["proc_wall_s"] = r.wall_s
            return res
    print(
        f"!! {name} ({mode}) failed (exit {r.returncode}): {shlex.join(cmd)}\n{r.tail()}", file=sys.stderr, flush=True
    )
    return {"config": name, "mode": mode, "failed": True}


def cli_eval_part(args, python, tmp: Path):
    model_dir = tmp / "tiny_sft"
    common = [
        "--model_name_or_path",
        str(args.tiny_model),
        "--dataset_name_or_path",
        str(args.data),
        "--seed",
        str(args.seed),
    ]
    train_cmd = [
        python,
        str(CLI),
        str(SFT_CFG),
        *common,
        "--output_dir",
        str(model_dir),
        "--max_steps",
        str(args.tiny_steps),
        "--do_train",
        "true",
        "--do_eval",
        "true",
        "--eval_before_train",
        "true",
    ]
    r = h.run(train_cmd, name="tiny training", out_dir=str(model_dir), check=False)
    if not r.ok:
        print(f"!! tiny training failed: {shlex.join(train_cmd)}\n{r.tail()}", file=sys.stderr, flush=True)
        return None
    train = r.summary
    print(
        f"  tiny full fine-tuning, {train['global_steps']} steps: eval loss {train['eval_loss_before_train']:.4f} "
        f"-> {train['eval_loss']:.4f} ({r.wall_s:.0f} s)",
        flush=True,
    )
    rows = []
    for name, extra in EVAL_CONFIGS.items():
        out = tmp / ("eval_" + slug(name))
        cmd = [
            python,
            str(CLI),
            str(SFT_CFG),
            "--model_name_or_path",
            str(model_dir),
            "--dataset_name_or_path",
            str(args.data),
            "--seed",
            str(args.seed),
            "--output_dir",
            str(out),
            "--do_train",
            "false",
            "--do_eval",
            "true",
            "--eval_before_train",
            "false",
            *extra,
        ]
        r = h.run(cmd, name=f"eval {name}", out_dir=str(out), check=False)
        if not r.ok:
            print(f"!! eval {name} failed: {shlex.join(cmd)}\n{r.tail()}", file=sys.stderr, flush=True)
            rows.append({"name": name, "failed": True})
            continue
        s = r.summary
        q = s.get("quantization") or {}
        rows.append(
            {
                "name": name,
                "eval_loss": s["eval_loss"],
                "ppl": s.get("eval_perplexity"),
                "bpp": q.get("bytes_per_param"),
                "layers": q.get("layers_replaced"),
                "rss": r.peak_rss_bytes,
            }
        )
        print(f"  eval {name:<28} loss {s['eval_loss']:.4f} ({r.wall_s:.0f} s)", flush=True)
    return train, rows, train_cmd


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed training steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rank", type=int, default=8, help="LoRA r (alpha = 2r)")
    p.add_argument("--block-size", type=int, default=64, help="nf4/fp4 block size for the 100M model")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=list(CONFIGS),
        metavar="NAME",
        help=f"subset of: {', '.join(CONFIGS)}",
    )
    p.add_argument(
        "--naive",
        nargs="*",
        choices=list(CONFIGS),
        default=["weight_only_int8", "nf4 + double quant"],
        metavar="NAME",
        help="configurations also built the naive way (fp32 model, then quantize_model); no training steps",
    )
    p.add_argument("--skip-part0", action="store_true")
    p.add_argument("--part0-shape", type=int, nargs=2, default=[2048, 5504], metavar=("IN", "OUT"))
    p.add_argument("--part0-tokens", type=int, default=256)
    p.add_argument("--part0-repeats", type=int, default=5)
    p.add_argument("--skip-part1", action="store_true")
    p.add_argument("--skip-part2", action="store_true")
    p.add_argument("--tiny-steps", type=int, default=150)
    p.add_argument("--tiny-model", default=str(REPO / "build" / "tiny-llama"))
    p.add_argument("--data", default=str(REPO / "llm" / "data" / "advertise"))
    p.add_argument("--doc", default=str(REPO / "docs" / "qlora_benchmark.md"), help="markdown output ('' to skip)")
    # internal: run one configuration
    p.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["lazy", "naive"], default="lazy", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        import logging

        logging.disable(logging.INFO)
        res = worker(args)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    python = sys.executable
    shown = os.path.relpath(python, REPO) if python.startswith(str(REPO)) else python
    command = shlex.join([shown, "-m", "bench.qlora", *(sys.argv[1:] if argv is None else argv)])
    print("command: " + command, flush=True)
    t_all = time.time()
    md = [f"Command (from the repo root):\n\n```\n{command}\n```\n"]
    failed = False

    if not args.skip_part0:
        print("\n## Part 0: quantize throughput and the quantized layer's forward + backward\n", flush=True)
        shape = tuple(args.part0_shape)
        qr, sr, base = part0(shape, args.part0_tokens, args.part0_repeats, args.seed)
        text = tables.table_part0(qr, sr, base, shape, args.part0_tokens)
        print(text + "\n", flush=True)
        md += ["## Part 0: kernels on one layer\n", text, ""]

    if not args.skip_part1:
        n_lin = 8 * (4 * 768 * 768 + 3 * 768 * 2048)
        print(
            f"\n## Part 1: ~106M-parameter random-init LlamaForCausalLM "
            f"({shape_text('=')}), "
            f"fp32; {n_lin:,} parameters in the 56 decoder linears\n",
            flush=True,
        )

        def workers(names, mode, line):
            """Run one worker per configuration; ``line(name, result)``: its progress line."""
            nonlocal failed
            out = []
            for name in names:
                r = run_worker(name, mode, args, python)
                out.append(r)
                failed |= bool(r.get("failed"))
                if not r.get("failed"):
                    print(line(name, r) + f" ({r['proc_wall_s']:.0f} s)", flush=True)
            return out

        rows = workers(
            args.configs,
            "lazy",
            lambda name, r: (
                f"  {name:<20} {r['bytes_per_param']:.4f} B/param, build {r['build_s']:.1f} s, "
                f"step {r.get('step_ms', float('nan')):.0f} ms, losses {r.get('losses')}"
            ),
        )
        naive = workers(
            args.naive, "naive", lambda name, r: f"  naive {name:<20} peak {r['peak_build'] / tables.MiB:.0f} MiB"
        )

        t_bytes, checks = tables.table_bytes(rows, args.block_size)
        ok_row = next((r for r in rows if not r.get("failed")), {})
        other = ok_row.get("other_params", 0)
        how = ok_row.get("peak_train_how", "VmHWM reset")
        intro = (
            f"Random-init PaddleNLP `LlamaForCausalLM` "
            f"({shape_text(' ')}), "
            f"{ok_row.get('linear_params', 0) + other:,} parameters in fp32: {ok_row.get('linear_params', 0):,} in the 56 "
            f"decoder linears that `quantize_model` replaces, {other:,} (embeddings, lm_head, norms; "
            f"{4 * other / tables.MiB:.0f} MiB) that stay fp32 in every configuration. nf4/fp4 use block size "
            f"{args.block_size}, double quantization block 256. Bytes per parameter are the quantized buffers "
            f"(codes + scales, `quantize_model` stats `bytes_after / params`, equal to "
            f"`quantized_state_bytes(model)`) over the quantized weights; fp32 is the float weights; bf16 is "
            f"the theoretical 2 bytes (not run: the CPU build has no bf16 matmul)."
        )
        t_train = tables.table_train(rows)
        train_intro = (
            f"LoRA r={args.rank}, alpha={2 * args.rank} on all 56 decoder linears "
            f"({ok_row.get('trainable', 0):,} trainable parameters), AdamW over the LoRA parameters, random tokens "
            f"{args.batch} x {args.seq}, forward + backward + step; step time is the median of {args.steps} steps "
            f"after {args.warmup} warm-up step(s). One subprocess per configuration. The model is built layer by "
            f"layer: constructed under `paddle.LazyGuard()` + PaddleNLP `no_init_weights()` (no parameter memory), "
            f"then each decoder layer is materialised with PaddleNLP's initialisation and quantized immediately, so "
            f"at most one fp32 decoder layer (28 MiB) exists at a time. RSS is from `/proc/self/status`: "
            f"*after imports* = VmRSS after importing paddle + paddlenlp (the runtime, the same for all); "
            f"*after build* = VmRSS after build + quantization + `gc.collect()`; *build peak* = VmHWM at that point; "
            f"*before steps* = VmRSS with LoRA + optimizer + batch set up; *train peak* = VmHWM over the "
            f"warm-up + timed steps only ({how}: the high-water mark is reset via `/proc/self/clear_refs` just "
            f"before the first step, so the build is not included); *steady* = VmRSS after the last step. "
            f"On CPU the quantized layers dequantize their weight on every forward and again in backward "
            f"(`portable_dequant_matmul`); *of which dequant* is that cost timed separately after the steps "
            f"(2 x one dequantization of all 56 layers, median of 3). The rest of the step (attention, the "
            f"32000-way lm_head and loss, LoRA, AdamW) is the same in every row. The steps ran on a 2-core machine "
            f"shared with other jobs (load column), so wall-clock step times move by tens of percent from run to "
            f"run; *CPU time / step* (user + sys of all threads of the process, median) is less sensitive to that "
            f"load, and step-time differences beyond the dequant column are load, not the format."
        )
        dqs = [r["dequant_ms"] for r in rows if not r.get("failed") and r.get("dequant_ms") is not None]
        dq_range = f"{min(dqs):.0f}-{max(dqs):.0f}" if dqs else "n/a"
        ratios = [r["step_cpu_ms"] / r["step_ms"] for r in rows if not r.get("failed") and r.get("step_ms")]
        cpu_ratio = sum(ratios) / len(ratios) if ratios else float("nan")
        summary = (
            "Summary (details and how each number is measured below). RSS is the whole process: about "
            f"{ok_row.get('rss_imports', 0) / tables.MiB:.0f} MiB of it is the paddle + paddlenlp runtime and "
            f"{4 * other / tables.MiB:.0f} MiB the fp32 embeddings + lm_head, the same in every row; the train peak adds "
            f"the activations of the {args.batch} x {args.seq} batch (vocab-32000 logits included). Step times are "
            "from a 2-core CPU shared with other jobs (see the load column below) and are only indicative; on CPU "
            "the quantized layers dequantize their weight on every call (measured separately below: "
            f"{dq_range} ms per step). CPU time / wall time per step is {cpu_ratio:.2f} on average (about 1 means "
            "Paddle's CPU kernels ran on a single thread)."
        )
        parts = [
            "### Summary\n",
            summary,
            "",
            tables.table_summary(rows),
            "",
            "### Bytes per parameter of the base linear weights\n",
            intro,
            "",
            t_bytes,
            "",
            "\n".join(checks),
            "",
            "### LoRA training: RSS and step time\n",
            train_intro,
            "",
            t_train,
        ]
        if naive:
            lazy_by = {r["config"]: r for r in rows if not r.get("failed")}
            parts += [
                "",
                "### Naive build for comparison: full fp32 model first, then `quantize_model`\n",
                "Same model, one subprocess each, no training. *fp32 model built* = VmRSS right after "
                "`LlamaForCausalLM(config)`; the process peak includes the whole fp32 model plus the "
                "quantization temporaries, so a peak RSS measured this way says nothing about the quantized "
                "footprint. *After quantize_model + gc* shows how much of the freed fp32 memory went back "
                "to the OS.",
                "",
                tables.table_naive(naive, lazy_by),
            ]
        text = "\n".join(parts)
        print("\n" + text + "\n", flush=True)
        md += ["## Part 1: quantized base + LoRA on a ~106M-parameter Llama\n", text, ""]
        failed |= any(c.startswith("FAIL") for c in checks)

    if not args.skip_part2:
        print("\n## Part 2: eval loss of a trained tiny model, quantized after training\n", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench_qlora_") as tmp:
            res = cli_eval_part(args, python, Path(tmp))
        if res is None:
            failed = True
        else:
            train, rows, train_cmd = res
            failed |= any(r.get("failed") for r in rows)
            intro = (
                f"The tiny model (`{os.path.relpath(args.tiny_model, REPO)}`: hidden 64, 2 layers, intermediate 176, "
                f"vocab 512) fully fine-tuned with the CLI for {train['global_steps']} steps "
                f"(`{shown} llm/run_finetune.py llm/config/tiny/sft_argument.json --max_steps {args.tiny_steps} "
                f"--output_dir TMP/tiny_sft`; eval loss {train['eval_loss_before_train']:.4f} before training, "
                f"{train['eval_loss']:.4f} after), then evaluated on the dev split with "
                f"`llm/run_finetune.py llm/config/tiny/sft_argument.json --model_name_or_path TMP/tiny_sft "
                f"--do_train false --eval_before_train false [--weight_quantize_algo ALGO --weight_blocksize BS]`, "
                f"one CLI run per row. All 14 decoder linears are quantized; embeddings and lm_head stay fp32. "
                f"nf4 runs at the default block size 64 (down_proj's 176 inputs end in a short block of 48) and "
                f"at 16. The bytes per parameter are higher than on the 100M model because the layers are small: "
                f"int8/int4 pay 4/in_features for the per-channel scale (in_features 64 and 176), nf4/fp4 pay 4/bs "
                f"for the block scales (1/bs with double quantization). The relative column is relative to an eval loss "
                f"that is already small (the tiny model fits the advertise data closely), so it looks large."
            )
            text = intro + "\n\n" + tables.table_eval(train, rows)
            print(text + "\n", flush=True)
            md += ["## Part 2: eval-loss change when a trained tiny model is quantized\n", text, ""]

    total = time.time() - t_all
    print(f"total {total:.0f} s", flush=True)
    md.append(f"Total run time {total:.0f} s on a 2-core CPU (shared).\n")
    if args.doc:
        Path(args.doc).write_text("# QLoRA benchmark\n\n" + "\n".join(md))
        print(f"wrote {os.path.relpath(args.doc, REPO)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
