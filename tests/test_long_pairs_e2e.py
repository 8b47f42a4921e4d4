"""Through the CLIs on the tiny model: a preference file in which 3% of the pairs (multi-turn histories) are longer
than max_seq_len trains with DPO, KTO and the reward model; the configuration line and a notice say how many were
truncated and how, and run_summary.json keeps the counts (the kept tokens are shown in tests/test_truncation.py).
Also LLaMA-Factory's demo files (../shared/data) train unchanged."""

import json
import os

import pytest

from conftest import ROOT
from preference_cli import cli_runner
from test_chat_template import TEMPLATE

pytestmark = pytest.mark.slow
COLORS = ["red", "blue", "green", "white", "black", "yellow", "pink", "gray"]
LONG = {7, 40, 77}  # 3 of 100
DEMO_DIR = next(
    (d for d in (os.path.join(os.path.dirname(ROOT), "shared", "data"), "/work/shared/data") if os.path.isdir(d)), None
)


def history(i):
    if i not in LONG:
        return []
    words = " ".join(f"the {c} cat sat on the {d} mat" for c in COLORS for d in COLORS[:3])
    return [[f"Tell me a story {k}: {words}", f"Here it is: {words}"] for k in range(3)]


def dpo_records():
    recs = []
    for i in range(100):
        turns = [{"from": f, "value": v} for q, a in history(i) for f, v in (("human", q), ("gpt", a))]
        recs.append(
            {
                "conversations": turns + [{"from": "human", "value": f"What color is item {i}?"}],
                "chosen": {"from": "gpt", "value": f"Item {i} is {COLORS[i % 8]}."},
                "rejected": {"from": "gpt", "value": "I cannot say."},
            }
        )
    return recs


def kto_records():
    recs = []
    for i in range(100):
        turns = [{"role": r, "content": v} for q, a in history(i) for r, v in (("user", q), ("assistant", a))]
        good = i % 2 == 0
        recs.append(
            {
                "messages": turns
                + [
                    {"role": "user", "content": f"What color is item {i}?"},
                    {"role": "assistant", "content": f"Item {i} is {COLORS[i % 8]}." if good else "No idea."},
                ],
                "label": good,
            }
        )
    return recs


COMMON = (
    "--max_steps",
    "3",
    "--logging_steps",
    "1",
    "--per_device_train_batch_size",
    "4",
    "--do_eval",
    "false",
    "--max_seq_len",
    "256",
    "--max_prompt_len",
    "128",
    "--lora",
    "true",
)


@pytest.mark.parametrize(
    "script, config, records",
    [
        ("run_dpo.py", "llm/config/tiny/dpo_argument.json", dpo_records),
        ("run_reward.py", "llm/config/tiny/reward_lora_argument.json", dpo_records),
        ("run_kto.py", "llm/config/tiny/kto_argument.json", kto_records),
    ],
)
def test_three_percent_long_pairs_train_and_are_counted(tiny_model_dir, tmp_path, script, config, records):
    data = tmp_path / "train.json"
    data.write_text(json.dumps(records(), indent=1))
    out = tmp_path / "out"
    overrides = COMMON if script != "run_reward.py" else COMMON[:-2]  # the reward config has its own adapter keys
    r = cli_runner(script, str(data))(config, out, *overrides)
    unit = "examples" if script == "run_kto.py" else "pairs"
    assert "train 100 pairs, " in r.stdout and ", 3 truncated, 0 dropped" in r.stdout, r.stdout[-2000:]
    assert f"notice: train: 3 of 100 {unit} truncated (docs/data.md): " in r.stdout + r.stderr
    train = json.loads((out / "run_summary.json").read_text())["data"]["train"]
    assert train["truncated_examples"] == 3 and train["dropped_examples"] == 0 and train["dropped_rounds"] >= 3


@pytest.mark.skipif(DEMO_DIR is None, reason="../shared/data (LLaMA-Factory's demo files) is not here")
@pytest.mark.parametrize(
    "script, config, name, extra",
    [
        ("run_finetune.py", "llm/config/tiny/lora_argument.json", "alpaca_en_demo.json", ()),
        ("run_finetune.py", "llm/config/tiny/lora_argument.json", "glaive_toolcall_en_demo.json", ("jinja",)),
        ("run_dpo.py", "llm/config/tiny/dpo_argument.json", "dpo_en_demo.json", ()),
        ("run_reward.py", "llm/config/tiny/reward_lora_argument.json", "dpo_en_demo.json", ()),
        ("run_kto.py", "llm/config/tiny/kto_argument.json", "kto_en_demo.json", ()),
    ],
)
def test_llama_factory_demo_files_train_unchanged(tiny_model_dir, tmp_path, script, config, name, extra):
    import subprocess
    import sys

    path = os.path.join(DEMO_DIR, name)
    common = [
        "--max_steps",
        "2",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "4",
        "--do_eval",
        "false",
        "--output_dir",
        str(tmp_path / "out"),
        "--model_name_or_path",
        tiny_model_dir,
    ]
    if "jinja" in extra:  # tools are rendered by a jinja template (the tiny tokenizer has none)
        (tmp_path / "t.jinja").write_text(TEMPLATE)
        common += ["--chat_template", str(tmp_path / "t.jinja")]
    if script == "run_finetune.py":
        common += [
            "--dataset_name_or_path",
            path,
            "--eval_before_train",
            "false",
            "--max_length",
            "512",
            "--src_length",
            "256",
        ]
    else:
        common += ["--train_dataset_path", path, "--max_seq_len", "512", "--max_prompt_len", "256"]
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "llm", script), os.path.join(ROOT, config), *common],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    train = json.loads((tmp_path / "out" / "run_summary.json").read_text())["data"]["train"]
    assert train.get("examples", train.get("pairs")) == {"alpaca_en_demo.json": 999}.get(name, 300)
