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
import json
import os
import re
import shutil
import statistics
import sys
import time

import numpy as np

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402
from bench.cpu_setup import (  # noqa: E402
    CODE_PATH_VARS, MODEL_SHAPE, ROOT, SWITCH, THREAD_VARS, TOKENIZER_MODEL, ensure_data, ensure_model, run_once,
)
from bench.dpo import convert_dpo_demo  # noqa: E402
from bench.ernie_shape import ERNIE_SHAPE, ensure_ernie  # noqa: E402
from bench.flops import DECODER_LINEARS, achieved  # noqa: E402
from bench.guard import GuardTableError, append_rows, compare, parse_baselines, record_rows, report  # noqa: E402
from bench.limits import data_stats, flops_per_supervised_token, load_peak, measure_peak, model_spm  # noqa: E402
from bench.peak import this_cpu  # noqa: E402

fmt, mean = h.fmt, h.mean
DPO_CLI = os.path.join(ROOT, "llm", "run_dpo.py")
DPO_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "dpo_lora_argument.json")
TRL_PACKAGES = ["torch==2.13.0", "transformers", "peft", "trl", "sentencepiece", "protobuf"]
TRL_CHECK = "import torch, transformers, peft, trl, sentencepiece; print(trl.__version__)"
STEPS_DEFAULT, RANK, ALPHA, LR, MAX_LENGTH, ACCUMULATION = 10, 8, 16, 1e-4, 1024, 4
CASES = ("lora", "packed", "qlora", "dpo", "lora_b4", "packed_b4")
SHAPES = {"0.25b": MODEL_SHAPE, "0.8b": dict(MODEL_SHAPE, hidden_size=2048, intermediate_size=5504, num_hidden_layers=14),
          "ernie": ERNIE_SHAPE}
SEED = 42  # ours' --seed (bench/cpu_setup.py), hence its example order
BATCH4 = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"]
OURS_ARGS = {"lora": [], "qlora": ["--weight_quantize_algo", "nf4"],
             "packed": ["--zero_padding", "true", "--greedy_zero_padding", "true", "--use_flash_attention", "true",
                        "--flash_mask", "true"]}
OURS_ARGS.update(lora_b4=BATCH4, packed_b4=OURS_ARGS["packed"] + BATCH4)
PADDLENLP_STEP = re.compile(r"loss: ([0-9.eE+-]+), learning_rate: .*global_step: (\d+), interval_runtime: ([0-9.]+)")


def model_path(scratch: str, model: str) -> str:
    """Where ``--model`` lives in the scratch dir: ``model_path("/s", "0.25b")`` -> ``"/s/llama-0.25b"``,
    ``model_path("/s", "ernie")`` -> ``"/s/ernie-0.36b"``."""
    return os.path.join(scratch, "ernie-0.36b" if model == "ernie" else f"llama-{model}")


def hf_copy(paddle_dir: str, hf_dir: str) -> str:
    """The PaddleNLP checkpoint in the Hugging Face layout (done once): renamed, Linear weights transposed.

    ``llama.layers.0.mlp.up_proj.weight`` [1024, 2816] (in, out) -> ``model.layers.0.mlp.up_proj.weight``
    [2816, 1024] (out, in); ``lm_head.weight`` [1024, 32000] -> [32000, 1024]; embeddings and norms as they are.
    """
    from safetensors.numpy import load_file, save_file

    if os.path.isfile(os.path.join(hf_dir, "config.json")):
        return hf_dir
    os.makedirs(hf_dir, exist_ok=True)
    tensors = {}
    for name, value in load_file(os.path.join(paddle_dir, "model.safetensors")).items():
        transposed = value.ndim == 2 and not name.endswith("embed_tokens.weight")
        tensors[name.replace("llama.", "model.", 1)] = np.ascontiguousarray(value.T if transposed else value)
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(paddle_dir, "config.json")) as f:
        src = json.load(f)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
              "vocab_size": src["vocab_size"], "rms_norm_eps": src["rms_norm_eps"], "rope_theta": src["rope_theta"],
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              **{k: src[k] for k in MODEL_SHAPE}}  # the shape of the checkpoint (--model)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    spm = TOKENIZER_MODEL if os.path.isfile(TOKENIZER_MODEL) else os.path.join(paddle_dir, "sentencepiece.bpe.model")
    shutil.copyfile(spm, os.path.join(hf_dir, "tokenizer.model"))
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "pad_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": True}, f, indent=2)
    return hf_dir


def trl_python(scratch: str, given: str | None):
    """(interpreter with torch/transformers/peft/trl, None) or (None, why not)."""
    py = given or os.path.join(scratch, "venv-trl", "bin", "python")
    if not given and not os.path.exists(py):
        venv = os.path.dirname(os.path.dirname(py))
        print(f"setting up {venv} (pip install {' '.join(TRL_PACKAGES)}) ...", flush=True)
        r = h.run([shutil.which("python3") or sys.executable, "-m", "venv", venv], name="venv", mark=None, check=False)
        if r.ok:
            r = h.run([py, "-m", "pip", "install", "-q", *TRL_PACKAGES], name="pip", mark=None, check=False)
        if not r.ok:
            return None, "venv set-up failed: " + r.tail(1)
    if not os.path.exists(py):
        return None, f"{py} does not exist"
    r = h.run([py, "-c", TRL_CHECK], name="TRL check", mark=None, check=False)
    if not r.ok:
        return None, f"{py} cannot import torch/transformers/peft/trl: " + r.tail(1)
    return py, None


def paddlenlp_llm(given: str | None):
    """(PaddleNLP's llm/ dir, None) or (None, why the column is skipped)."""
    d = given or os.environ.get("PADDLENLP_LLM")
    if not d:
        return None, "no --paddlenlp-llm DIR (PaddleNLP's llm/run_finetune.py + llm/utils/ at v3.0.0-beta4)"
    missing = [f for f in ("run_finetune.py", "utils/argument.py", "utils/data.py") if not os.path.isfile(
        os.path.join(d, f))]
    return (None, f"{d} lacks {', '.join(missing)}") if missing else (os.path.abspath(d), None)


def ensure_dpo_data(scratch: str) -> str:
    """dpo_en_demo.json as PaddleNLP preference lines (bench/dpo.py's converter), once."""
    out = os.path.join(scratch, "dpo")
    if not os.path.isfile(os.path.join(out, "train.json")):
        convert_dpo_demo(h.DPO_DEMO, out)
    return out


def dpo_args(model_dir: str, data_dir: str, out_dir: str, steps: int) -> list:
    return ["--model_name_or_path", model_dir, "--train_dataset_path", data_dir, "--dev_dataset_path", data_dir,
            "--output_dir", out_dir, "--overwrite_output_dir", "true", "--max_steps", str(steps),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", str(ACCUMULATION),
            "--learning_rate", str(LR), "--warmup_steps", "0", "--lora_rank", str(RANK), "--lora_alpha", str(ALPHA),
            "--max_seq_len", str(MAX_LENGTH), "--max_prompt_len", str(MAX_LENGTH // 2), "--logging_steps", "1",
            "--do_eval", "false", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "42"]


def trl_spec(hf_dir: str, data_dir: str, out_dir: str, steps: int, packing: bool, targets=None, use_fast=True,
             same_work=False) -> dict:
    """bench/e2e_trl.py's spec.  ``same_work``: no gradient checkpointing (as ours runs) and, unpacked, ours'
    example order (``order_seed``); without it TRL's defaults (checkpointing on, its own shuffle)."""
    spec = {"model": hf_dir, "train": os.path.join(data_dir, "train.json"), "out": out_dir, "steps": steps,
            "accumulation": ACCUMULATION, "lr": LR, "max_length": MAX_LENGTH, "rank": RANK, "alpha": ALPHA,
            "packing": packing, "use_fast": use_fast, **({"target_modules": list(targets)} if targets else {})}
    if same_work:
        spec.update(gradient_checkpointing=False, **({} if packing else {"order_seed": SEED}))
    return spec


def run_trl(py: str, hf_dir: str, data_dir: str, out_dir: str, steps: int, packing: bool, dpo=False,
            targets=None, use_fast=True, same_work=False) -> dict:
    """One TRL + PEFT run (``targets``: PEFT's target_modules, default every Llama decoder linear;
    ``use_fast=False``: transformers' slow SentencePiece tokenizer, for a venv whose protobuf cannot convert it;
    ``same_work``: see :func:`trl_spec`)."""
    os.makedirs(out_dir, exist_ok=True)
    spec = trl_spec(hf_dir, data_dir, out_dir, steps, packing, targets, use_fast, same_work)
    env = h.clean_env(("PYTHONPATH",) + THREAD_VARS + CODE_PATH_VARS)  # torch's default threads
    worker = os.path.join(ROOT, "bench", "e2e_trl_dpo.py" if dpo else "e2e_trl.py")
    r = h.run([py, worker, json.dumps(spec)], name="TRL run", cwd=out_dir, env=env, mark=None)
    with open(os.path.join(out_dir, "result.json")) as f:
        res = json.load(f)
    steady = res["step_times_s"] or [res["train_time_s"] / steps]
    sup = res.get("supervised_tokens")
    return {"toolkit": "TRL + PEFT", "detail": f"{res['torch_threads']} torch threads",
            "sup_tok_s": sup / res["train_time_s"] if sup else None,
            "pairs_s": res["pairs"] / res["train_time_s"] if res.get("pairs") else None,
            "step_s": statistics.median(steady),
            "peak_rss_gib": r.peak_rss_bytes / h.GiB, "cpu_pct": res["cpu_pct"], "final_loss": res["losses"][-1],
            "losses": res["losses"], "versions": res["versions"], "padding": res.get("padding"),
            "tokens": res.get("tokens"), "supervised_tokens": sup,
            "work": None if dpo else (f"gradient checkpointing {'on' if res.get('gradient_checkpointing') else 'off'}, "
                                      f"{'packed' if packing else 'unpacked'}, "
                                      f"order {res.get('order', 'trainer')}")}


def paddlenlp_env(cpu_env: bool) -> dict:
    """Paddle's defaults as a user gets them, or (``cpu_env``) the variables our CPU set-up would set."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", SWITCH) + THREAD_VARS + CODE_PATH_VARS}
    if cpu_env:
        from paddlenlp_ext.cli.cpu_env import setup_cpu

        probe = dict(env)
        setup_cpu(probe)  # decides on a copy: this process's environment stays as it is
        env.update({k: probe[k] for k in THREAD_VARS + CODE_PATH_VARS if k in probe})
    return env


def run_paddlenlp(llm_dir: str, model_dir: str, data_dir: str, out_dir: str, steps: int, packed: bool,
                  cpu_env: bool) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    config = {"model_name_or_path": model_dir, "dataset_name_or_path": data_dir, "output_dir": out_dir,
              "overwrite_output_dir": True, "per_device_train_batch_size": 1,
              "gradient_accumulation_steps": ACCUMULATION, "max_steps": steps, "learning_rate": LR,
              "warmup_steps": 0, "lr_scheduler_type": "linear", "logging_steps": 1, "save_strategy": "no",
              "evaluation_strategy": "no", "src_length": MAX_LENGTH, "max_length": MAX_LENGTH, "do_train": True,
              "do_eval": False, "seed": 42, "lora": True, "lora_rank": RANK, "disable_tqdm": True, "device": "cpu",
              "zero_padding": packed, "greedy_zero_padding": packed}
    cfg_path, result_path = os.path.join(out_dir, "bench_config.json"), os.path.join(out_dir, "bench_result.json")
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    steps_seen = []  # (loss, interval runtime) of PaddleNLP's own step log lines

    def step(line):
        m = PADDLENLP_STEP.search(line)
        if m:
            steps_seen.append((float(m.group(1)), float(m.group(3))))

    r = h.run(h.cli("bench/e2e_paddlenlp.py", llm_dir, cfg_path, result_path), name="PaddleNLP run", cwd=out_dir,
              env=paddlenlp_env(cpu_env), mark=PADDLENLP_STEP, on_line=step)
    with open(result_path) as f:
        res = json.load(f)
    with open(os.path.join(out_dir, "train_results.json")) as f:
        train_time = json.load(f)["train_runtime"]
    step_times = [t for _, t in steps_seen]
    return {"toolkit": "PaddleNLP 3.0.0b4", "detail": "our CPU env" if cpu_env else "Paddle's defaults",
            "sup_tok_s": res["supervised_tokens"] / train_time, "step_s": statistics.median(step_times[1:] or step_times),
            "peak_rss_gib": r.peak_rss_bytes / h.GiB, "cpu_pct": r.cpu_pct, "final_loss": steps_seen[-1][0],
            "losses": [x for x, _ in steps_seen], "padding": None}


def table(runs, case) -> list:
    rows = [r for r in runs if r["case"] == case]
    names = list(dict.fromkeys(r["toolkit"] for r in rows))
    key = "pairs_s" if case == "dpo" else "sup_tok_s"
    head = ["toolkit", "runs", "pairs/s" if case == "dpo" else "supervised tok/s", "GFLOP/s (of peak)", "step time",
            "peak RSS", "CPU% in steps", "padding", "final loss"]
    body = []
    for name in names:
        rs = [r for r in rows if r["toolkit"] == name]
        pad, of_peak = mean(rs, "padding"), mean(rs, "of_peak")
        body.append([f"{name} ({rs[0]['detail']})", len(rs),
                     f"{mean(rs, key):.2f} ({', '.join(format(r[key], '.2f') for r in rs)})",
                     fmt(mean(rs, "gflops"), ".1f") + ("" if of_peak is None else f" ({of_peak:.0%})"),
                     f"{mean(rs, 'step_s'):.2f} s", f"{mean(rs, 'peak_rss_gib'):.2f} GiB",
                     f"{fmt(mean(rs, 'cpu_pct'), '.0f')}%", "-" if pad is None else format(pad, ".1%"),
                     f"{mean(rs, 'final_loss'):.4f}"])
    ours = {k: mean([r for r in rows if r["toolkit"].startswith("ours")], k) for k in (key, "step_s", "peak_rss_gib")}
    for name in names:
        other = [r for r in rows if r["toolkit"] == name]
        if ours[key] is not None and not name.startswith("ours"):
            base = {k: mean(other, k) for k in ours}
            cells = h.ratio_cells(ours, base, list(ours))
            body.append([f"ours / {name}", "", cells[0], "", *cells[1:], "", "", ""])
    return [f"### {case}", "", h.table(head, body)]


def ratios_across(runs) -> list:
    """packed / unpacked and qlora / lora supervised tok/s per toolkit, where both ran."""
    out = []
    for num, den in (("packed", "lora"), ("qlora", "lora"), ("packed_b4", "lora_b4")):
        for name in dict.fromkeys(r["toolkit"] for r in runs):
            a = [r for r in runs if r["toolkit"] == name and r["case"] == num]
            b = [r for r in runs if r["toolkit"] == name and r["case"] == den]
            if a and b:
                out.append(f"{num} / {den}, {name}: {mean(a, 'sup_tok_s') / mean(b, 'sup_tok_s'):.2f}x supervised "
                           f"tok/s, {mean(a, 'peak_rss_gib') / mean(b, 'peak_rss_gib'):.2f}x peak RSS")
    return out


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
    per_sup = {} if stats is None else {c: flops_per_supervised_token(shape, info["vocab"], stats, RANK)
                                         for c in CASES if c != "dpo"}
    print(f"CPU: {cpu['model']}, ISA {cpu['isa']} ({' '.join(cpu['flags']) or '-'}); load average "
          f"{os.getloadavg()[0]:.2f}; matmul peak {fmt(peak and peak['peak_gflops'], '.1f')} GFLOP/s", flush=True)
    return {"cpu": cpu, "peak": peak, "peak_flops": peak["peak_gflops"] * 1e9 if peak else None, "stats": stats,
            "per_sup_token": per_sup}


def limit_lines(limit: dict, runs: list) -> str:
    """How the FLOP/s column is counted, and ours' measured supervised fraction against the data's."""
    stats = limit["stats"]
    if not stats:
        return "GFLOP/s: not counted (no SentencePiece model in the model directory)"
    ours = [r["supervised_fraction"] for r in runs if r.get("supervised_fraction")]
    per = next(iter(limit["per_sup_token"].values()))
    return (f"GFLOP/s: {per / 1e9:.3f} GFLOP per supervised token (bench/flops.py: matmuls only, mean causal "
            f"context {stats['context']:.0f} tokens, supervised fraction {stats['supervised_fraction']:.3f} of the "
            f"data" + (f", ours measured {sum(ours) / len(ours):.3f}" if ours else "") + "); peak: "
            + (f"{limit['peak']['peak_gflops']:.1f} GFLOP/s fp32 matmul (bench/peak.py, {limit['peak']['date']})"
               if limit["peak"] else "not measured"))


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
    rows = record_rows(now, cpu["isa"], time.strftime("%Y-%m-%d", time.gmtime()), git.output.strip() if git.ok else "-",
                       f"load average {os.getloadavg()[0]:.1f}", "bench.e2e --quick")
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
    p.add_argument("--packed-steps", type=int, help="optimizer steps of the packed case (default --steps): its "
                                                     "steps hold ~5x the examples")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scratch", default=os.path.join(ROOT, "build", "bench_e2e"))
    p.add_argument("--model", choices=sorted(SHAPES), default="0.25b",
                   help="0.25b: the end-to-end benchmark's model; 0.8b: hidden 2048 / intermediate 5504 / 14 layers "
                        "(839M parameters, bench/big_model.py's shape); ernie: the ERNIE-4.5-shaped 0.36B "
                        "Ernie4_5ForCausalLM of bench/ernie_shape.py (transformers layout; no PaddleNLP column; "
                        "TRL in this interpreter unless --trl-python)")
    p.add_argument("--paddlenlp-llm", help="PaddleNLP's llm/ dir (run_finetune.py + utils/) at v3.0.0-beta4")
    p.add_argument("--paddlenlp-cpu-env", action="store_true", help="give PaddleNLP our CPU set-up's variables")
    p.add_argument("--trl-python", help="an interpreter with torch, transformers, peft and trl (default: "
                   "SCRATCH/venv-trl, set up when absent; --model ernie: this interpreter)")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--peak-json", help="bench/peak.py's --json of this machine, instead of measuring the peak")
    p.add_argument("--no-peak", action="store_true", help="no matmul peak measurement (no fraction of peak)")
    p.add_argument("--quick", action="store_true", help="the regression guard: ours only, lora and packed, 2 steps, "
                   "1 repeat, no peak; compared with the figures recorded in docs/benchmarks.md for this ISA")
    p.add_argument("--tolerance", type=float, default=0.15, help="--quick: a slowdown (or more peak RSS) beyond "
                   "this fraction is flagged (default 0.15)")
    p.add_argument("--fail-on-slowdown", action="store_true", help="--quick: exit 1 when a case is flagged")
    p.add_argument("--record", action="store_true", help="--quick: add this run's figures to docs/benchmarks.md "
                   "as the last recorded ones of this ISA")
    a = p.parse_args(argv)
    if a.quick:
        fixed = {"--cases": a.cases != "lora,packed", "--toolkits": a.toolkits != "ours,paddlenlp,trl",
                 "--steps": a.steps != STEPS_DEFAULT, "--packed-steps": a.packed_steps is not None,
                 "--repeats": a.repeats != 2, "--model": a.model != "0.25b"}
        if any(fixed.values()):  # the recorded figures are of exactly this run
            p.error(f"--quick runs ours on the 0.25b model, lora and packed, 2 steps, once (the recorded figures' "
                    f"run): drop {', '.join(k for k, v in fixed.items() if v)}")
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
    hf_dir = (model_dir if ernie else hf_copy(model_dir, os.path.join(a.scratch, f"llama-{a.model}-hf"))) if py else None
    limit = machine_limit(a, info, data_dir)
    load = os.getloadavg()
    print(f"model {model_dir} ({info['params']:,} parameters), data {data_dir}, {a.steps} steps of 1 x "
          f"{ACCUMULATION} (cases *_b4: 4 x 1) at max_length {MAX_LENGTH}, LoRA r{RANK}/{ALPHA} on "
          f"{'/'.join(DECODER_LINEARS)}, fp32, cases {cases}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"on {os.cpu_count()} CPUs", flush=True)
    if py:
        print("same work, ours and TRL: no gradient checkpointing on either side; unpacked cases: TRL takes "
              f"ours' example order (seed {SEED}), the same 4 examples per optimizer step; packed cases: both "
              "pack (ours greedy zero padding, TRL packing=True); processed / supervised tokens per run below",
              flush=True)
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
                r = run_once("on", model_dir, dpo_dir, out_dir, steps, cli=DPO_CLI, config=DPO_CONFIG,
                             args=dpo_args(model_dir, dpo_dir, out_dir, steps))
                r.update(toolkit="ours", detail="llm/run_dpo.py")
            elif who == "ours":
                r = run_once("on", model_dir, data_dir, out_dir, steps, OURS_ARGS[case])
                r.update(toolkit="ours", detail="llm/run_finetune.py" + (", nf4" if case == "qlora" else ""),
                         supervised_fraction=r["summary"].get("supervised_token_fraction"),
                         tokens=r["summary"].get("tokens_trained"))
            elif who == "paddlenlp":
                r = run_paddlenlp(llm_dir, model_dir, data_dir, out_dir, steps, case == "packed",
                                  a.paddlenlp_cpu_env)
            else:
                r = run_trl(py, hf_dir, dpo_dir if case == "dpo" else data_dir, out_dir, steps, case == "packed",
                            dpo=case == "dpo", use_fast=not ernie, same_work=case != "dpo")
                # ernie: transformers' slow tokenizer over the same SentencePiece model ours reads (the fast
                # conversion needs protobuf, which the shared venv lacks)
            r.update(case=case, repeat=i, **achieved(r.get("sup_tok_s"), limit["per_sup_token"].get(case),
                                                     limit["peak_flops"]))
            runs.append({k: v for k, v in r.items() if k != "summary"})
            speed = f"{r['pairs_s']:.2f} pairs/s" if case == "dpo" else f"{r['sup_tok_s']:.1f} supervised tok/s"
            print(f"  {case} {r['toolkit']} #{i + 1}: {speed}, step {r['step_s']:.2f} s, "
                  f"RSS {r['peak_rss_gib']:.2f} GiB, CPU {fmt(r['cpu_pct'], '.0f')}%, loss {r['final_loss']:.4f}, "
                  f"tokens {fmt(r.get('tokens'), '.0f')} (supervised {fmt(r.get('supervised_tokens'), '.0f')})"
                  + (f", {r['work']}" if r.get("work") else "")
                  + f" ({time.time() - t0:.0f} s, load {os.getloadavg()[0]:.2f})", flush=True)
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
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "steps": a.steps, "trl_skipped": trl_why, "paddlenlp_skipped": pn_why,
                       "cpu": limit["cpu"], "peak": limit["peak"], "data": limit["stats"],
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=2)
    return quick_guard(a, runs, limit["cpu"]) if a.quick else 0


if __name__ == "__main__":
    sys.exit(main())
