"""End-to-end: drive the real CLI for a few steps on the tiny model and check numbers and files."""

import json
import os
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT

CLI = os.path.join(ROOT, "llm", "run_finetune.py")


def run_cli(config, tmp_path, *overrides, name="out", check=True):
    out = tmp_path / name
    cmd = [
        sys.executable,
        CLI,
        os.path.join(ROOT, config),
        "--output_dir",
        str(out),
        "--logging_steps",
        "5",
        "--model_name_or_path",
        os.path.join(ROOT, "build", "tiny-llama"),
        "--dataset_name_or_path",
        DATA_DIR,
        *map(str, overrides),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r, out


def summary(out):
    with open(out / "run_summary.json") as f:
        return json.load(f)


FAST = ("--max_steps", "30", "--per_device_train_batch_size", "8")


def test_full_finetune_writes_everything_and_learns(tiny_model_dir, tmp_path):
    r, out = run_cli("llm/config/tiny/sft_argument.json", tmp_path, *FAST)
    s = summary(out)
    assert s["method"] == "full" and s["trainable_params"] == s["total_params"] > 0
    assert s["eval_loss"] < 0.8 * s["eval_loss_before_train"]
    for key in ("tokens_trained", "supervised_token_fraction", "tokens_per_second", "wall_time_s", "peak_rss_bytes"):
        assert s[key] > 0, key
    assert s["data"]["train"]["examples"] == 2000
    for f in (
        "model.safetensors",
        "config.json",
        "tokenizer_config.json",
        "train_results.json",
        "eval_results.json",
        "trainer_state.json",
        "run_summary.json",
        "resolved_config.json",
    ):
        assert (out / f).exists(), f
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) >= 5 and losses[-1] < losses[0]
    assert "eval_perplexity" in json.loads((out / "eval_results.json").read_text())
    assert "eval loss before training" in r.stdout and "eval loss:" in r.stdout


def test_lora_saves_adapter_only_and_reload_reproduces_eval(tiny_model_dir, tmp_path):
    r, out = run_cli("llm/config/tiny/lora_argument.json", tmp_path, *FAST)
    s = summary(out)
    assert s["method"] == "lora" and 0 < s["trainable_params"] < 0.2 * s["total_params"]
    assert s["eval_loss"] < 0.8 * s["eval_loss_before_train"]
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()
    assert not list(out.glob("model*.safetensors")) and not list(out.glob("*.pdparams"))
    # reload the adapter for eval only: same eval loss
    r2, out2 = run_cli(
        "llm/config/tiny/lora_argument.json",
        tmp_path,
        "--lora_path",
        out,
        "--do_train",
        "false",
        "--eval_before_train",
        "false",
        name="reload",
    )
    s2 = summary(out2)
    assert s2["eval_loss"] == pytest.approx(s["eval_loss"], rel=1e-5)


def test_data_parallel_two_cpu_processes(tiny_model_dir, tmp_path):
    """DP over gloo on CPU: `paddle.distributed.launch --nproc_per_node 2` runs the same CLI."""
    out = tmp_path / "dp"
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--nproc_per_node",
        "2",
        "--log_dir",
        str(tmp_path / "log"),
        CLI,
        os.path.join(ROOT, "llm/config/tiny/lora_argument.json"),
        "--output_dir",
        str(out),
        "--max_steps",
        "12",
        "--per_device_train_batch_size",
        "4",
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name_or_path",
        DATA_DIR,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    logs = "".join(p.read_text() for p in (tmp_path / "log").glob("workerlog.*"))
    assert r.returncode == 0, logs[-6000:]
    s = summary(out)
    assert s["world_size"] == 2 and s["global_steps"] == 12
    # 12 steps x 2 ranks x 4 examples of 65-128 tokens each, counted over both ranks
    assert 12 * 2 * 4 * 64 < s["tokens_trained"] < 12 * 2 * 4 * 128
    assert s["eval_loss"] < s["eval_loss_before_train"]
    assert (out / "adapter_model.safetensors").exists()
