"""Training into an output_dir that holds an earlier run (docs/reliability.md, "Re-running into an output_dir").

Fast: the config-time rule (refused naming the directory, the checkpoint and the two keys;
resume / overwrite / eval-only allowed), what ``overwrite_output_dir`` removes, the console's
last-step progress line and live bar.  Slow: the real CLI run twice, refused, then started over.
"""

import io
import json
import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import DATA_DIR, ROOT
from test_reliability import cfg_file  # noqa: F401  (the fixture: a LoRA config into tmp_path/o)
from paddlenlp_ext.config.output_dir import earlier_run_entries, earlier_run_problems
from paddlenlp_ext.config.parse import ConfigError, load_config
from paddlenlp_ext.training import console as con
from paddlenlp_ext.training.callbacks import ConsoleProgress
from paddlenlp_ext.training.logfile import clear_earlier_run, run_logging


def earlier_run(out, steps=(5, 10), summary=True, complete=True):
    out.mkdir(parents=True, exist_ok=True)
    for step in steps:
        d = out / f"checkpoint-{step}"
        d.mkdir(parents=True)
        if complete:
            (d / "CHECKPOINT_COMPLETE").write_text(f"global_step {step}\n")
    (out / "resolved_config.json").write_text("{}")
    if summary:
        (out / "run_summary.json").write_text("{}")
    (out / "loss.png").write_bytes(b"png")


def test_training_into_an_earlier_run_is_refused_naming_dir_checkpoint_and_keys(tmp_path, cfg_file):
    earlier_run(tmp_path / "o")
    with pytest.raises(ConfigError) as e:
        load_config(cfg_file)
    msg = e.value.report()
    assert (
        f"output_dir {str(tmp_path / 'o')!r} ({tmp_path / 'o'}) already holds a run (checkpoint-5, checkpoint-10, "
        "run_summary.json)" in msg
    )
    assert "resume_from_checkpoint: true to continue from checkpoint-10" in msg
    assert "overwrite_output_dir: true to start over" in msg


def test_resume_overwrite_and_eval_only_are_allowed(tmp_path, cfg_file):
    earlier_run(tmp_path / "o")
    assert load_config(cfg_file, ["--resume_from_checkpoint", "true"]).training["resume_from_checkpoint"] == str(
        tmp_path / "o" / "checkpoint-10"
    )
    assert load_config(cfg_file, ["--overwrite_output_dir", "true"]).training["overwrite_output_dir"] is True
    assert load_config(cfg_file, ["--do_train", "false", "--do_eval", "true"]).training["do_train"] is False
    both = load_config(cfg_file, ["--overwrite_output_dir", "true", "--resume_from_checkpoint", "true"])
    assert both.training["overwrite_output_dir"] is False  # the resume wins, as in PaddleNLP: nothing is removed
    assert both.training["resume_from_checkpoint"] == str(tmp_path / "o" / "checkpoint-10")
    assert "resume_from_checkpoint continues the earlier run" in both.derived["overwrite_output_dir"]


def test_only_results_or_only_incomplete_checkpoints_still_count(tmp_path):
    out = tmp_path / "o"
    earlier_run(out, steps=(), summary=True)
    t = {"output_dir": str(out), "do_train": True}
    [msg] = earlier_run_problems(t, "c.json")
    assert "(run_summary.json)" in msg and "holds no complete checkpoint to continue from" in msg
    (out / "run_summary.json").unlink()
    assert earlier_run_problems(t, "c.json") == []  # resolved_config.json alone: a run that failed before training
    earlier_run(tmp_path / "p", steps=(3,), summary=False, complete=False)
    [msg] = earlier_run_problems({"output_dir": str(tmp_path / "p"), "do_train": True}, "c.json")
    assert "(checkpoint-3 (incomplete))" in msg


def test_overwrite_removes_the_earlier_run_and_says_so(tmp_path, cfg_file):
    out = tmp_path / "o"
    earlier_run(out)
    (out / "train.log").write_text("old run\n")
    assert earlier_run_entries(str(out)) == [
        "checkpoint-10",
        "checkpoint-5",
        "loss.png",
        "resolved_config.json",
        "run_summary.json",
        "train.log",
    ]
    cfg = load_config(cfg_file, ["--overwrite_output_dir", "true"])
    stream = io.StringIO()
    with run_logging(cfg, stream=stream):
        pass
    assert sorted(os.listdir(out)) == ["train.log"]
    log = (out / "train.log").read_text()
    assert "old run" not in log
    assert (
        "overwrite_output_dir removed: checkpoint-10, checkpoint-5, loss.png, resolved_config.json, "
        "run_summary.json, train.log" in log
    )
    assert (
        f"overwrite_output_dir: removed the earlier run from {out}: checkpoint-10, checkpoint-5, 4 other files "
        "of it (train.log lists them)" in stream.getvalue()
    )


def test_overwrite_in_a_directory_not_written_by_us_keeps_other_files(tmp_path):
    out = tmp_path / "mine"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    cfg = SimpleNamespace(training={"output_dir": str(out), "do_train": True, "overwrite_output_dir": True})
    assert clear_earlier_run(cfg, rank=1) == [] and (out / "checkpoint-4").is_dir()  # not the main process
    assert clear_earlier_run(cfg, rank=0) == ["checkpoint-4"]
    assert os.listdir(out) == ["notes.txt"]


def test_shipped_tiny_configs_start_over_when_re_run():
    for name in sorted(os.listdir(os.path.join(ROOT, "llm/config/tiny"))):
        with open(os.path.join(ROOT, "llm/config/tiny", name)) as f:
            assert json.load(f).get("overwrite_output_dir") is True, name


# -- progress lines of a run shorter than logging_steps ------------------------------------------------
class Terminal(io.StringIO):
    encoding = "utf-8"

    def isatty(self):
        return True


def test_last_step_always_logs_and_the_bar_shows_the_logged_loss():
    term = Terminal()
    c = con.Console(stream=term, file_logger=logging.getLogger("test_output_dir.null"))
    c.bar = True
    progress = ConsoleProgress(c, tokens=lambda: 100)
    args = SimpleNamespace(logging_strategy=SimpleNamespace(value="steps"))
    state = SimpleNamespace(global_step=0, max_steps=3, is_world_process_zero=True)
    progress.on_train_begin(args, state, None)
    for step in (1, 2, 3):
        state.global_step = step
        control = SimpleNamespace(should_log=False)
        progress.on_step_end(args, state, control)
        assert control.should_log is (step == 3)  # logging_steps 10 > max_steps 3: the last step logs
    progress.on_log(args, state, None, logs={"loss": 1.2345, "learning_rate": 1e-3})
    out = term.getvalue()
    assert "step 3/3 (100%)  loss 1.2345" in out
    assert out.rstrip("\x1b[K").endswith("loss 1.2345 0:00<0:00")  # the bar after the line: this step's loss
    no_log = SimpleNamespace(should_log=False)
    progress.on_step_end(SimpleNamespace(logging_strategy="no"), state, no_log)
    assert no_log.should_log is False  # logging_strategy "no" stays silent


CLI = os.path.join(ROOT, "llm", "run_finetune.py")


@pytest.mark.slow
def test_cli_run_twice_is_refused_then_overwrite_starts_over(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        CLI,
        os.path.join(ROOT, "llm/config/tiny/lora_argument.json"),
        "--output_dir",
        str(out),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name_or_path",
        DATA_DIR,
        "--max_steps",
        "3",
        "--logging_steps",
        "10",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--do_eval",
        "false",
        "--per_device_train_batch_size",
        "4",
        "--overwrite_output_dir",
        "false",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert re.search(r"^step 3/3 \(100%\)  loss \d+\.\d{4}", first.stdout, re.M), first.stdout
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2"]
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 2, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"({out}) already holds a run (checkpoint-2, run_summary.json)" in again.stderr + again.stdout
    cmd[cmd.index("--overwrite_output_dir") + 1] = "true"
    cmd[cmd.index("--save_strategy") + 1] = "no"
    over = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert over.returncode == 0, over.stdout[-3000:] + over.stderr[-3000:]
    assert re.search(
        rf"overwrite_output_dir: removed the earlier run from {re.escape(str(out))}: checkpoint-2, "
        r"\d+ other files of it",
        over.stdout,
    ), over.stdout
    assert not [n for n in os.listdir(out) if n.startswith("checkpoint-")]  # a later resume cannot pick them up


def test_loss_plot_with_one_logged_loss_draws_a_dot_and_says_why(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from paddlenlp_ext.training.plot import write_loss_plot

    notes, markers = [], []
    text, plot = Axes.text, Axes.plot
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **k: notes.append(s) or text(self, x, y, s, *a, **k))
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **k: markers.append(k.get("marker")) or plot(self, *a, **k))
    write_loss_plot(str(tmp_path / "one.png"), {3: 7.5}, {})
    assert notes == ["one train loss logged (step 3): lower logging_steps for a curve"] and markers == ["o"]
    notes.clear(), markers.clear()
    write_loss_plot(str(tmp_path / "two.png"), {3: 7.5, 6: 7.0}, {})
    assert notes == [] and markers == [None]
