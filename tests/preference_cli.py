"""Shared by the DPO and KTO end-to-end tests: run a preference-training CLI on the tiny model."""

import functools
import json
import os
import subprocess
import sys

from conftest import ROOT

TINY = os.path.join(ROOT, "build", "tiny-llama")


def run_preference_cli(cli, data, config, out, *overrides, check=True):
    """``python CLI CONFIG --output_dir OUT`` on the tiny model with ``data`` as train and dev set;
    ``check``: assert exit 0 (the message shows the output's tail)."""
    cmd = [
        sys.executable,
        cli,
        os.path.join(ROOT, config),
        "--output_dir",
        str(out),
        "--model_name_or_path",
        TINY,
        "--train_dataset_path",
        data,
        "--dev_dataset_path",
        data,
        *map(str, overrides),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def cli_runner(script, data):
    """``run(config, out, *overrides, check=True)`` for ``llm/<script>`` on ``data``."""
    return functools.partial(run_preference_cli, os.path.join(ROOT, "llm", script), data)


def train_logs(out):
    """The training log records (those with a loss) of a run's trainer_state.json."""
    state = json.loads((out / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


def resume_from_copy(run, config, whole, resumed, step, *common):
    """Run ``config`` whole, copy its ``checkpoint-<step>`` into a fresh ``resumed`` dir and resume
    there with the same ``common`` overrides.  -> (whole's train logs, resumed's train logs)."""
    import shutil

    run(config, whole, *common)
    resumed.mkdir()
    shutil.copytree(whole / f"checkpoint-{step}", resumed / f"checkpoint-{step}")
    run(config, resumed, *common, "--resume_from_checkpoint", resumed / f"checkpoint-{step}")
    return train_logs(whole), train_logs(resumed)


def max_weight_diff(a_dir, b_dir, name):
    """Largest absolute difference between the tensors of ``name`` in two output dirs."""
    from safetensors.numpy import load_file

    wa, wb = load_file(str(a_dir / name)), load_file(str(b_dir / name))
    return max(float(abs(wa[k] - wb[k]).max()) for k in wa)
