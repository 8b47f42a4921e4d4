"""PaddleNLP's shipped SFT-family argument files, run through our real CLI on tiny models.

The shapes below are written from the key lists of PaddleNLP's llm/config/llama/{sft,lora,qlora,vera,
wint8_lora,pt,lokr}_argument.json, llm/config/qwen/{sft,lora}_argument.json and
llm/config/llama/flashmask/{sft,lora}.json (values as shipped).  A migrating user overrides only the
model and data paths, output_dir, step counts, lengths and GPU precision (no GPU here); the flashmask
configs also set tensor_parallel_degree 1, since tensor parallel needs one process per rank and CUDA
(config.environment refuses it in a single process with the launch command to use).
Each run must train, log eval_accuracy (metric_for_best_model "accuracy"), reload the best checkpoint
when load_best_model_at_end asks, and leave complete final weights/adapter in output_dir.
docs/compat.md lists the outcomes.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT

# end-to-end through the CLI: `make test-slow` (CI runs it after `make test`)
pytestmark = pytest.mark.slow

CLI = os.path.join(ROOT, "llm", "run_finetune.py")

_COMMON = {
    "model_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "dataset_name_or_path": "./data",
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 4,
    "per_device_eval_batch_size": 8,
    "eval_accumulation_steps": 16,
    "num_train_epochs": 3,
    "learning_rate": 3e-04,
    "warmup_steps": 30,
    "logging_steps": 1,
    "evaluation_strategy": "epoch",
    "save_strategy": "epoch",
    "src_length": 1024,
    "max_length": 2048,
    "bf16": True,
    "fp16_opt_level": "O2",
    "do_train": True,
    "do_eval": True,
    "disable_tqdm": True,
    "load_best_model_at_end": True,
    "eval_with_do_generation": False,
    "metric_for_best_model": "accuracy",
    "recompute": True,
    "save_total_limit": 1,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
    "zero_padding": False,
    "use_flash_attention": False,
}
_FLASHMASK = {
    **_COMMON,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 4,
    "per_device_eval_batch_size": 1,
    "max_steps": 12000,
    "warmup_ratio": 0.03,
    "evaluation_strategy": "no",
    "save_strategy": "no",
    "src_length": 8000,
    "max_length": 8192,
    "do_eval": False,
    "recompute": False,
    "tensor_parallel_degree": 2,
    "pipeline_parallel_config": "disable_p2p_cache_shape",
    "zero_padding": True,
    "unified_checkpoint": True,
    "tensor_parallel_output": True,
    "use_flash_attention": True,
    "greedy_zero_padding": True,
    "lazy": True,
    "flash_mask": True,
}
_FLASHMASK.pop("warmup_steps")
PADDLENLP_CONFIGS = {
    "llama/sft": {
        **_COMMON,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "learning_rate": 3e-05,
        "recompute": False,
        "pipeline_parallel_config": "disable_p2p_cache_shape",
        "sharding": "stage2",
        "unified_checkpoint": True,
    },
    "llama/lora": {
        **_COMMON,
        "sharding": "stage1",
        "lora": True,
        "lora_rank": 8,
        "use_flash_attention": True,
        "flash_mask": False,
        "metric_for_best_model": "loss",
        "greater_is_better": False,
    },
    "llama/qlora": {**_COMMON, "lora": True, "unified_checkpoint": True, "weight_quantize_algo": "nf4"},
    "llama/wint8_lora": {
        **_COMMON,
        "lora": True,
        "unified_checkpoint": True,
        "weight_quantize_algo": "weight_only_int8",
    },
    "llama/vera": {
        **_COMMON,
        "model_name_or_path": "facebook/llama-7b",
        "num_train_epochs": 1,
        "bf16": False,
        "fp16": True,
        "save_total_limit": 10,
        "vera": True,
    },
    "llama/pt": {**_COMMON, "learning_rate": 3e-02, "prefix_tuning": True, "use_flash_attention": True},
    "llama/lokr": {
        **_COMMON,
        "lokr": True,
        "num_train_epochs": 1,
        "learning_rate": 2e-05,
        "lr_scheduler_type": "linear",
        "attention_probs_dropout_prob": 0,
        "hidden_dropout_prob": 0,
        "evaluation_strategy": "no",
        "save_strategy": "steps",
        "save_steps": 500,
        "src_length": 512,
        "max_length": 512,
        "do_eval": False,
        "disable_tqdm": False,
        "load_best_model_at_end": False,
        "recompute": False,
        "save_total_limit": 100,
        "sharding": "stage2",
        "unified_checkpoint": True,
    },
    "qwen/sft": {
        **_COMMON,
        "model_name_or_path": "Qwen/Qwen2-7B",
        "per_device_train_batch_size": 1,
        "learning_rate": 3e-05,
        "sharding": "stage2",
        "unified_checkpoint": True,
        "use_flash_attention": True,
    },
    "qwen/lora": {
        **_COMMON,
        "model_name_or_path": "Qwen/Qwen2-7B",
        "tensor_parallel_degree": 4,
        "lora": True,
        "unified_checkpoint": True,
        "use_flash_attention": True,
        "pissa": False,
    },
    "llama/flashmask/sft": {**_FLASHMASK, "learning_rate": 2e-05, "sharding": "stage2"},
    "llama/flashmask/lora": {
        **_FLASHMASK,
        "learning_rate": 2e-04,
        "sharding": "stage1",
        "benchmark": True,
        "lora": True,
    },
}
_ = (
    PADDLENLP_CONFIGS["llama/lokr"].pop("per_device_eval_batch_size"),
    PADDLENLP_CONFIGS["llama/lokr"].pop("eval_accumulation_steps"),
)

#: what a user on this CPU machine changes besides paths, steps and lengths
EXTRA_OVERRIDES = {
    "qwen/lora": ["--tensor_parallel_degree", "1"],
    "llama/flashmask/sft": ["--tensor_parallel_degree", "1"],
    "llama/flashmask/lora": ["--tensor_parallel_degree", "1"],
}
ADAPTER_FILES = {
    "lora": "adapter_model.safetensors",
    "vera": "adapter_model.safetensors",
    "lokr": "adapter_model.safetensors",
}


def method_of(cfg):
    for key in ("lora", "vera", "lokr", "prefix_tuning"):
        if cfg.get(key):
            return key
    return "full"


def run(name, cfg, model_dir, tmp_path):
    src = tmp_path / "paddlenlp_config.json"
    src.write_text(json.dumps(cfg, indent=4))
    out = tmp_path / "out"
    steps = ["--max_steps", "6", "--num_train_epochs", "1", "--warmup_steps", "1", "--logging_steps", "1"]
    if cfg.get("do_eval") and cfg.get("evaluation_strategy") != "no":
        steps += [
            "--evaluation_strategy",
            "steps",
            "--save_strategy",
            "steps",
            "--eval_steps",
            "3",
            "--save_steps",
            "3",
        ]
    elif cfg.get("save_strategy") == "steps":
        steps += ["--save_steps", "3"]
    if cfg.get("warmup_ratio"):
        steps += ["--warmup_ratio", "0.1"]
    cmd = [
        sys.executable,
        CLI,
        str(src),
        "--model_name_or_path",
        model_dir,
        "--dataset_name_or_path",
        DATA_DIR,
        "--output_dir",
        str(out),
        "--src_length",
        "64",
        "--max_length",
        "128",
        "--bf16",
        "false",
        "--fp16",
        "false",
        "--per_device_train_batch_size",
        "2",
        *steps,
        *EXTRA_OVERRIDES.get(name, []),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, f"{name}:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r, out


@pytest.mark.parametrize("name", sorted(PADDLENLP_CONFIGS))
def test_paddlenlp_shipped_config_runs(name, tiny_model_dir, tiny_qwen2_dir, tmp_path):
    cfg = PADDLENLP_CONFIGS[name]
    model_dir = tiny_qwen2_dir if name.startswith("qwen/") else tiny_model_dir
    r, out = run(name, cfg, model_dir, tmp_path)
    state = json.loads((out / "trainer_state.json").read_text())
    history = state["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) >= 3 and all(l == l for l in losses), losses  # trained, no NaN
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["method"].split(" ")[0].startswith(method_of(cfg)[:4]) or method_of(cfg) == "full"

    evaluates = cfg.get("do_eval") and not cfg.get("benchmark")
    if evaluates:
        evals = [h for h in history if "eval_accuracy" in h]
        assert evals and all(0.0 <= h["eval_accuracy"] <= 1.0 for h in evals)
        final = json.loads((out / "eval_results.json").read_text())
        assert "eval_accuracy" in final
        if cfg.get("load_best_model_at_end"):
            best = state["best_model_checkpoint"]
            assert best and "Loading best model from" in r.stdout + r.stderr
            best_step = int(best.rsplit("-", 1)[1])
            at_best = [h for h in evals if h["step"] == best_step][-1]
            # the final evaluation is of the reloaded best weights
            assert final["eval_loss"] == pytest.approx(at_best["eval_loss"], rel=1e-5, abs=1e-6)
            assert final["eval_accuracy"] == pytest.approx(at_best["eval_accuracy"], abs=1e-9)
    else:
        assert not (out / "eval_results.json").exists()

    method = method_of(cfg)
    files = set(os.listdir(out))
    if method in ADAPTER_FILES:
        assert ADAPTER_FILES[method] in files and "adapter_config.json" in files, files
        assert not any(f.startswith("model") and f.endswith((".safetensors", ".pdparams")) for f in files), files
    elif method == "prefix_tuning":
        assert "prefix_config.json" in files and any(f.startswith("prefix_model_state") for f in files), files
    else:
        assert any(f.startswith("model") and f.endswith((".safetensors", ".pdparams")) for f in files), files
    assert not [f for f in files if f.startswith(".saving-")], files  # no staging leftovers


_DPO = {
    "model_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "train_dataset_path": "./data/train.jsonl",
    "dev_dataset_path": "./data/dev.jsonl",
    "output_dir": "./checkpoints/dpo_ckpts",
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "per_device_eval_batch_size": 1,
    "num_train_epochs": 1,
    "max_steps": 100,
    "learning_rate": 1e-06,
    "warmup_steps": 10,
    "logging_steps": 1,
    "evaluation_strategy": "steps",
    "save_strategy": "steps",
    "eval_steps": 100,
    "save_steps": 500,
    "max_seq_len": 4096,
    "max_prompt_len": 2048,
    "bf16": True,
    "fp16_opt_level": "O2",
    "do_train": True,
    "do_eval": True,
    "disable_tqdm": True,
    "load_best_model_at_end": True,
    "tensor_parallel_degree": 8,
    "sharding": "stage1",
    "use_flash_attention": True,
    "flash_mask": True,
    "recompute": False,
    "recompute_granularity": "full",
    "beta": 0.1,
    "benchmark": False,
    "loss_type": "sigmoid",
    "label_smoothing": 0.0,
    "unified_checkpoint": True,
    "autotuner_benchmark": False,
    "lazy": False,
    "seed": 42,
}
PADDLENLP_DPO_CONFIGS = {
    "llama/dpo": _DPO,
    "llama/dpo_lora": {
        **_DPO,
        "learning_rate": 1e-05,
        "tensor_parallel_degree": 1,
        "lora": True,
        "lora_rank": 64,
        "rslora_plus": True,
    },
    "llama/flashmask/dpo": {
        "model_name_or_path": "meta-llama/Meta-Llama-3.1-8B-Instruct",
        "train_dataset_path": "dpo_data/uf.jsonl",
        "output_dir": "./checkpoints/dpo_ckpts_flashmask",
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "per_device_eval_batch_size": 1,
        "num_train_epochs": 1,
        "max_steps": 4000,
        "learning_rate": 5e-07,
        "warmup_ratio": 0.1,
        "logging_steps": 1,
        "evaluation_strategy": "no",
        "save_strategy": "no",
        "eval_steps": 100,
        "save_steps": 500,
        "max_seq_len": 8192,
        "max_prompt_len": 8000,
        "bf16": True,
        "fp16_opt_level": "O2",
        "do_train": True,
        "do_eval": False,
        "disable_tqdm": True,
        "load_best_model_at_end": True,
        "tensor_parallel_degree": 4,
        "sharding": "stage2",
        "use_flash_attention": True,
        "recompute": False,
        "recompute_granularity": "full",
        "unified_checkpoint": True,
        "autotuner_benchmark": False,
        "greedy_zero_padding": True,
        "flash_mask": True,
        "lazy": True,
    },
}


@pytest.mark.parametrize("name", sorted(PADDLENLP_DPO_CONFIGS))
def test_paddlenlp_shipped_dpo_config_runs(name, tiny_model_dir, tmp_path):
    """PaddleNLP's DPO argument files through llm/run_dpo.py: paths, steps, lengths, bf16 off and
    tensor_parallel_degree 1 overridden (as for the SFT files above)."""
    cfg = PADDLENLP_DPO_CONFIGS[name]
    src = tmp_path / "paddlenlp_dpo_config.json"
    src.write_text(json.dumps(cfg, indent=4))
    out = tmp_path / "out"
    data = os.path.join(ROOT, "llm", "data", "dpo_tiny")
    steps = [
        "--max_steps",
        "6",
        "--warmup_steps",
        "1",
        "--gradient_accumulation_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
    ]
    if cfg.get("evaluation_strategy") == "steps":
        steps += ["--eval_steps", "3", "--save_steps", "3"]
    if cfg.get("warmup_ratio"):
        steps += ["--warmup_ratio", "0.1"]
    cmd = [
        sys.executable,
        os.path.join(ROOT, "llm", "run_dpo.py"),
        str(src),
        "--model_name_or_path",
        tiny_model_dir,
        "--train_dataset_path",
        data,
        "--output_dir",
        str(out),
        "--max_seq_len",
        "256",
        "--max_prompt_len",
        "128",
        "--bf16",
        "false",
        "--tensor_parallel_degree",
        "1",
        "--learning_rate",
        "1e-3",
        *steps,
    ]
    if cfg.get("dev_dataset_path"):
        cmd += ["--dev_dataset_path", data]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, f"{name}:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) >= 6 and abs(losses[0] - math.log(2)) < 1e-4  # policy == reference at step 1
    files = set(os.listdir(out))
    if cfg.get("lora"):
        assert "adapter_model.safetensors" in files, files
    else:
        assert any(f.startswith("model") and f.endswith(".safetensors") for f in files), files
    if cfg.get("do_eval"):
        final = json.loads((out / "eval_results.json").read_text())
        assert "eval_rewards/accuracies" in final
        best = state["best_model_checkpoint"]
        at_best = [h for h in state["log_history"] if "eval_loss" in h and h["step"] == int(best.rsplit("-", 1)[1])]
        assert final["eval_loss"] == pytest.approx(at_best[-1]["eval_loss"], rel=1e-5)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["data"]["train"]["packing"] != "none"  # PaddleNLP's DPO always packs
