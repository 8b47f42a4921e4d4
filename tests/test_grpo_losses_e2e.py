"""GRPO's loss variants through llm/run_grpo.py: the reward rises on the shipped toy task (after the demo
SFT) for dapo with two updates per rollout, dr_grpo and GSPO's sequence-level ratio; gradient
accumulation 2 x batch 2 reproduces batch 4 (LoRA); loss_type rloo and cispo train."""

import functools
import json
import shutil

import pytest
from conftest import run_jobs
from test_grpo_e2e import SHORT, e_prompts, run_grpo, step_logs, toy_sft  # noqa: F401  (e_prompts is a fixture)


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sft_model(tiny_model_dir, tmp_path_factory):
    """The toy task's starting point: the tiny model after a short SFT on the advertise data (as test_grpo_e2e)."""
    sft = tmp_path_factory.mktemp("grpo_sft") / "sft"
    toy_sft(tiny_model_dir, sft)
    return sft


#: name -> the loss variant's CLI overrides
VARIANTS = {
    "dapo_two_iterations": ("--loss_type", "dapo", "--num_iterations", "2"),
    "dr_grpo": ("--loss_type", "dr_grpo"),
    "gspo_sequence": ("--importance_sampling_level", "sequence"),
}


def _reward_rises(sft_model, out, name):
    run_grpo(out, "--model_name_or_path", sft_model, "--max_steps", "30", "--report_to", "none", *VARIANTS[name])
    logs = step_logs(out)
    assert [h["step"] for h in logs] == list(range(1, 31)), [h["step"] for h in logs]
    rewards = [h["reward"] for h in logs]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"{name}: mean reward first 10 steps {first:.4f}, last 10 steps {last:.4f}")
    assert last > first + 0.15, rewards
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["loss_type"] == ("dr_grpo" if name == "dr_grpo" else "dapo"), summary["loss_type"]
    if name == "dapo_two_iterations":
        # the second step of every rollout trains on the first step's samples: the ratio moves, clipping acts
        assert summary["rollouts_generated"] == 15, summary["rollouts_generated"]
        assert all(logs[k]["clip_ratio"] == 0 for k in range(0, 30, 2)), [h["clip_ratio"] for h in logs]  # ratio 1
        assert sum(logs[k]["clip_ratio"] > 0 for k in range(1, 30, 2)) >= 5, [h["clip_ratio"] for h in logs]
        assert logs[1]["reward"] == logs[0]["reward"], logs[:2]  # the same rollout's rewards
    else:
        assert summary["rollouts_generated"] == 30 and all(h["clip_ratio"] == 0 for h in logs), (
            summary["rollouts_generated"],
            [h["clip_ratio"] for h in logs],
        )
    if name == "gspo_sequence":
        assert summary["importance_sampling_level"] == "sequence", summary["importance_sampling_level"]


def test_reward_rises(sft_model, tmp_path):
    """dapo with two updates per rollout, dr_grpo and GSPO's sequence ratio: three independent runs, two at a time."""
    failures = run_jobs({name: functools.partial(_reward_rises, sft_model, tmp_path / name, name) for name in VARIANTS})
    assert not failures, failures


@pytest.mark.parametrize(
    "extra",
    [(), ("--loss_type", "dr_grpo", "--scale_rewards", "batch", "--num_iterations", "2")],
    ids=["dapo", "dr_grpo_batch_mu2"],
)
def test_accumulation_equals_batch(tmp_path, e_prompts, extra):  # noqa: F811
    """LoRA: batch 2 x 2 accumulation steps reproduces batch 4 over 3 steps (losses, rewards, adapter weights):
    every micro-batch's completions are generated before the step, so the global counts are the same."""
    from safetensors.numpy import load_file

    common = (
        *SHORT,
        "--max_steps",
        "3",
        "--lora",
        "true",
        "--lora_rank",
        "4",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        *extra,
    )
    one, two = tmp_path / "b4", tmp_path / "b2x2"
    failures = run_jobs(
        {  # independent runs: two at a time
            "batch 4": lambda: run_grpo(
                one, *common, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", data=e_prompts
            ),
            "batch 2 x 2": lambda: run_grpo(
                two, *common, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", data=e_prompts
            ),
        }
    )
    assert not failures, failures
    a, b = step_logs(one), step_logs(two)
    assert len(a) == len(b) == 3
    assert any(0 < h["reward"] < 1 for h in a)  # advantages not all 0 (the loss value itself is ~0 at ratio 1)
    for x, y in zip(a, b):
        for key in ("loss", "reward", "reward_std", "completion_length"):
            assert abs(x[key] - y[key]) < 1e-5, (key, x, y)
    wa, wb = (load_file(str(d / "adapter_model.safetensors")) for d in (one, two))
    assert wa.keys() == wb.keys()
    moved = max(float(abs(v).max()) for k, v in wa.items() if "lora_B" in k)
    assert moved > 1e-4  # the adapters trained
    assert max(float(abs(wa[k] - wb[k]).max()) for k in wa) < 1e-5


@pytest.mark.parametrize(
    "extra",
    [
        ("--loss_type", "rloo", "--normalize_advantages", "true"),
        ("--loss_type", "cispo", "--epsilon_high", "5.0", "--num_iterations", "2"),
    ],
    ids=["rloo", "cispo"],
)
def test_other_losses_train(tmp_path, e_prompts, extra):  # noqa: F811
    out = tmp_path / "run"
    run_grpo(
        out,
        *SHORT,
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        *extra,
        data=e_prompts,
    )
    logs = step_logs(out)
    assert len(logs) == 4 and any(0 < h["reward"] < 1 for h in logs) and logs[-1]["kl"] > 0
    assert json.loads((out / "run_summary.json").read_text())["loss_type"] == extra[1]


def test_resume_inside_a_rollout_is_exact(tmp_path, e_prompts):  # noqa: F811
    """num_iterations 2 with a checkpoint after step 1: the checkpoint keeps the rollout (completions, old
    log-probs, advantages), so a resume trains step 2 on it exactly as the uninterrupted run did."""
    common = (
        *SHORT,
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
        "--report_to",
        "none",
        "--lora",
        "true",
        "--lora_rank",
        "4",
        "--num_iterations",
        "2",
    )
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_grpo(full, *common, data=e_prompts)
    assert (full / "checkpoint-1" / "rollout-rank0.npz").is_file()
    assert not (full / "checkpoint-2" / "rollout-rank0.npz").exists()  # step 3 starts a new rollout
    assert not list(full.glob(".rollout-*"))
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-1", resumed / "checkpoint-1")
    run_grpo(resumed, *common, "--resume_from_checkpoint", resumed / "checkpoint-1", data=e_prompts)
    assert "the rollout of step 1 continues from" in (resumed / "train.log").read_text()
    a, b = step_logs(full), step_logs(resumed)
    assert [h["step"] for h in b][-3:] == [2, 3, 4]
    assert a[1]["clip_ratio"] > 0 or a[3]["clip_ratio"] > 0
    for x, y in zip(a[-3:], b[-3:]):
        for key in ("loss", "reward", "kl", "clip_ratio"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (key, x, y)


def test_two_processes_reproduce_one_with_batch_scaling(tmp_path, e_prompts):  # noqa: F811
    """Data parallel with the settings whose normalisers span ranks: scale_rewards batch (the std of every
    rank's rewards), grpo (the global batch's completions), accumulation and two steps per rollout."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = (
        *SHORT,
        "--max_steps",
        "4",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--adam_epsilon",
        "0.01",
        "--scale_rewards",
        "batch",
        "--loss_type",
        "grpo",
        "--num_iterations",
        "2",
        "--gradient_accumulation_steps",
        "2",
    )
    run_grpo(one, *common, "--per_device_train_batch_size", "2", data=e_prompts)
    run_grpo(two, *common, "--per_device_train_batch_size", "1", procs=2, data=e_prompts)
    a, b = step_logs(one), step_logs(two)
    assert len(a) == len(b) == 4 and any(h["clip_ratio"] > 0 for h in a)
    for x, y in zip(a, b):
        for key in ("loss", "reward", "kl", "clip_ratio"):
            assert abs(x[key] - y[key]) < 1e-5, (key, x, y)
