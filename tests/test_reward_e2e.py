"""End-to-end reward models: drive llm/run_reward.py, reward_score.py and the merge on the tiny model."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from preference_cli import max_weight_diff, resume_from_copy

pytestmark = pytest.mark.slow

CLI = os.path.join(ROOT, "llm", "run_reward.py")
SCORE_CLI = os.path.join(ROOT, "llm", "predict", "reward_score.py")
MERGE_CLI = os.path.join(ROOT, "llm", "merge_lora_params.py")
TINY = os.path.join(ROOT, "build", "tiny-llama")
DATA = os.path.join(ROOT, "llm", "data", "reward_tiny")
LORA_CONFIG = "llm/config/tiny/reward_lora_argument.json"
FULL_CONFIG = "llm/config/tiny/reward_full_argument.json"
DEMO = next(
    (
        p
        for p in (
            os.path.join(os.path.dirname(ROOT), "shared", "data", "dpo_en_demo.json"),
            "/work/shared/data/dpo_en_demo.json",
        )
        if os.path.isfile(p)
    ),
    None,
)


SHORT = ("--max_steps", "12", "--max_seq_len", "256", "--max_prompt_len", "128", "--per_device_train_batch_size", "4")


def run(script, *args, check=True):
    r = subprocess.run([sys.executable, script, *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def run_reward(config, out, *overrides, check=True):
    return run(
        CLI,
        os.path.join(ROOT, config),
        "--output_dir",
        out,
        "--model_name_or_path",
        TINY,
        "--train_dataset_path",
        DATA,
        "--dev_dataset_path",
        DATA,
        *overrides,
        check=check,
    )


def score(model_dir, input_file, out_file):
    r = run(SCORE_CLI, "--model_name_or_path", model_dir, "--input_file", input_file, "--output_file", out_file)
    rows = [json.loads(line) for line in open(out_file)]
    return r, np.asarray([[x["chosen_score"], x["rejected_score"]] for x in rows])


def test_lora_reward_model_learns_and_scores(tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    r = run_reward(LORA_CONFIG, out, *SHORT)
    s = json.loads((out / "run_summary.json").read_text())
    ev = s["eval"]
    assert s["loss_type"] == "reward" and s["method"] == "lora" and s["reference"] == "none"
    assert ev["eval_rewards/accuracies"] >= 0.75, ev  # chance is 0.5 on the 32 dev pairs
    assert ev["eval_rewards/margins"] > 0 and ev["eval_rewards/chosen"] > ev["eval_rewards/rejected"]
    assert "reward accuracy" in r.stdout
    for name in ("adapter_model.safetensors", "score_head.safetensors", "reward_config.json"):
        assert (out / name).exists(), name
    # the CLI scorer reproduces the dev evaluation
    sr, scores = score(out, os.path.join(DATA, "dev.json"), tmp_path / "scores.jsonl")
    acc = float(np.mean(scores[:, 0] > scores[:, 1]))
    assert acc == pytest.approx(ev["eval_rewards/accuracies"], abs=1e-9)  # the eval mean is over pairs
    assert float(np.mean(scores[:, 0] - scores[:, 1])) == pytest.approx(ev["eval_rewards/margins"], rel=1e-4)
    assert f"pair accuracy {acc:.4f}" in sr.stdout
    # merging keeps the head in paddle layout (tests/test_reward.py compares the scores); hf layout is refused
    hf = run(
        MERGE_CLI,
        "--model_name_or_path",
        TINY,
        "--lora_path",
        out,
        "--merge_model_path",
        tmp_path / "hf",
        "--output_format",
        "hf",
        check=False,
    )
    assert hf.returncode == 2 and "reward model" in hf.stderr


def test_full_reward_model_learns(tiny_model_dir, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "full"
    run_reward(FULL_CONFIG, out, *SHORT)
    ev = json.loads((out / "run_summary.json").read_text())["eval"]
    assert ev["eval_rewards/accuracies"] >= 0.75, ev
    weights = load_file(str(out / "model.safetensors"))
    assert not any("score_head" in k for k in weights)  # the directory still loads as a causal LM
    assert load_file(str(out / "score_head.safetensors"))["score_head.weight"].shape == (64, 1)


def test_qlora_nf4_reward_model_learns_and_scores(tiny_model_dir, tmp_path):
    out = tmp_path / "qlora"
    run_reward(LORA_CONFIG, out, *SHORT, "--weight_quantize_algo", "nf4")
    s = json.loads((out / "run_summary.json").read_text())
    assert s["method"] == "lora+nf4" and s["quantization"]["params_quantized"] > 0, s["method"]
    ev = s["eval"]
    assert ev["eval_rewards/accuracies"] >= 0.75, ev
    _, scores = score(out, os.path.join(DATA, "dev.json"), tmp_path / "scores.jsonl")  # the base re-quantized
    assert float(np.mean(scores[:, 0] > scores[:, 1])) == pytest.approx(ev["eval_rewards/accuracies"], abs=1e-9)


@pytest.mark.parametrize("config", [LORA_CONFIG, FULL_CONFIG], ids=["lora", "full"])
def test_resume_is_exact(tiny_model_dir, tmp_path, config):
    """Stop at checkpoint-3, resume: the same losses and the same final weights and score head."""
    common = (
        "--max_steps",
        "6",
        "--save_strategy",
        "steps",
        "--save_steps",
        "3",
        "--do_eval",
        "false",
        "--per_device_train_batch_size",
        "2",
        "--warmup_steps",
        "0",
    )
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    a, b = resume_from_copy(run_reward, config, whole, resumed, 3, *common)
    assert (whole / "checkpoint-3" / "score_head.safetensors").exists()
    assert b[-1]["step"] == 6 and b[-1]["loss"] == pytest.approx(a[-1]["loss"], rel=1e-5)
    weights = "adapter_model.safetensors" if config == LORA_CONFIG else "model.safetensors"
    for name in (weights, "score_head.safetensors"):
        assert max_weight_diff(whole, resumed, name) < 1e-6, name


def test_sigterm_saves_a_scorable_checkpoint(tiny_model_dir, tmp_path):
    import signal
    import time

    from paddlenlp_ext.reward.scorer import RewardScorer

    out = tmp_path / "out"
    cmd = [
        sys.executable,
        CLI,
        os.path.join(ROOT, LORA_CONFIG),
        "--output_dir",
        str(out),
        "--model_name_or_path",
        TINY,
        "--train_dataset_path",
        DATA,
        "--dev_dataset_path",
        DATA,
        "--max_steps",
        "500",
        "--save_strategy",
        "steps",
        "--save_steps",
        "3",
        "--do_eval",
        "false",
        "--per_device_train_batch_size",
        "2",
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.time() + 120
    while not (out / "checkpoint-3" / "CHECKPOINT_COMPLETE").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, stdout[-2000:] + stderr[-4000:]
    assert "Traceback" not in stderr and "Resume with:" in stderr
    saved = sorted(out.glob("checkpoint-*"), key=lambda d: int(d.name.split("-")[1]))[-1]
    assert (saved / "CHECKPOINT_COMPLETE").exists() and (saved / "score_head.safetensors").exists()
    scores = RewardScorer.from_pretrained(str(saved)).score_texts(["Tell me about the park."], ["It is lovely."])
    assert scores.shape == (1,) and np.isfinite(scores).all()


def test_bad_input_exits_2(tiny_model_dir, tmp_path):
    r = run_reward(
        LORA_CONFIG, tmp_path / "bad", "--beta", "0.1", "--lazy", "true", "--max_prompt_len", "600", check=False
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "'beta' is a DPO" in r.stderr and "lazy=true is not supported" in r.stderr
    assert "max_prompt_len (600) must be < max_seq_len (512)" in r.stderr
    assert not (tmp_path / "bad").exists()
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"}}\nnot json\n'
    )
    r = run(
        CLI,
        os.path.join(ROOT, LORA_CONFIG),
        "--output_dir",
        tmp_path / "bad2",
        "--model_name_or_path",
        TINY,
        "--train_dataset_path",
        bad,
        "--dev_dataset_path",
        DATA,
        check=False,
    )
    assert r.returncode == 2 and f"{bad}:1" in r.stderr and f"{bad}:2" in r.stderr, r.stderr[-3000:]
    r = run(
        SCORE_CLI, "--model_name_or_path", TINY, "--input_file", bad, "--output_file", tmp_path / "o.jsonl", check=False
    )
    assert r.returncode == 2 and "not a reward model directory" in r.stderr


@pytest.mark.skipif(DEMO is None, reason="../shared/data/dpo_en_demo.json is not here")
def test_dpo_en_demo_pair_accuracy_above_chance(tiny_model_dir, tmp_path):
    """The issue's check: a reward model trained on dpo_en_demo.json beats chance on held-out pairs."""
    rows = json.load(open(DEMO))
    data = tmp_path / "demo"
    data.mkdir()
    (data / "train.json").write_text("\n".join(json.dumps(x) for x in rows[:-60]) + "\n")
    (data / "dev.json").write_text("\n".join(json.dumps(x) for x in rows[-60:]) + "\n")
    out = tmp_path / "out"
    run(
        CLI,
        os.path.join(ROOT, LORA_CONFIG),
        "--output_dir",
        out,
        "--model_name_or_path",
        TINY,
        "--train_dataset_path",
        data,
        "--dev_dataset_path",
        data,
        "--max_steps",
        "30",
        "--learning_rate",
        "3e-3",
        "--per_device_train_batch_size",
        "4",
    )
    ev = json.loads((out / "run_summary.json").read_text())["eval"]
    print(f"dpo_en_demo: dev pair accuracy {ev['eval_rewards/accuracies']:.4f} on 60 held-out pairs")
    assert ev["eval_rewards/accuracies"] > 0.5
