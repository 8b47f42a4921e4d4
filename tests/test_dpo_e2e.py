"""End-to-end DPO: drive llm/run_dpo.py on the tiny model and check numbers and files."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from preference_cli import TINY, cli_runner, max_weight_diff, resume_from_copy, train_logs

# end-to-end through the CLI: `make test-slow` (CI runs it after `make test`)
pytestmark = pytest.mark.slow

MERGE_CLI = os.path.join(ROOT, "llm", "merge_lora_params.py")
DPO_DATA = os.path.join(ROOT, "llm", "data", "dpo_tiny")
LORA_CONFIG = "llm/config/tiny/dpo_lora_argument.json"
FULL_CONFIG = "llm/config/tiny/dpo_argument.json"


run_dpo = cli_runner("run_dpo.py", DPO_DATA)


METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@pytest.mark.parametrize(
    "loss_type,expected",
    [
        ("sigmoid", math.log(2.0)),  # -log sigmoid(0)
        ("hinge", 1.0),  # relu(1 - 0)
        ("ipo", (1 / (2 * 0.1)) ** 2),  # (0 - 1/(2 beta))^2 = 25
    ],
)
def test_first_loss_at_initialization(tiny_model_dir, tmp_path, loss_type, expected):
    """Step 1's forward sees policy == reference (the LR schedule starts at 0 during warmup and
    the first logged loss is step 1's forward anyway): the loss is the formula at logits = 0."""
    out = tmp_path / loss_type
    run_dpo(
        LORA_CONFIG, out, "--loss_type", loss_type, "--max_steps", "2", "--logging_steps", "1", "--do_eval", "false"
    )
    first = train_logs(out)[0]
    assert abs(first["loss"] - expected) < 1e-4, first
    assert abs(first["rewards/margins"]) < 1e-6 and abs(first["rewards/chosen"]) < 1e-6
    for key in METRICS:
        assert key in first, key


def test_lora_dpo_learns_preferences_and_merges(tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    r = run_dpo(LORA_CONFIG, out)  # 40 steps, batch 8, lr 1e-2
    logs = train_logs(out)
    assert len(logs) == 40 and abs(logs[0]["loss"] - math.log(2)) < 1e-4
    assert logs[-1]["rewards/accuracies"] >= 0.9 and logs[-1]["loss"] < 0.1
    assert logs[-1]["rewards/margins"] > 1.0
    ev = json.loads((out / "eval_results.json").read_text())
    for key in METRICS:
        assert f"eval_{key}" in ev, key
    s = json.loads((out / "run_summary.json").read_text())
    assert s["method"] == "lora" and s["reference"] == "adapters" and s["loss_type"] == "sigmoid"
    assert (out / "adapter_model.safetensors").exists() and not list(out.glob("model*.safetensors"))
    assert "reward accuracy" in r.stdout
    merged = tmp_path / "merged"
    m = subprocess.run(
        [
            sys.executable,
            MERGE_CLI,
            "--model_name_or_path",
            TINY,
            "--lora_path",
            str(out),
            "--merge_model_path",
            str(merged),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert m.returncode == 0, m.stdout[-3000:] + m.stderr[-3000:]  # 0 includes the --verify check
    assert list(merged.glob("model*.safetensors")) and not (merged / "MERGE_VERIFY_FAILED").exists()


def test_full_dpo_learns_with_frozen_reference_copy(tiny_model_dir, tmp_path):
    out = tmp_path / "full"
    run_dpo(FULL_CONFIG, out, "--do_eval", "false")
    logs = train_logs(out)
    assert abs(logs[0]["loss"] - math.log(2)) < 1e-4
    assert logs[-1]["rewards/accuracies"] >= 0.9
    s = json.loads((out / "run_summary.json").read_text())
    assert s["method"] == "full" and s["reference"] == "copy" and s["trainable_params"] == s["total_params"]
    assert (out / "model.safetensors").exists()


def test_packed_flashmask_lora_dpo_trains(tiny_model_dir, tmp_path):
    out = tmp_path / "packed"
    run_dpo(
        LORA_CONFIG,
        out,
        "--zero_padding",
        "true",
        "--use_flash_attention",
        "true",
        "--flash_mask",
        "true",
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "20",
        "--do_eval",
        "false",
    )
    logs = train_logs(out)
    assert abs(logs[0]["loss"] - math.log(2)) < 1e-4
    assert logs[-1]["loss"] < 0.5 * logs[0]["loss"]
    s = json.loads((out / "run_summary.json").read_text())
    assert s["data"]["train"]["packing"] == "in_order"


def test_config_errors_exit_2(tiny_model_dir, tmp_path):
    r = run_dpo(
        LORA_CONFIG,
        tmp_path / "bad",
        "--beta",
        "0",
        "--label_smoothing",
        "0.7",
        "--loss_type",
        "nope",
        "--max_length",
        "512",
        "--src_length",
        "128",
        "--ref_model_update_steps",
        "5",
        check=False,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr
    assert "beta: must be > 0.0" in err
    assert "label_smoothing must be in [0, 0.5)" in err
    assert "loss_type: must be one of" in err
    assert "'max_length' is a fine-tuning" in err and "use max_seq_len instead" in err
    assert "use max_prompt_len instead" in err
    assert "ref_model_update_steps=5 needs full fine-tuning" in err
    assert not (tmp_path / "bad").exists()  # nothing was loaded or written
    r = run_dpo(
        FULL_CONFIG,
        tmp_path / "bad2",
        "--train_dataset_path",
        tmp_path / "missing.jsonl",
        "--reference_free",
        "true",
        "--loss_type",
        "kto_pair",
        "--max_prompt_len",
        "600",
        check=False,
    )
    assert r.returncode == 2
    assert "missing.jsonl" in r.stderr and "does not exist" in r.stderr
    assert "loss_type 'kto_pair' needs the reference model" in r.stderr
    assert "max_prompt_len (600) must be < max_seq_len (512)" in r.stderr


def test_run_finetune_points_dpo_keys_to_run_dpo(tiny_model_dir, tmp_path):
    from paddlenlp_ext.config.parse import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(
            os.path.join(ROOT, "llm/config/tiny/lora_argument.json"), ["--output_dir", str(tmp_path), "--beta", "0.2"]
        )
    assert "llm/run_dpo.py" in e.value.report()


def test_adapters_disabled_gives_the_base_model():
    import numpy as np
    import paddle

    from paddlenlp_ext.adapters import AdapterConfig, adapters_disabled, apply_adapters, iter_adapter_layers

    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 4))
    x = paddle.randn([3, 8])
    base = model(x).numpy()
    apply_adapters(model, AdapterConfig(method="lora", r=2, alpha=4, target_modules=[".*"]))
    for _, layer in iter_adapter_layers(model):
        layer.lora_B.set_value(paddle.full(layer.lora_B.shape, 0.5))
    assert np.abs(model(x).numpy() - base).max() > 1e-3
    with adapters_disabled(model):
        np.testing.assert_allclose(model(x).numpy(), base, rtol=1e-6, atol=1e-6)
    assert np.abs(model(x).numpy() - base).max() > 1e-3  # back on after the block


def test_lazy_packed_stream_resumes_like_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """lazy: true (PaddleNLP's flashmask dpo.json) streams the pairs; resuming from a checkpoint seeks
    the stream to its stored cursor, so steps 7..12 see the same rows and end at the same adapter."""
    common = (
        "--lazy",
        "true",
        "--greedy_zero_padding",
        "true",
        "--use_flash_attention",
        "true",
        "--flash_mask",
        "true",
        "--max_seq_len",
        "256",
        "--max_prompt_len",
        "128",
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "12",
        "--save_strategy",
        "steps",
        "--save_steps",
        "6",
        "--do_eval",
        "false",
        "--warmup_steps",
        "0",
    )
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    a, b = resume_from_copy(run_dpo, LORA_CONFIG, full, resumed, 6, *common)
    assert (full / "checkpoint-6" / "data_state.json").exists()
    assert [h["step"] for h in b][-1] == 12
    assert b[-1]["loss"] == pytest.approx(a[-1]["loss"], rel=1e-5)
    assert max_weight_diff(full, resumed, "adapter_model.safetensors") < 1e-6
    summary = json.loads((full / "run_summary.json").read_text())
    assert summary["data"]["train"]["lazy"] and summary["pairs_trained"] > 12 * 2  # several pairs per row
