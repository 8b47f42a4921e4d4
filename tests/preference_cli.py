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
    cmd = [sys.executable, cli, os.path.join(ROOT, config), "--output_dir", str(out), "--model_name_or_path", TINY,
           "--train_dataset_path", data, "--dev_dataset_path", data, *map(str, overrides)]
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
