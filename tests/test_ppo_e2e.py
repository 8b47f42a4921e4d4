"""PPO through llm/run_ppo.py: the reward rises on GRPO's toy task (after the demo SFT), with the keyword
function and with a reward model of llm/run_reward.py alone (trained on keyword pairs; the keyword rate rises
too); LoRA saves the value head beside the adapter and a resume restores it (exact steps); a reward model
weighted with a function scores the completions; config errors exit 2."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from test_grpo_e2e import TINY, e_prompts, step_logs, train_reward_model  # noqa: F401  (e_prompts is a fixture)
from test_grpo_losses_e2e import sft_model  # noqa: F401  (a fixture)

from conftest import DATA_DIR, ROOT, run_jobs

pytestmark = pytest.mark.slow

CLI = os.path.join(ROOT, "llm", "run_ppo.py")
CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "ppo_argument.json")
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
    "--report_to",
    "none",
)


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


STYLES = ("vintage", "fresh", "minimalist", "elegant", "sporty", "casual")  # the advertise data's styles


def keyword_pairs(out_dir, n_train=160, n_dev=32, seed=0):
    """Preference pairs for GRPO's toy task ("vintage" in the completion), written as train.json / dev.json.

    From the advertise data's first records: the prompt is the record's ``src`` without its style (as the
    grpo_tiny prompts), both answers are its ``tgt`` cut a few words after the style word (the policy's
    completions are 20 tokens), the chosen one with the style word "vintage", the rejected one with another
    style; so the pair differs in the keyword only.  Deterministic (``random.Random(seed)``).
    Example: src "type#shirt*color#red*style#vintage*..." ->
    {"src": ["type#shirt*color#red*..."], "tgt": [], "sort": [1, 0], "response":
    ["This red shirt in cool, airy linen brings a vintage feel. It has", "... brings a sporty feel. It has"]}
    """
    import random

    rng = random.Random(seed)
    with open(os.path.join(DATA_DIR, "train.json")) as f:
        rows = [json.loads(next(f)) for _ in range(n_train + n_dev)]
    pairs = []
    for r in rows:
        style = r["src"].split("style#")[1].split("*")[0]
        words = r["tgt"].split()
        at = next(i for i, w in enumerate(words) if w.strip(".,:").lower() == style)
        cut, other = at + 1 + rng.randint(0, 4), rng.choice(STYLES[1:])
        chosen, rejected = (
            " ".join(w.replace(style, s) if i == at else w for i, w in enumerate(words[:cut]))
            for s in ("vintage", other)
        )
        pairs.append(
            {
                "src": [r["src"].replace(f"*style#{style}", "")],
                "tgt": [],
                "response": [chosen, rejected],
                "sort": [1, 0],
            }
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.json", pairs[:n_train]), ("dev.json", pairs[n_train:])):
        (out_dir / name).write_text("".join(json.dumps(p) + "\n" for p in part))
    return out_dir


def test_reward_rises_with_reward_model(sft_model, tmp_path):  # noqa: F811
    """The honest version: a reward model trained by llm/run_reward.py on keyword pairs (it ranks held-out
    pairs right, llm/predict/reward_score.py) is PPO's only reward; 30 steps after the demo SFT raise both its
    mean score and the true task metric, the share of completions with "vintage".  contains_keyword stays in
    the config with weight 0: it is logged (rewards/contains_keyword, the keyword rate) but trains nothing --
    every step's reward equals the reward model's score.  docs/alignment.md lists the per-step rewards of 4
    seeds; this run (seed 42) is deterministic."""
    data, rm, out = keyword_pairs(tmp_path / "pairs"), tmp_path / "rm", tmp_path / "ppo"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "llm", "run_reward.py"),
        os.path.join(ROOT, "llm", "config", "tiny", "reward_lora_argument.json"),
        "--output_dir",
        str(rm),
        "--model_name_or_path",
        TINY,
        "--train_dataset_path",
        str(data),
        "--dev_dataset_path",
        str(data),
        "--max_steps",
        "20",
        "--max_seq_len",
        "128",
        "--max_prompt_len",
        "64",
        "--do_eval",
        "false",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    scores = tmp_path / "scores.jsonl"

    def score():
        r = subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "llm", "predict", "reward_score.py"),
                "--model_name_or_path",
                str(rm),
                "--input_file",
                str(data / "dev.json"),
                "--output_file",
                str(scores),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=900,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    def ppo():  # reward_funcs: contains_keyword (the config's), weighted 0; the reward model, weighted 1
        run_ppo(
            out,
            "--model_name_or_path",
            sft_model,
            "--max_steps",
            "30",
            "--report_to",
            "none",
            "--learning_rate",
            "1e-3",
            "--reward_model_name_or_path",
            rm,
            "--reward_weights",
            "[0.0, 1.0]",
        )

    failures = run_jobs({"score": score, "ppo": ppo})  # both need only the reward model: two at a time
    assert not failures, failures
    rows = [json.loads(line) for line in scores.read_text().splitlines()]
    right = sum(x["chosen_score"] > x["rejected_score"] for x in rows)
    assert len(rows) == 32 and right >= 30, rows  # held out: 32 of 32 measured (chance: 16)
    logs = step_logs(out)
    assert [h["step"] for h in logs] == list(range(1, 31))
    for h in logs:  # the keyword function trains nothing: the reward is the reward model's score
        assert h["reward"] == pytest.approx(h["rewards/reward_model"], abs=1e-5), h
    rewards = [h["reward"] for h in logs]
    rate = [h["rewards/contains_keyword"] for h in logs]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    rate_first, rate_last = sum(rate[:10]) / 10, sum(rate[-10:]) / 10
    print(
        f"ppo + reward model: mean reward first 10 steps {first:.4f}, last 10 {last:.4f}; "
        f"keyword rate {rate_first:.4f} -> {rate_last:.4f}"
    )
    assert last > first + 0.15, rewards
    assert rate_last > rate_first + 0.15, rate


def test_lora_value_head_saved_and_resumed(tmp_path, e_prompts):  # noqa: F811
    """The value head is its own file (the adapter is the policy's alone); a resume from checkpoint-2 restores
    it, so steps 3 and 4 equal the uninterrupted run's."""
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
        "--lora",
        "true",
        "--lora_rank",
        "4",
    )
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
    run_ppo(
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
    assert len(logs) == 2 and all(h["rewards/reward_model"] != 0.0 for h in logs)
    r = run_ppo(tmp_path / "bad", *SHORT, "--beta", "0.1", "--loss_type", "dapo", "--kl_coeff", "-1", check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    for want in ("'beta' is a DPO", "'loss_type' is a DPO", "kl_coeff: must be >= 0.0"):
        assert want in r.stderr, (want, r.stderr[-2000:])
