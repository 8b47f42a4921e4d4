"""Benchmark (issue 26 item 1, first part): our whole LoRA fine-tune vs TRL SFTTrainer + PEFT, same model and data.

    .venv/bin/python bench/e2e.py [--steps 5] [--repeats 2] [--scratch build/bench_e2e] [--trl-python PY] [--json F]

Both toolkits train the same random 0.26B Llama (``bench/cpu_setup.py``'s: hidden 1024, intermediate 2816,
16 layers, Llama-2 tokenizer, built with PaddleNLP and saved once more in the Hugging Face layout for
transformers: names ``llama.*`` -> ``model.*``, Linear weights transposed), on the same alpaca {src, tgt}
rows (TRL: prompt-completion rows, loss on the completion only, as ours), with LoRA r8 / alpha 16 on
every decoder linear, lr 1e-4 linear decay, no warm-up, max_length 1024, batch 1 x accumulation 4,
``--steps`` optimizer steps, fp32, no packing, in separate processes, interleaved (ours, TRL, ours, TRL).
Ours runs as a user runs it (``llm/run_finetune.py`` with its CPU set-up); TRL with torch's default
threads.

TRL runs in its own venv (``SCRATCH/venv-trl``: ``python3 -m venv`` + ``pip install torch==2.13.0
transformers peft trl sentencepiece protobuf``; ``--trl-python`` names an interpreter that has them).
When it cannot be set up the TRL column is skipped with the reason.  Not here yet: PaddleNLP's own
``llm/run_finetune.py`` column, packing, QLoRA and DPO (issue 26 item 1).

Printed: supervised tokens/s (supervised tokens over the training time), median step time (steps
2..N), peak RSS, CPU% during the steps, final loss; the means and the ours/TRL ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from cpu_setup import MODEL_SHAPE, ROOT, TOKENIZER_MODEL, ensure_data, ensure_model, fmt, mean, run_once  # noqa: E402

TRL_WORKER = os.path.join(HERE, "e2e_trl.py")
TRL_PACKAGES = ["torch==2.13.0", "transformers", "peft", "trl", "sentencepiece", "protobuf"]
TRL_CHECK = "import torch, transformers, peft, trl, sentencepiece; print(trl.__version__)"
STEPS_DEFAULT, RANK, ALPHA, LR, MAX_LENGTH, ACCUMULATION = 5, 8, 16, 1e-4, 1024, 4


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
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, **MODEL_SHAPE}
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
        r = subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", venv],
                           capture_output=True, text=True)
        if r.returncode == 0:
            r = subprocess.run([py, "-m", "pip", "install", "-q", *TRL_PACKAGES], capture_output=True, text=True)
        if r.returncode != 0:
            return None, "venv set-up failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    if not os.path.exists(py):
        return None, f"{py} does not exist"
    r = subprocess.run([py, "-c", TRL_CHECK], capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"{py} cannot import torch/transformers/peft/trl: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return py, None


def run_trl(py: str, hf_dir: str, data_dir: str, out_dir: str, steps: int) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    spec = {"model": hf_dir, "train": os.path.join(data_dir, "train.json"), "out": out_dir, "steps": steps,
            "accumulation": ACCUMULATION, "lr": LR, "max_length": MAX_LENGTH, "rank": RANK, "alpha": ALPHA}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    r = subprocess.run([py, TRL_WORKER, json.dumps(spec)], capture_output=True, text=True, cwd=out_dir, env=env)
    if r.returncode != 0:
        sys.exit("TRL run failed:\n" + r.stdout[-2000:] + r.stderr[-4000:])
    with open(os.path.join(out_dir, "result.json")) as f:
        res = json.load(f)
    steady = res["step_times_s"] or [res["train_time_s"] / steps]
    return {"toolkit": f"TRL + PEFT ({res['torch_threads']} torch threads)", "sup_tok_s":
            res["supervised_tokens"] / res["train_time_s"], "step_s": statistics.median(steady),
            "peak_rss_gib": res["peak_rss_bytes"] / 2 ** 30, "cpu_pct": res["cpu_pct"], "final_loss": res["losses"][-1],
            "losses": res["losses"], "versions": res["versions"]}


def table(runs) -> str:
    lines = ["| toolkit | runs | supervised tok/s | step time | peak RSS | CPU% in steps | final loss |",
             "|---|---|---|---|---|---|---|"]
    names = list(dict.fromkeys(r["toolkit"] for r in runs))
    for name in names:
        rows = [r for r in runs if r["toolkit"] == name]
        lines.append(f"| {name} | {len(rows)} | {mean(rows, 'sup_tok_s'):.1f} "
                     f"({', '.join(format(r['sup_tok_s'], '.1f') for r in rows)}) | {mean(rows, 'step_s'):.2f} s "
                     f"| {mean(rows, 'peak_rss_gib'):.2f} GiB | {fmt(mean(rows, 'cpu_pct'), '.0f')}% "
                     f"| {mean(rows, 'final_loss'):.4f} |")
    if len(names) == 2:
        a = [r for r in runs if r["toolkit"] == names[0]]
        b = [r for r in runs if r["toolkit"] == names[1]]
        lines.append(f"| ours / TRL | | {mean(a, 'sup_tok_s') / mean(b, 'sup_tok_s'):.2f}x "
                     f"| {mean(a, 'step_s') / mean(b, 'step_s'):.2f}x "
                     f"| {mean(a, 'peak_rss_gib') / mean(b, 'peak_rss_gib'):.2f}x | | |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=STEPS_DEFAULT)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scratch", default=os.path.join(ROOT, "build", "bench_e2e"))
    p.add_argument("--trl-python", help="an interpreter with torch, transformers, peft and trl (default: a venv "
                                        "made in the scratch dir)")
    p.add_argument("--json", help="write the runs here")
    a = p.parse_args(argv)
    model_dir = os.path.join(a.scratch, "llama-0.25b")
    info = ensure_model(model_dir)
    data_dir = ensure_data(a.scratch)
    py, why_not = trl_python(a.scratch, a.trl_python)
    hf_dir = hf_copy(model_dir, os.path.join(a.scratch, "llama-0.25b-hf")) if py else None
    print(f"model {model_dir} ({info['params']:,} parameters), data {data_dir}, {a.steps} steps of 1 x "
          f"{ACCUMULATION} at max_length {MAX_LENGTH}, LoRA r{RANK}/{ALPHA}, fp32"
          + ("" if py else f"\nTRL column skipped: {why_not}"), flush=True)
    runs = []
    for i in range(a.repeats):
        t0 = time.time()
        r = run_once("on", model_dir, data_dir, os.path.join(a.scratch, f"ours_{i}"), a.steps)
        r["toolkit"] = "ours (llm/run_finetune.py)"
        runs.append(r)
        print(f"  ours #{i + 1}: {r['sup_tok_s']:.1f} supervised tok/s, step {r['step_s']:.2f} s, CPU "
              f"{fmt(r['cpu_pct'], '.0f')}%, loss {r['final_loss']:.4f} ({time.time() - t0:.0f} s)", flush=True)
        if py:
            t0 = time.time()
            r = run_trl(py, hf_dir, data_dir, os.path.join(a.scratch, f"trl_{i}"), a.steps)
            runs.append(r)
            print(f"  TRL #{i + 1}: {r['sup_tok_s']:.1f} supervised tok/s, step {r['step_s']:.2f} s, CPU "
                  f"{fmt(r['cpu_pct'], '.0f')}%, loss {r['final_loss']:.4f} ({time.time() - t0:.0f} s)", flush=True)
    print()
    print(table(runs))
    if py:
        print("TRL side:", runs[1]["versions"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "steps": a.steps, "trl_skipped": why_not}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
