"""Interruptions and bad files through the real scripts (docs/reliability.md).

A 20-step LoRA run of the tiny model is the reference; it is killed with SIGKILL right after
checkpoint-10 and resumed with ``resume_from_checkpoint: true``, and stopped with SIGTERM mid-run
and resumed with the command it prints.  Both must reproduce the reference's losses and train loss.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import DATA_DIR, ROOT

# end-to-end through the CLI (about 90 s): `make test-slow`
pytestmark = pytest.mark.slow

CLI = os.path.join(ROOT, "llm", "run_finetune.py")
DPO_CLI = os.path.join(ROOT, "llm", "run_dpo.py")
TINY = os.path.join(ROOT, "build", "tiny-llama")
# steps of ~0.1-0.2 s: a kill right after a checkpoint lands well before the end of the run
RUN = [
    "--max_steps",
    "20",
    "--per_device_train_batch_size",
    "8",
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
    "--model_name_or_path",
    TINY,
    "--dataset_name_or_path",
    DATA_DIR,
]


def command(out, *extra):
    return [
        sys.executable,
        CLI,
        os.path.join(ROOT, "llm/config/tiny/lora_argument.json"),
        *RUN,
        "--output_dir",
        str(out),
        *map(str, extra),
    ]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def start_and_wait_for(cmd, path, timeout=300):
    """Start ``cmd`` and return (process, seconds waited) once ``path`` exists."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    t0 = time.time()
    while not os.path.exists(path):
        if p.poll() is not None:
            out, err = p.communicate()
            pytest.fail(f"the run ended (rc {p.returncode}) before {path} appeared:\n{out[-2000:]}{err[-4000:]}")
        if time.time() - t0 > timeout:
            p.kill()
            pytest.fail(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)
    return p


def history(out):
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def step_losses(out):
    return {h["step"]: h["loss"] for h in history(out) if "loss" in h}


def summary(out):
    return json.loads((out / "run_summary.json").read_text())


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "out"
    run(command(out, "--save_steps", "10"))
    return out


def assert_same_run(out, ref):
    mine, theirs = step_losses(out), step_losses(ref)
    assert sorted(mine) == list(range(1, 21)), sorted(mine)  # the whole log history, the resumed part included
    for step in range(1, 21):
        assert abs(mine[step] - theirs[step]) <= 1e-6, (step, mine[step], theirs[step])
    a, b = summary(out), summary(ref)
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
    assert a["tokens_trained"] == b["tokens_trained"] and a["global_steps"] == 20


def test_kill_9_after_checkpoint_10_then_resume_true(reference, tmp_path):
    out = tmp_path / "out"
    p = start_and_wait_for(command(out, "--save_steps", "10"), out / "checkpoint-10" / "CHECKPOINT_COMPLETE")
    p.send_signal(signal.SIGKILL)
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    assert not (out / "checkpoint-20").exists(), "the run finished before it was killed; the test needs slower steps"
    # a checkpoint cut short by a kill (no CHECKPOINT_COMPLETE) must be skipped by resume_from_checkpoint=true
    shutil.copytree(out / "checkpoint-10", out / "checkpoint-15", ignore=shutil.ignore_patterns("CHECKPOINT_COMPLETE"))
    r = run(command(out, "--save_steps", "10", "--resume_from_checkpoint", "true"))
    log = r.stdout + r.stderr
    # the derived setting is logged with its note (config.resume)
    assert (
        f"{out / 'checkpoint-10'} (the newest complete checkpoint in output_dir (skipped, cut short while "
        f"being written: {out / 'checkpoint-15'}))" in log
    ), log[-3000:]
    assert_same_run(out, reference)
    assert not [n for n in os.listdir(out) if n.startswith(".saving-")]
    # train_time_s spans the whole run, wall_time_s this process: the summary says how much came before
    s = summary(out)
    assert 0 < s["train_time_before_resume_s"] < s["train_time_s"]
    assert "of it before the resume), this process" in r.stdout


def test_sigterm_mid_run_saves_and_prints_the_resume_command(reference, tmp_path):
    out = tmp_path / "out"
    p = start_and_wait_for(command(out, "--save_steps", "5"), out / "checkpoint-5" / "CHECKPOINT_COMPLETE")
    time.sleep(0.3)  # inside a later step, between the scheduled checkpoints
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate()
    assert p.returncode == 128 + signal.SIGTERM, stdout[-2000:] + stderr[-4000:]
    assert "Traceback" not in stderr
    line = stderr.splitlines()[
        stderr.splitlines().index(next(x for x in stderr.splitlines() if "Resume with:" in x)) + 1
    ]
    resume = shlex.split(line.strip())
    ckpt = resume[-1]
    step = int(ckpt.rsplit("-", 1)[1])
    assert (
        resume[-2] == "--resume_from_checkpoint"
        and 5 <= step < 20
        and os.path.isfile(os.path.join(ckpt, "CHECKPOINT_COMPLETE"))
    ), line
    assert not (out / "run_summary.json").exists()  # an interrupted run does not pose as finished
    run(resume)  # the printed command, as the user would paste it
    assert_same_run(out, reference)


def test_resume_with_changed_max_length_is_refused(reference, tmp_path):
    r = subprocess.run(
        command(tmp_path / "o", "--max_length", "256", "--resume_from_checkpoint", reference / "checkpoint-10"),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "max_length: checkpoint 128, now 256" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("script", ["sft", "dpo"])
def test_gbk_data_exits_2_with_the_conversion_command(tiny_model_dir, tmp_path, script):
    data = tmp_path / "data"
    data.mkdir()
    if script == "sft":
        (data / "train.json").write_bytes('{"src": "你好", "tgt": "世界"}\n'.encode("gbk"))
        cmd = command(tmp_path / "o", "--dataset_name_or_path", data)
    else:
        line = json.dumps({"src": "你好", "tgt": [], "response": ["好", "坏"], "sort": [1, 0]}, ensure_ascii=False)
        (data / "train.json").write_bytes((line + "\n").encode("gbk"))
        cmd = [
            sys.executable,
            DPO_CLI,
            os.path.join(ROOT, "llm/config/tiny/dpo_lora_argument.json"),
            "--model_name_or_path",
            TINY,
            "--train_dataset_path",
            str(data / "train.json"),
            "--do_eval",
            "false",
            "--output_dir",
            str(tmp_path / "o"),
        ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    path = data / "train.json"
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{path}:1: not UTF-8" in r.stderr and f"iconv -f gbk -t utf-8 {path}" in r.stderr
    assert "Traceback" not in r.stderr
