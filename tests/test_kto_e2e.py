"""End-to-end KTO: drive llm/run_kto.py on the tiny model and check numbers, metrics and exit codes."""

import json
import os

import pytest

from conftest import ROOT
from preference_cli import cli_runner, train_logs

# end-to-end through the CLI: `make test-slow`
pytestmark = pytest.mark.slow

KTO_DATA = os.path.join(ROOT, "llm", "data", "kto_tiny")
METRICS = (
    "kl",
    "kto_loss",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
    "loss/chosen",
    "loss/rejected",
)


run_kto = cli_runner("run_kto.py", KTO_DATA)


def test_lora_kto_starts_at_the_closed_form_and_learns(tiny_model_dir, tmp_path):
    """Step 1 sees policy == reference (LoRA B = 0): z0 = 0 and every example's loss is weight / 2,
    so with both weights 1.5 the first loss is 0.75 whatever the batch's labels."""
    out = tmp_path / "lora"
    run_kto(
        "llm/config/tiny/kto_lora_argument.json",
        out,
        "--max_steps",
        "12",
        "--desirable_weight",
        "1.5",
        "--undesirable_weight",
        "1.5",
    )
    logs = train_logs(out)
    first, last = logs[0], logs[-1]
    assert abs(first["loss"] - 0.75) < 1e-5, first
    assert first["kl"] == 0.0 and abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/rejected"]) < 1e-6
    for key in METRICS:
        assert key in first and key in last, key
    assert min(h["loss"] for h in logs[-3:]) < first["loss"] - 0.1, [h["loss"] for h in logs]
    s = json.loads((out / "run_summary.json").read_text())
    assert s["loss_type"] == "kto" and s["reference"] == "adapters"
    assert s["data"]["train"]["desirable"] == 32 and s["data"]["train"]["undesirable"] == 32
    assert s["eval"]["eval_rewards/chosen"] > s["eval"]["eval_rewards/rejected"], s["eval"]
    assert (out / "adapter_model.safetensors").exists() or (out / "adapter_config.json").exists()


def test_full_kto_packed_with_flashmask_and_frozen_reference_copy(tiny_model_dir, tmp_path):
    out = tmp_path / "full"
    run_kto(
        "llm/config/tiny/kto_argument.json",
        out,
        "--max_steps",
        "8",
        "--do_eval",
        "false",
        "--use_flash_attention",
        "true",
        "--flash_mask",
        "true",
        "--per_device_train_batch_size",
        "2",
    )
    logs = train_logs(out)
    assert abs(logs[0]["loss"] - 0.5) < 1e-5, logs[0]
    assert logs[-1]["loss"] < logs[0]["loss"], [h["loss"] for h in logs]
    s = json.loads((out / "run_summary.json").read_text())
    assert s["reference"] == "copy" and s["data"]["train"]["packing"] == "in_order"
    assert s["data"]["train"]["rows"] < s["data"]["train"]["pairs"]  # several examples per row


def test_bad_data_and_config_exit_2(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "label": True}
    bad.write_text(
        "\n".join(json.dumps(x) for x in (good, {**good, "label": "true"}, {"messages": good["messages"]})) + "\n"
    )
    r = run_kto(
        "llm/config/tiny/kto_lora_argument.json",
        tmp_path / "o1",
        "--train_dataset_path",
        bad,
        "--do_eval",
        "false",
        check=False,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{bad}:2: 'label' must be the JSON boolean true or false" in r.stderr
    assert f"{bad}:3: missing key 'label'" in r.stderr
    r = run_kto(
        "llm/config/tiny/kto_lora_argument.json",
        tmp_path / "o2",
        "--loss_type",
        "sigmoid",
        "--undesirable_weight",
        "-1",
        check=False,
    )
    assert r.returncode == 2
    assert "'loss_type' is a DPO (llm/run_dpo.py) key" in r.stderr and "undesirable_weight" in r.stderr
    assert not (tmp_path / "o2").exists()
