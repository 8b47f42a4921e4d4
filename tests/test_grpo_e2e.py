"""End-to-end GRPO: drive llm/run_grpo.py on the tiny model and check numbers, parity and exit codes.

The reward rise starts, as the issue asks, from the tiny demo model AFTER a short SFT on the
advertise data; the other tests start from the random tiny model with short completions.
"""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT

# end-to-end through the CLI: `make test-slow`
pytestmark = pytest.mark.slow

CLI = os.path.join(ROOT, "llm", "run_grpo.py")
CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "grpo_argument.json")
TINY = os.path.join(ROOT, "build", "tiny-llama")
# short runs from the random tiny model: 2 prompts x 4 completions of <= 8 tokens per step; the keyword
# "e" is in some of the random completions and not in others, so the advantages are not all 0
SHORT = (
    "--model_name_or_path",
    TINY,
    "--num_generations",
    "4",
    "--max_completion_length",
    "8",
    "--learning_rate",
    "1e-3",
    "--logging_steps",
    "1",
)


def toy_sft(tiny_model_dir, sft):
    """The toy task's starting point: the tiny model after 60 SFT steps on the advertise data (the CLI)."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "llm", "run_finetune.py"),
        os.path.join(ROOT, "llm", "config", "tiny", "sft_argument.json"),
        "--output_dir",
        str(sft),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name_or_path",
        DATA_DIR,
        "--max_steps",
        "60",
        "--do_eval",
        "false",
        "--eval_before_train",
        "false",
        "--report_to",
        "none",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return sft


def train_reward_model(rm):
    """A LoRA reward model of the tiny model, 3 steps of llm/run_reward.py (the CLI)."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "llm", "run_reward.py"),
        os.path.join(ROOT, "llm", "config", "tiny", "reward_lora_argument.json"),
        "--output_dir",
        str(rm),
        "--model_name_or_path",
        TINY,
        "--max_steps",
        "3",
        "--do_eval",
        "false",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return rm


def run_grpo(out, *overrides, procs=1, check=True, data=None):
    args = [CONFIG, "--output_dir", str(out), *map(str, overrides)]
    if data is not None:
        args += ["--train_dataset_path", str(data)]
    if procs == 1:
        cmd = [sys.executable, CLI, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            "--nproc_per_node",
            str(procs),
            "--log_dir",
            str(out) + "_launch",
            CLI,
            *args,
        ]
    # a fatal signal in a worker prints the Python stack of every thread into its workerlog
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, env=env)
    if check:
        # each worker's own log first (the launcher's output repeats rank 0's), then the launcher's verdict
        logs = "".join(
            f"--- {os.path.basename(f)} (end) ---\n{open(f).read()[-2500:]}\n"
            for f in sorted(glob.glob(str(out) + "_launch/workerlog.*"))
        )
        assert r.returncode == 0, logs + r.stderr[-1500:] + (r.stdout[-3000:] if procs == 1 else "")
    return r


def step_logs(out):
    state = json.loads((out / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "reward" in h]


@pytest.fixture(scope="module")
def e_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo_data") / "train.json"
    with open(os.path.join(ROOT, "llm", "data", "grpo_tiny", "train.json")) as src, open(path, "w") as f:
        for line in list(src)[:16]:
            record = json.loads(line)
            f.write(json.dumps({**record, "keyword": "e"}) + "\n")
    return path


def test_reward_rises_after_sft(tiny_model_dir, tmp_path):
    """The shipped toy task: after a short SFT, 50 GRPO steps raise the share of completions with "vintage"."""
    sft = tmp_path / "sft"
    toy_sft(tiny_model_dir, sft)
    out = tmp_path / "grpo"
    r = run_grpo(out, "--model_name_or_path", sft)
    logs = step_logs(out)
    assert [h["step"] for h in logs] == list(range(1, 51))
    rewards = [h["reward"] for h in logs]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"mean reward: first 10 steps {first:.4f}, last 10 steps {last:.4f}")
    assert f"mean reward: first 10 steps {first:.4f} -> last 10 steps {last:.4f}" in r.stdout
    assert last > first + 0.15 and last > 0.6, rewards
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["reward_first"] == pytest.approx(first) and summary["reward_last"] == pytest.approx(last)
    assert len(summary["steps"]) == 50 and summary["completions_trained"] == 50 * 2 * 8
    for key in ("reward_std", "kl", "clip_ratio", "completion_length", "rewards/contains_keyword"):
        assert key in logs[-1], logs[-1]
    assert logs[-1]["kl"] > 0 and 1 <= logs[-1]["completion_length"] <= 20
    assert glob.glob(str(out / "runs" / "*" / "*"))  # VisualDL records


def test_two_processes_reproduce_one(tmp_path, e_prompts):
    """Data parallel on CPU (gloo): 2 x 1 prompt per step reproduces 1 x 2 prompts, generation included."""
    one, two = tmp_path / "one", tmp_path / "two"
    # adam_epsilon 0.01: Adam's first steps are otherwise sign(gradient) per weight, which turns the last-bit
    # differences of an all-reduced gradient near 0 into whole learning-rate steps (and other samples at step 3);
    # with a large epsilon the update is proportional to the gradient, so its normalisation is checked too
    common = (*SHORT, "--max_steps", "3", "--save_strategy", "no", "--report_to", "none", "--adam_epsilon", "0.01")
    run_grpo(one, *common, "--per_device_train_batch_size", "2", data=e_prompts)
    run_grpo(two, *common, "--per_device_train_batch_size", "1", procs=2, data=e_prompts)
    a, b = step_logs(one), step_logs(two)
    assert len(a) == len(b) == 3
    assert any(0 < h["reward"] < 1 for h in a) and any(abs(h["loss"]) > 1e-4 for h in a)
    for x, y in zip(a, b):
        for key in ("loss", "reward", "reward_std", "kl", "clip_ratio", "completion_length"):
            assert abs(x[key] - y[key]) < 1e-5, (key, x, y)


def test_lora_resume_is_exact(tmp_path, e_prompts):
    """LoRA (the reference is the base with the adapters off): steps 3 and 4 after resuming from checkpoint-2
    equal the uninterrupted run's (sampling is seeded by the step)."""
    from safetensors.numpy import load_file

    common = (
        *SHORT,
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--report_to",
        "none",
        "--lora",
        "true",
        "--lora_rank",
        "4",
    )
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_grpo(full, *common, data=e_prompts)
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    run_grpo(resumed, *common, "--resume_from_checkpoint", resumed / "checkpoint-2", data=e_prompts)
    a, b = step_logs(full), step_logs(resumed)
    assert [h["step"] for h in b][-2:] == [3, 4]
    for x, y in zip(a[-2:], b[-2:]):
        for key in ("loss", "reward", "kl"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (key, x, y)
    assert json.loads((full / "run_summary.json").read_text())["reference"] == "adapters"
    assert b[-1]["kl"] > 0  # the adapters moved the policy away from the base
    wa, wb = (load_file(str(d / "adapter_model.safetensors")) for d in (full, resumed))
    assert max(float(abs(wa[k] - wb[k]).max()) for k in wa) < 1e-6


def test_bad_config_and_data_exit_2(tmp_path):
    r = run_grpo(
        tmp_path / "a",
        "--model_name_or_path",
        TINY,
        "--reward_funcs",
        '["nowhere_mod:f"]',
        "--tensor_parallel_degree",
        "2",
        check=False,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "reward_funcs[0]: 'nowhere_mod:f': cannot import module 'nowhere_mod'" in r.stderr
    assert "tensor_parallel_degree > 1 is not supported for GRPO" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"src": "a", "keyword": "x"}\n{"src": "b", "keyword": 1, "extra": 2}\n')
    r = run_grpo(tmp_path / "b", "--model_name_or_path", TINY, check=False, data=bad)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{bad}:2: fields ['extra', 'keyword'] differ from the first record's ['keyword']" in r.stderr


def test_reward_model_from_run_reward(e_prompts, tmp_path):
    """A reward model trained by llm/run_reward.py scores GRPO's completions, weighted with a function."""
    rm = tmp_path / "rm"
    train_reward_model(rm)
    out = tmp_path / "grpo"
    run_grpo(
        out,
        *SHORT,
        "--max_steps",
        "2",
        "--reward_model_name_or_path",
        rm,
        "--reward_weights",
        "[1.0, 0.25]",
        data=e_prompts,
    )
    logs = step_logs(out)
    assert len(logs) == 2
    for h in logs:  # the logged means combine as the rewards do: function + 0.25 * reward model
        assert h["rewards/reward_model"] != 0.0
        assert h["reward"] == pytest.approx(h["rewards/contains_keyword"] + 0.25 * h["rewards/reward_model"], abs=1e-5)
