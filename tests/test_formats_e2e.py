"""Through the CLI on the tiny model, with small data files written here (no conversion step, the loss falls):
alpaca, ShareGPT with tools (jinja template), raw text with autoregressive (+ check_packing), and DPO on
LLaMA-Factory's pair form."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from test_chat_template import TEMPLATE

TINY = os.path.join(ROOT, "build", "tiny-llama")
pytestmark = pytest.mark.slow

COLORS = ["red", "blue", "green", "white", "black", "yellow", "pink", "gray"]


def run(script, config, *overrides):
    cmd = [
        sys.executable,
        os.path.join(ROOT, script),
        os.path.join(ROOT, config),
        "--model_name_or_path",
        TINY,
        *map(str, overrides),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def losses(out):
    with open(os.path.join(out, "trainer_state.json")) as f:
        return [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]


def sft(tmp_path, data, *extra):
    out = str(tmp_path / "out")
    run(
        "llm/run_finetune.py",
        "llm/config/tiny/lora_argument.json",
        "--dataset_name_or_path",
        data,
        "--output_dir",
        out,
        "--do_eval",
        "false",
        "--eval_before_train",
        "false",
        "--max_steps",
        "16",
        "--logging_steps",
        "4",
        "--per_device_train_batch_size",
        "8",
        "--warmup_steps",
        "2",
        *extra,
    )
    ls = losses(out)
    assert len(ls) >= 4 and ls[-1] < 0.8 * ls[0], ls
    with open(os.path.join(out, "run_summary.json")) as f:
        return json.load(f)


def test_alpaca_json_array_trains(tiny_model_dir, tmp_path):
    recs = [
        {"instruction": f"What color is item {i}?", "input": "", "output": f"Item {i} is {COLORS[i % 8]}."}
        for i in range(64)
    ]
    (tmp_path / "alpaca.json").write_text(json.dumps(recs, indent=1))
    sft(tmp_path, str(tmp_path / "alpaca.json"))


def test_sharegpt_with_tools_trains_with_a_jinja_template(tiny_model_dir, tmp_path):
    tools = json.dumps([{"name": "paint", "description": "paint", "parameters": {"type": "object"}}])
    recs = [
        {
            "conversations": [
                {"from": "human", "value": f"Paint item {i}."},
                {
                    "from": "function_call",
                    "value": json.dumps({"name": "paint", "arguments": {"color": COLORS[i % 8]}}),
                },
                {"from": "observation", "value": json.dumps({"ok": True})},
                {"from": "gpt", "value": f"Item {i} is now {COLORS[i % 8]}."},
            ],
            "tools": tools,
        }
        for i in range(64)
    ]
    (tmp_path / "glaive.json").write_text(json.dumps(recs))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    sft(tmp_path, str(tmp_path / "glaive.json"), "--chat_template", tmp_path / "t.jinja")


def test_text_autoregressive_packed_lazy_trains_and_passes_check_packing(tiny_model_dir, tmp_path):
    words = " ".join(f"the {c} cat sat on the {d} mat." for c in COLORS for d in COLORS)
    # short documents first (check_packing takes the first rows), then some longer than max_length
    lines = [words[i * 37 : (i + 1) * 37 + 400 * (i >= 10)] for i in range(40)]
    (tmp_path / "wiki.txt").write_text("\n".join(lines) + "\n")
    keys = (
        "--autoregressive",
        "true",
        "--max_length",
        "128",
        "--zero_padding",
        "true",
        "--use_flash_attention",
        "true",
        "--flash_mask",
        "true",
    )
    sft(tmp_path, str(tmp_path / "wiki.txt"), *keys, "--lazy", "true")
    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps(
            {
                "dataset_name_or_path": str(tmp_path / "wiki.txt"),
                "output_dir": str(tmp_path / "c"),
                "do_train": True,
                "max_steps": 1,
                "lora": True,
                "src_length": 64,
            }
        )
    )
    r = run("llm/tools/check_packing.py", str(cfg), *keys, "--check_examples", "8")
    result = json.loads(r.stdout[r.stdout.index("{") :])
    # several documents (and chunks of long ones) share rows, with no attention across them
    assert result["ok"] is True and result["examples"] == 8 and result["packs"] < 8, result


def test_dpo_llama_factory_pairs_train(tiny_model_dir, tmp_path):
    recs = [
        {
            "conversations": [{"from": "human", "value": f"What color is item {i}?"}],
            "chosen": {"from": "gpt", "value": f"Item {i} is {COLORS[i % 8]}."},
            "rejected": {"from": "gpt", "value": "I will not say."},
        }
        for i in range(48)
    ]
    (tmp_path / "dpo.json").write_text(json.dumps(recs, indent=2))
    out = str(tmp_path / "dpo")
    run(
        "llm/run_dpo.py",
        "llm/config/tiny/dpo_lora_argument.json",
        "--train_dataset_path",
        tmp_path / "dpo.json",
        "--output_dir",
        out,
        "--do_eval",
        "false",
        "--max_steps",
        "10",
        "--logging_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--max_seq_len",
        "128",
        "--max_prompt_len",
        "64",
    )
    ls = losses(out)
    assert ls[-1] < ls[0], ls


def test_mixture_killed_and_resumed_continues_the_same_sequence(tiny_model_dir, tmp_path):
    import signal

    from conftest import DATA_DIR
    from test_reliability_e2e import start_and_wait_for, step_losses

    recs = [{"instruction": f"What color is item {i}?", "output": f"Item {i} is {COLORS[i % 8]}."} for i in range(40)]
    (tmp_path / "alpaca.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    mix = [
        "--dataset_name_or_path",
        f"{tmp_path / 'alpaca.jsonl'},{DATA_DIR}",
        "--dataset_weights",
        "[0.7, 0.3]",
        "--mix_strategy",
        "interleave_under",
        "--max_steps",
        "20",
        "--per_device_train_batch_size",
        "4",
        "--max_length",
        "128",
        "--src_length",
        "64",
        "--logging_steps",
        "1",
        "--do_eval",
        "false",
        "--eval_before_train",
        "false",
        "--save_strategy",
        "steps",
        "--save_steps",
        "10",
        "--model_name_or_path",
        TINY,
    ]

    def command(out, *extra):
        return [
            sys.executable,
            os.path.join(ROOT, "llm/run_finetune.py"),
            os.path.join(ROOT, "llm/config/tiny/lora_argument.json"),
            *mix,
            "--output_dir",
            str(out),
            *extra,
        ]

    ref = tmp_path / "ref"
    subprocess.run(command(ref), check=True, capture_output=True, cwd=ROOT)
    with open(ref / "run_summary.json") as f:
        report = json.load(f)["data"]["train"]
    assert report["mixture"]["per_source"][str(tmp_path / "alpaca.jsonl")] == 40  # alpaca (0.7) runs out first
    out = tmp_path / "out"
    p = start_and_wait_for(command(out), out / "checkpoint-10" / "CHECKPOINT_COMPLETE")
    p.send_signal(signal.SIGKILL)
    p.communicate()
    subprocess.run(command(out, "--resume_from_checkpoint", "true"), check=True, capture_output=True, cwd=ROOT)
    mine, theirs = step_losses(out), step_losses(ref)
    assert sorted(mine) == list(range(1, 21))
    assert all(abs(mine[s] - theirs[s]) <= 1e-6 for s in range(1, 21)), (mine, theirs)
