"""PPO through llm/run_ppo.py: the reward rises on GRPO's toy task (after the demo SFT); LoRA saves the
value head beside the adapter and a resume restores it (exact steps); a reward model of llm/run_reward.py
scores the completions; config errors exit 2."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_grpo_e2e import TINY, e_prompts, step_logs, train_reward_model  # noqa: F401  (e_prompts is a fixture)
from test_grpo_losses_e2e import sft_model  # noqa: F401  (a fixture)

from conftest import ROOT

pytestmark = pytest.mark.slow

CLI = os.path.join(ROOT, "llm", "run_ppo.py")
CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "ppo_argument.json")
SHORT = ("--model_name_or_path", TINY, "--num_generations", "4", "--max_completion_length", "8",
         "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none")


def run_ppo(out, *overrides, check=True, data=None):
    args = [CONFIG, "--output_dir", str(out), *map(str, overrides)]
    if data is not None:
        args += ["--train_dataset_path", str(data)]
    r = subprocess.run([sys.executable, CLI, *args], capture_output=True, text=True, cwd=ROOT, timeout=900)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def test_reward_rises(sft_model, tmp_path):  # noqa: F811
    out = tmp_path / "ppo"
    run_ppo(out, "--model_name_or_path", sft_model, "--max_steps", "30", "--report_to", "none")
    logs = step_logs(out)
    rewards = [h["reward"] for h in logs]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"ppo: mean reward first 10 steps {first:.4f}, last 10 steps {last:.4f}")
    assert len(logs) == 30 and last > first + 0.15, rewards
    for key in ("policy_loss", "value_loss", "clip_ratio", "value_clip_ratio", "kl", "completion_length"):
        assert key in logs[-1], logs[-1]
    assert logs[-1]["kl"] != 0 and json.loads((out / "run_summary.json").read_text())["trainer"] == "ppo"


def test_lora_value_head_saved_and_resumed(tmp_path, e_prompts):  # noqa: F811
    """The value head is its own file (the adapter is the policy's alone); a resume from checkpoint-2 restores
    it, so steps 3 and 4 equal the uninterrupted run's."""
    from safetensors.numpy import load_file

    common = (*SHORT, "--max_steps", "4", "--per_device_train_batch_size", "2", "--save_strategy", "steps",
              "--save_steps", "2", "--lora", "true", "--lora_rank", "4")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_ppo(full, *common, data=e_prompts)
    assert sorted(load_file(str(full / "value_head.safetensors"))) == ["bias", "weight"]
    assert not any("value" in k for k in load_file(str(full / "adapter_model.safetensors")))
    assert (full / "checkpoint-2" / "value_head.safetensors").is_file()
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    run_ppo(resumed, *common, "--resume_from_checkpoint", resumed / "checkpoint-2", data=e_prompts)
    a, b = step_logs(full), step_logs(resumed)
    assert [h["step"] for h in b][-2:] == [3, 4]
    for x, y in zip(a[-2:], b[-2:]):
        for key in ("loss", "reward", "value_loss", "policy_loss"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (key, x, y)
    ha, hb = (load_file(str(d / "value_head.safetensors")) for d in (full, resumed))
    assert float(abs(ha["weight"]).max()) > 0  # trained from its zero start
    assert max(float(abs(ha[k] - hb[k]).max()) for k in ha) < 1e-6


def test_reward_model_and_errors(e_prompts, tmp_path):  # noqa: F811
    rm = tmp_path / "rm"
    train_reward_model(rm)
    out = tmp_path / "ppo"
    run_ppo(out, *SHORT, "--max_steps", "2", "--reward_model_name_or_path", rm, "--reward_weights", "[1.0, 0.25]",
            data=e_prompts)
    logs = step_logs(out)
    assert len(logs) == 2 and all(h["rewards/reward_model"] != 0.0 for h in logs)
    r = run_ppo(tmp_path / "bad", *SHORT, "--beta", "0.1", "--loss_type", "dapo", "--kl_coeff", "-1", check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    for want in ("'beta' is a DPO", "'loss_type' is a DPO", "kl_coeff: must be >= 0.0"):
        assert want in r.stderr, (want, r.stderr[-2000:])
