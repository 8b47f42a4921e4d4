"""The settings every toolkit of ``bench/e2e.py`` trains with, and the runs of the other two toolkits:
PaddleNLP's own ``llm/run_finetune.py`` (through ``bench/e2e_paddlenlp.py``) and TRL + PEFT in their venv
(through ``bench/e2e_trl.py`` / ``bench/e2e_trl_dpo.py``), each in its own process through the harness.
What is compared and how: ``bench/e2e.py``'s docstring.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys

import numpy as np

from bench import harness as h
from bench.cpu_setup import CODE_PATH_VARS, MODEL_SHAPE, ROOT, SWITCH, THREAD_VARS, TOKENIZER_MODEL
from bench.ernie_shape import TOKENIZER_CONFIG

RANK, ALPHA, LR, MAX_LENGTH, ACCUMULATION = 8, 16, 1e-4, 1024, 4
SEED = 42  # ours' --seed (bench/cpu_setup.py), hence its example order
TRL_PACKAGES = ["torch==2.13.0", "transformers", "peft", "trl", "sentencepiece", "protobuf"]
TRL_CHECK = "import torch, transformers, peft, trl, sentencepiece; print(trl.__version__)"
PADDLENLP_STEP = re.compile(r"loss: ([0-9.eE+-]+), learning_rate: .*global_step: (\d+), interval_runtime: ([0-9.]+)")


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
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": src["vocab_size"],
        "rms_norm_eps": src["rms_norm_eps"],
        "rope_theta": src["rope_theta"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        **{k: src[k] for k in MODEL_SHAPE},
    }  # the shape of the checkpoint (--model)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    spm = TOKENIZER_MODEL if os.path.isfile(TOKENIZER_MODEL) else os.path.join(paddle_dir, "sentencepiece.bpe.model")
    shutil.copyfile(spm, os.path.join(hf_dir, "tokenizer.model"))
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump(TOKENIZER_CONFIG, f, indent=2)
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
    missing = [
        f for f in ("run_finetune.py", "utils/argument.py", "utils/data.py") if not os.path.isfile(os.path.join(d, f))
    ]
    return (None, f"{d} lacks {', '.join(missing)}") if missing else (os.path.abspath(d), None)


def trl_spec(
    hf_dir: str, data_dir: str, out_dir: str, steps: int, packing: bool, targets=None, use_fast=True, same_work=False
) -> dict:
    """bench/e2e_trl.py's spec.  ``same_work``: no gradient checkpointing (as ours runs) and, unpacked, ours'
    example order (``order_seed``); without it TRL's defaults (checkpointing on, its own shuffle)."""
    spec = {
        "model": hf_dir,
        "train": os.path.join(data_dir, "train.json"),
        "out": out_dir,
        "steps": steps,
        "accumulation": ACCUMULATION,
        "lr": LR,
        "max_length": MAX_LENGTH,
        "rank": RANK,
        "alpha": ALPHA,
        "packing": packing,
        "use_fast": use_fast,
        **({"target_modules": list(targets)} if targets else {}),
    }
    if same_work:
        spec.update(gradient_checkpointing=False, **({} if packing else {"order_seed": SEED}))
    return spec


def run_trl(
    py: str,
    hf_dir: str,
    data_dir: str,
    out_dir: str,
    steps: int,
    packing: bool,
    dpo=False,
    targets=None,
    use_fast=True,
    same_work=False,
) -> dict:
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
    return {
        "toolkit": "TRL + PEFT",
        "detail": f"{res['torch_threads']} torch threads",
        "sup_tok_s": sup / res["train_time_s"] if sup else None,
        "pairs_s": res["pairs"] / res["train_time_s"] if res.get("pairs") else None,
        "step_s": statistics.median(steady),
        "peak_rss_gib": r.peak_rss_bytes / h.GiB,
        "cpu_pct": res["cpu_pct"],
        "final_loss": res["losses"][-1],
        "losses": res["losses"],
        "versions": res["versions"],
        "padding": res.get("padding"),
        "tokens": res.get("tokens"),
        "supervised_tokens": sup,
        "work": None
        if dpo
        else (
            f"gradient checkpointing {'on' if res.get('gradient_checkpointing') else 'off'}, "
            f"{'packed' if packing else 'unpacked'}, "
            f"order {res.get('order', 'trainer')}"
        ),
    }


def paddlenlp_env(cpu_env: bool) -> dict:
    """Paddle's defaults as a user gets them, or (``cpu_env``) the variables our CPU set-up would set."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", SWITCH) + THREAD_VARS + CODE_PATH_VARS}
    if cpu_env:
        from paddlenlp_ext.runtime.cpu_env import setup_cpu

        probe = dict(env)
        setup_cpu(probe)  # decides on a copy: this process's environment stays as it is
        env.update({k: probe[k] for k in THREAD_VARS + CODE_PATH_VARS if k in probe})
    return env


def run_paddlenlp(
    llm_dir: str, model_dir: str, data_dir: str, out_dir: str, steps: int, packed: bool, cpu_env: bool
) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    config = {
        "model_name_or_path": model_dir,
        "dataset_name_or_path": data_dir,
        "output_dir": out_dir,
        "overwrite_output_dir": True,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": ACCUMULATION,
        "max_steps": steps,
        "learning_rate": LR,
        "warmup_steps": 0,
        "lr_scheduler_type": "linear",
        "logging_steps": 1,
        "save_strategy": "no",
        "evaluation_strategy": "no",
        "src_length": MAX_LENGTH,
        "max_length": MAX_LENGTH,
        "do_train": True,
        "do_eval": False,
        "seed": 42,
        "lora": True,
        "lora_rank": RANK,
        "disable_tqdm": True,
        "device": "cpu",
        "zero_padding": packed,
        "greedy_zero_padding": packed,
    }
    cfg_path, result_path = os.path.join(out_dir, "bench_config.json"), os.path.join(out_dir, "bench_result.json")
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    steps_seen = []  # (loss, interval runtime) of PaddleNLP's own step log lines

    def step(line):
        m = PADDLENLP_STEP.search(line)
        if m:
            steps_seen.append((float(m.group(1)), float(m.group(3))))

    r = h.run(
        h.cli("bench/e2e_paddlenlp.py", llm_dir, cfg_path, result_path),
        name="PaddleNLP run",
        cwd=out_dir,
        env=paddlenlp_env(cpu_env),
        mark=PADDLENLP_STEP,
        on_line=step,
    )
    with open(result_path) as f:
        res = json.load(f)
    with open(os.path.join(out_dir, "train_results.json")) as f:
        train_time = json.load(f)["train_runtime"]
    step_times = [t for _, t in steps_seen]
    return {
        "toolkit": "PaddleNLP 3.0.0b4",
        "detail": "our CPU env" if cpu_env else "Paddle's defaults",
        "sup_tok_s": res["supervised_tokens"] / train_time,
        "step_s": statistics.median(step_times[1:] or step_times),
        "peak_rss_gib": r.peak_rss_bytes / h.GiB,
        "cpu_pct": r.cpu_pct,
        "final_loss": steps_seen[-1][0],
        "losses": [x for x, _ in steps_seen],
        "padding": None,
    }
