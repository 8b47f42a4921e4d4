"""eval_accuracy, best-model reload and the atomic final save (training/trainer, integrations/trainer)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from paddlenlp_ext.training.trainer import FinetuneTrainer, TokenAccuracy

from conftest import DATA_DIR, ROOT

CLI = os.path.join(ROOT, "llm", "run_finetune.py")


def test_token_accuracy_worked_example_and_random_batches():
    acc = TokenAccuracy()
    logits = paddle.to_tensor(np.eye(8, dtype="float32")[[[3, 7, 1]]])  # argmax [[3, 7, 1]]
    acc.update(logits, paddle.to_tensor([[-100, 7, 2]]))
    assert (acc.correct, acc.total) == (1, 2) and acc.compute() == 0.5
    acc.reset()
    assert acc.compute() is None  # no label positions: no metric rather than a made-up 0
    rng = np.random.default_rng(0)
    correct = total = 0
    for _ in range(3):  # accumulates over batches exactly as one pass over all predictions would
        lg = rng.standard_normal((2, 5, 11)).astype("float32")
        lb = rng.integers(0, 11, (2, 5))
        lb[rng.random((2, 5)) < 0.3] = -100
        acc.update(paddle.to_tensor(lg), paddle.to_tensor(lb))
        m = lb != -100
        correct += int(((lg.argmax(-1) == lb) & m).sum())
        total += int(m.sum())
    assert acc.compute() == pytest.approx(correct / total)


def test_interrupted_save_leaves_the_previous_files(tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"old weights")

    def write_then_die(directory):
        with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt

    fake = SimpleNamespace(_write_weights=write_then_die)
    with pytest.raises(KeyboardInterrupt):
        FinetuneTrainer.save_weights(fake, str(tmp_path))
    assert (tmp_path / "adapter_model.safetensors").read_bytes() == b"old weights"
    assert os.listdir(tmp_path) == ["adapter_model.safetensors"]  # no staging directory left

    def write_new(directory):
        with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
            f.write(b"new weights")

    FinetuneTrainer.save_weights(SimpleNamespace(_write_weights=write_new), str(tmp_path))
    assert (tmp_path / "adapter_model.safetensors").read_bytes() == b"new weights"


def test_paddlenlp_writer_final_save_is_staged_too(tmp_path):
    """Full fine-tuning with unified_checkpoint: PaddleNLP writes the files; in one process its final
    save goes through the same staging (checkpoints and multi-process saves stay in place)."""
    (tmp_path / "model.safetensors").write_bytes(b"old")

    def die(directory):
        (open(os.path.join(directory, "model.safetensors"), "wb")).write(b"partial")
        raise RuntimeError("killed")

    one = SimpleNamespace(args=SimpleNamespace(world_size=1, unified_checkpoint_config=""))
    with pytest.raises(RuntimeError):
        FinetuneTrainer.save_foreign(one, str(tmp_path), die)
    assert (tmp_path / "model.safetensors").read_bytes() == b"old" and os.listdir(tmp_path) == ["model.safetensors"]
    written = []
    FinetuneTrainer.save_foreign(one, str(tmp_path / "checkpoint-5"), written.append)
    many = SimpleNamespace(args=SimpleNamespace(world_size=2, unified_checkpoint_config=""))
    FinetuneTrainer.save_foreign(many, str(tmp_path), written.append)
    assert written == [str(tmp_path / "checkpoint-5"), str(tmp_path)]  # in place


def run_cli(tmp_path, name, *overrides):
    out = tmp_path / name
    cmd = [
        sys.executable,
        CLI,
        os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json"),
        "--output_dir",
        str(out),
        "--model_name_or_path",
        os.path.join(ROOT, "build", "tiny-llama"),
        "--dataset_name_or_path",
        DATA_DIR,
        "--eval_before_train",
        "false",
        *map(str, overrides),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r, out


@pytest.mark.parametrize(
    "method,extra",
    [
        ("lora", ["--unified_checkpoint", "true"]),
        ("full", ["--lora", "false", "--learning_rate", "1e-3"]),
    ],
)
def test_best_checkpoint_is_reloaded_not_the_last(tiny_model_dir, tmp_path, method, extra):
    """Choosing the *highest* eval loss makes the first checkpoint the best one (training lowers the
    loss), so the final weights must be step 4's, not step 12's."""
    r, out = run_cli(
        tmp_path,
        method,
        "--max_steps",
        "12",
        "--per_device_train_batch_size",
        "8",
        "--evaluation_strategy",
        "steps",
        "--save_strategy",
        "steps",
        "--eval_steps",
        "4",
        "--save_steps",
        "4",
        "--load_best_model_at_end",
        "true",
        "--metric_for_best_model",
        "loss",
        "--greater_is_better",
        "true",
        "--save_total_limit",
        "1",
        *extra,
    )
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"].endswith("checkpoint-4")
    evals = {h["step"]: h for h in state["log_history"] if "eval_loss" in h}
    assert evals[12]["eval_loss"] < evals[4]["eval_loss"] - 1e-3  # the last is really different
    final = json.loads((out / "eval_results.json").read_text())
    assert final["eval_loss"] == pytest.approx(evals[4]["eval_loss"], rel=1e-6)
    assert "eval_accuracy" in final
    if method == "lora":
        # the adapter left in output_dir is the best one: evaluating it alone gives the same loss
        _, again = run_cli(tmp_path, "again", "--lora_path", out, "--do_train", "false")
        s = json.loads((again / "run_summary.json").read_text())
        assert s["eval_loss"] == pytest.approx(evals[4]["eval_loss"], rel=1e-5)
