"""The training console and logs (docs/logging.md): formats, the loss plot, train.log routing,
and a real CLI run whose output_dir holds train.log, VisualDL records and loss.png."""

import glob
import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from conftest import DATA_DIR, ROOT
from paddlenlp_ext.config.parse import ConfigError
from paddlenlp_ext.training import console as con
from paddlenlp_ext.training.logfile import console_level, is_library_file, run_logging

CLI = os.path.join(ROOT, "llm", "run_finetune.py")
DPO_CLI = os.path.join(ROOT, "llm", "run_dpo.py")
PROGRESS = re.compile(
    r"^step +(\d+)/(\d+) \( *\d+%\)  loss \d+\.\d{4}  lr \S+  (?:[a-z ]+ \d\.\d{4}  )?"
    r"[\d,]+ tok/s  elapsed \d+:\d\d  ETA \d+:\d\d$"
)  # DPO adds "reward acc 0.6250"


# -- formats --------------------------------------------------------------------
@pytest.mark.parametrize(
    "seconds,text",
    [(0, "0:00"), (47.4, "0:47"), (61, "1:01"), (3723, "1:02:03"), (None, "?"), (float("inf"), "?"), (-1, "?")],
)
def test_format_duration(seconds, text):
    assert con.format_duration(seconds) == text


def test_eta_is_the_remaining_steps_at_the_average_pace():
    assert con.eta_seconds(elapsed=10.0, steps_done=5, steps_left=15) == pytest.approx(30.0)
    assert con.eta_seconds(elapsed=10.0, steps_done=5, steps_left=0) == 0.0
    assert con.eta_seconds(elapsed=0.0, steps_done=0, steps_left=10) is None  # nothing measured yet


def test_bar_fills_in_eighths_and_keeps_its_width():
    assert con.format_bar(0.5, 4, ascii_only=True) == "##  "
    assert con.format_bar(1.0, 4, ascii_only=True) == "####"
    assert con.format_bar(0.0, 4) == "    "
    assert con.format_bar(1.0, 4) == "\u2588" * 4
    assert con.format_bar(0.625, 4) == "\u2588\u2588\u258c "  # 2.5 of 4 cells
    assert con.format_bar(0.5625, 4) == "\u2588\u2588\u258e "  # 2.25: a quarter block
    assert con.format_bar(2.0, 3, ascii_only=True) == "###" and con.format_bar(-1, 3) == "   "
    for f in (0.0, 0.013, 0.37, 0.999, 1.0):
        assert len(con.format_bar(f, 17)) == 17


def test_progress_line_and_bar():
    line = con.progress_line(10, 150, 7.17771988, 0.01, 4582.7, elapsed=4.2, eta=58.8)
    assert line == "step  10/150 (  7%)  loss 7.1777  lr 1.00e-02  4,583 tok/s  elapsed 0:04  ETA 0:59"
    assert PROGRESS.match(line)
    dpo = con.progress_line(4, 40, 0.3, 0.003, 900.0, 2.0, 18.0, {"reward acc": 0.625})
    assert "lr 3.00e-03  reward acc 0.6250  900 tok/s" in dpo
    for columns in (40, 80, 200):
        bar = con.progress_bar(42, 150, elapsed=13, eta=35, loss=1.23456, columns=columns)
        assert len(bar) <= columns - 1 and bar.endswith(" 28% loss 1.2346 0:13<0:35"), bar
        assert bar.startswith(" 42/150 |" if columns > 40 else " 42/150  "), bar  # narrow: no bar
    assert len(con.progress_bar(42, 150, 13, 35, 1.2, columns=200)) < 80  # the bar is at most 40 cells
    assert "loss -" in con.progress_bar(1, 10, 1, None, None, ascii_only=True)


def test_config_line_for_fine_tuning_and_dpo_reports():
    sft = {
        "train": {"examples": 2000, "tokens": 191781, "packing": "none", "padding_ratio": 0.101072},
        "dev": {"examples": 64, "tokens": 6290},
    }
    assert con.config_line("build/tiny-llama", "lora", 18688, 176704, sft) == (
        "model tiny-llama | lora | trainable 18,688 / 176,704 (10.58%) | train 2,000 examples, 191,781 tokens"
        " | dev 64 | packing none, padding 10.1%"
    )
    dpo = {"train": {"pairs": 32, "tokens": 5118, "packing": "in_order", "padding_ratio": 0.167}}
    assert con.config_line("m/", "full", 5, 5, dpo).endswith(
        "train 32 pairs, 5,118 tokens | packing in_order, padding 16.7%"
    )
    dpo["train"].update(truncated_examples=3, dropped_examples=0)  # the truncation policy's counts
    assert "train 32 pairs, 5,118 tokens, 3 truncated, 0 dropped | packing" in con.config_line("m/", "full", 5, 5, dpo)


def test_final_table_fine_tuning_and_dpo():
    sft = {
        "train_loss": 2.1612,
        "global_steps": 150,
        "eval_loss": 0.7063,
        "eval_loss_before_train": 7.5299,
        "eval_perplexity": 2.0266,
        "eval_accuracy": 0.902,
        "train_time_s": 50.2,
        "wall_time_s": 58.0,
        "tokens_trained": 229993,
        "peak_rss_bytes": 834666496,
    }
    rows = con.final_table(sft, "output/x", ["adapter", "loss.png"])
    text = "\n".join(rows)
    for part in (
        "train loss:    2.1612 (150 steps)",
        "eval loss:     0.7063 (before training 7.5299, perplexity 2.027)",
        "eval accuracy: 0.9020",
        "time:          train 0:50, total 0:58",
        "tokens/s:      4,582 (229,993 tokens)",
        "peak memory:   796 MiB RSS",
        "outputs:       output/x: adapter, loss.png",
    ):
        assert part in text, (part, text)
    dpo = {
        "train_loss": 0.38,
        "global_steps": 6,
        "eval": {"eval_loss": 0.79, "eval_rewards/accuracies": 0.625, "eval_rewards/margins": 0.83},
        "eval_before_train": {"eval_loss": 0.69},
        "wall_time_s": 19.0,
        "peak_rss_bytes": 3 << 30,
    }
    text = "\n".join(con.final_table(dpo, "o", []))
    assert "reward accuracy: 0.6250 (margin 0.8300)" in text and "(before training 0.6900)" in text
    assert "3.00 GiB RSS" in text and "tokens/s" not in text  # no train time: no rate


def test_outputs_list_visualdl_only_when_this_run_reports_to_it(tmp_path):
    """runs/ left by an earlier run is not this run's output when report_to is none."""
    from paddlenlp_ext.training.reporting import outputs_of

    for name in ("adapter_model.safetensors", "loss.png", "train.log"):
        (tmp_path / name).write_text("x")
    (tmp_path / "runs" / "Nov25").mkdir(parents=True)
    args = SimpleNamespace(output_dir=str(tmp_path), logging_dir=str(tmp_path / "runs" / "Nov25"), report_to=[])
    assert outputs_of(args) == ["adapter", "loss.png", "train.log", "run_summary.json"]
    args.report_to = ["visualdl"]
    assert outputs_of(args) == ["adapter", "loss.png", "train.log", "runs/ (VisualDL)", "run_summary.json"]


def test_console_draws_lines_above_the_live_bar():
    class Terminal(io.StringIO):
        encoding = "utf-8"

        def isatty(self):
            return True

    term = Terminal()
    c = con.Console(stream=term, file_logger=logging.getLogger("test_console.null"))
    c.bar = True
    c.show_bar("[bar 1]")
    c.line("step 1")
    c.show_bar("[bar 2]")
    c.close()
    assert term.getvalue() == "\r[bar 1]\x1b[K\r\x1b[Kstep 1\n[bar 1]\r[bar 2]\x1b[K\r\x1b[K"
    quiet = io.StringIO()
    other_rank = con.Console(stream=quiet, main=False, file_logger=logging.getLogger("test_console.null"))
    other_rank.line("x")
    assert quiet.getvalue() == ""


# -- the loss plot ----------------------------------------------------------------
def test_loss_plot_decodes_to_an_image(tmp_path):
    import matplotlib.image

    from paddlenlp_ext.training.plot import write_loss_plot

    path = write_loss_plot(str(tmp_path / "loss.png"), {2: 7.5, 4: 6.0, 6: 5.1}, {0: 7.6, 6: 5.0}, "lora: out")
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 200 and img.shape[1] >= 300 and img.std() > 0.01
    empty = matplotlib.image.imread(write_loss_plot(str(tmp_path / "empty.png"), {}, {}))
    assert empty.shape == img.shape
    assert sorted(os.listdir(tmp_path)) == ["empty.png", "loss.png"]  # no temporary file left


def test_loss_curve_seeds_from_the_resumed_history_and_writes_on_save(tmp_path):
    from paddlenlp_ext.training.callbacks import LossCurve

    curve = LossCurve(str(tmp_path / "loss.png"))
    state = SimpleNamespace(
        log_history=[{"loss": 3.0, "step": 10}, {"eval_loss": 2.5, "step": 10}, {"train_loss": 2.0, "step": 20}],
        global_step=10,
    )
    curve.on_train_begin(None, state, None)
    state.global_step = 20
    curve.on_log(None, state, None, logs={"loss": 2.0, "learning_rate": 1e-3})
    assert curve.train == {10: 3.0, 20: 2.0} and curve.evals == {10: 2.5}
    curve.on_save(None, state, None)
    assert (tmp_path / "loss.png").stat().st_size > 1000
    off = LossCurve(str(tmp_path / "other.png"), enabled=False)  # not the saving process
    off.on_train_end(None, state, None)
    assert not (tmp_path / "other.png").exists()


# -- train.log and the console filter ------------------------------------------------
def test_console_level_from_log_level():
    cfg = lambda level: SimpleNamespace(training={"log_level": level}, source="c.json")  # noqa: E731
    assert console_level(SimpleNamespace(training={}, source=None)) == logging.WARNING
    assert console_level(cfg("debug")) == logging.DEBUG and console_level(cfg("INFO")) == logging.INFO
    with pytest.raises(ConfigError, match="log_level 'loud'"):
        console_level(cfg("loud"))


def test_is_library_file():
    assert is_library_file(os.path.join(sys.prefix, "lib", "python3", "site-packages", "paddle", "x.py"))
    assert is_library_file("/usr/lib/python3/dist-packages/y.py")
    assert not is_library_file(os.path.join(ROOT, "paddlenlp_ext", "training", "run.py"))


def test_run_logging_routes_paddlenlp_and_warnings_then_restores(tmp_path, capsys, monkeypatch):
    from paddlenlp.utils.log import logger

    from paddlenlp_ext.integrations.logging import SUPERSEDED_WARNINGS

    shown = []  # what Python would print for each warning (stderr)
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
    stderr = io.StringIO()  # PaddleNLP's console handler, as the terminal sees it
    monkeypatch.setattr(logger.handler, "stream", stderr)
    handler_level, handler_filters = logger.handler.level, list(logger.handler.filters)
    showwarning = warnings.showwarning
    root_console = logging.StreamHandler(io.StringIO())  # as paddle's logging.basicConfig installs one
    logging.getLogger().addHandler(root_console)
    library = logging.getLogger("test_console.some_library")
    library.setLevel(logging.INFO)
    cfg = SimpleNamespace(training={"output_dir": str(tmp_path)}, source=None)
    for attempt in range(2):  # a second run (a resume) appends to the same train.log
        with run_logging(cfg) as console:
            assert con.current() is console
            logger.debug("the argument dump")
            logger.info("Running training chatter")
            logger.warning("a repeated warning")
            logger.warning("a repeated warning")
            logger.warning(SUPERSEDED_WARNINGS[0] + ". you can also ...")
            logger.info("Loading best model from out/checkpoint-4 (eval_loss = 1.0)")
            library.info("generated new fontManager")
            library.warning("a library warning")
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.warn_explicit("library noise", UserWarning, "/x/site-packages/lib/mod.py", 3)
                warnings.warn_explicit("our own warning", UserWarning, os.path.join(ROOT, "llm", "x.py"), 5)
            console.line("step 1/2 progress")
    logging.getLogger().removeHandler(root_console)
    out, err = capsys.readouterr()
    err = stderr.getvalue() + root_console.stream.getvalue() + err
    assert out.count("step 1/2 progress") == 2
    assert err.count("a repeated warning") == 2  # once per run, not once per call
    assert shown == ["our own warning"] * 2
    assert err.count("a library warning") == 2
    for hidden in (
        "the argument dump",
        "Running training chatter",
        "fontManager",
        SUPERSEDED_WARNINGS[0],
        "Loading best model from",
    ):  # PaddleNLP's INFO; the reload is our own console line
        assert hidden not in err + out, hidden
    log = (tmp_path / "train.log").read_text()
    assert log.count("===== run started") == 2
    for text in (
        "the argument dump",
        "Running training chatter",
        "library noise",
        "our own warning",
        "fontManager",
        "step 1/2 progress",
        SUPERSEDED_WARNINGS[0],
    ):
        assert log.count(text) == 2, text
    assert log.count("a repeated warning") == 4
    # everything is back as it was
    assert logger.handler.level == handler_level and logger.handler.filters == handler_filters
    assert warnings.showwarning is showwarning and not con._active
    ours = str(tmp_path / "train.log")
    assert not [
        h for h in logger.logger.handlers + logging.getLogger().handlers if getattr(h, "baseFilename", None) == ours
    ]
    assert root_console.filters == []


def test_run_logging_records_a_failure_in_train_log(tmp_path):
    cfg = SimpleNamespace(training={"output_dir": str(tmp_path)}, source=None)
    with pytest.raises(ValueError):
        with run_logging(cfg):
            raise ValueError("boom in the run")
    log = (tmp_path / "train.log").read_text()
    assert "run stopped: ValueError: boom in the run" in log and "Traceback" in log


def test_integrations_logging_relied_on_symbols_exist():
    # tests/test_integrations.py checks every integrations module listed in its MODULES; this one too
    import importlib
    import inspect

    from paddlenlp_ext.integrations import logging as routing

    for owner_path, attr, params in routing.RELIED_ON:
        parts, obj = owner_path.split("."), None
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for a in parts[i:]:
                obj = getattr(obj, a)
            break
        assert hasattr(obj, attr), f"{owner_path}.{attr}"
        if params is not None:
            assert tuple(inspect.signature(getattr(obj, attr)).parameters) == params, f"{owner_path}.{attr}"


def test_paddlenlp_still_emits_the_superseded_warning():
    """The text SUPERSEDED_WARNINGS hides is PaddleNLP's (a changed text would reach the console again)."""
    from paddlenlp.utils.log import logger

    from paddlenlp_ext.integrations.logging import SUPERSEDED_WARNINGS
    from paddlenlp_ext.training.training_args import make_training_arguments

    records = []
    catcher = logging.Handler()
    catcher.emit = records.append
    logger.logger.addHandler(catcher)
    try:
        make_training_arguments({"output_dir": "unused", "do_eval": True, "report_to": "none"})
    finally:
        logger.logger.removeHandler(catcher)
    assert any(r.getMessage().startswith(SUPERSEDED_WARNINGS) for r in records)


# -- through the CLI -----------------------------------------------------------------
def visualdl_scalars(logdir_glob):
    from visualdl import LogReader

    files = glob.glob(logdir_glob)
    assert len(files) == 1, files
    reader = LogReader(file_path=files[0])
    return {
        tag: [(int(r.id), r.value) for r in reader.get_data("scalar", tag)]
        for tag in reader.get_tags().get("scalar", [])
    }


def check_loss_png(path):
    import matplotlib.image

    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0.01


def test_cli_console_train_log_visualdl_and_loss_plot(tiny_model_dir, tmp_path):
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
        "6",
        "--logging_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "32",
        "--report_to",
        "visualdl",
        "--disable_tqdm",
        "false",
    ]  # not a terminal: plain lines all the same
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any(line.startswith("model tiny-llama | lora | trainable 18,688 / 176,704") for line in lines), r.stdout
    progress = [PROGRESS.match(line) for line in lines if line.startswith("step ")]
    assert [(m.group(1), m.group(2)) for m in progress if m] == [("2", "6"), ("4", "6"), ("6", "6")], r.stdout
    assert "eval loss before training:" in r.stdout and "eval loss:" in r.stdout and "eval accuracy:" in r.stdout
    assert re.search(r"outputs: +.*: adapter, loss\.png, train\.log, runs/ \(VisualDL\), run_summary\.json", r.stdout)
    console = r.stdout + r.stderr
    for chatter in ("DEBUG", "Training Configuration Arguments", "Running training", "Saving adapter", "\x1b[K"):
        assert chatter not in console, chatter
    assert len(console.splitlines()) <= 20, console

    log = (out / "train.log").read_text()
    for text in (
        "Training Configuration Arguments",
        "paddle commit id",
        "[   DEBUG]",
        "***** Running training *****",
        "step 6/6 (100%)",
        "eval loss:",
    ):
        assert text in log, text
    scalars = visualdl_scalars(str(out / "runs" / "*" / "vdlrecords*"))
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6]
    assert [s for s, _ in scalars["eval/loss"]] == [0, 6]  # before and after training: the writer stays open
    summary = json.loads((out / "run_summary.json").read_text())
    assert scalars["eval/loss"][-1][1] == pytest.approx(summary["eval_loss"], rel=1e-5)
    check_loss_png(out / "loss.png")


@pytest.mark.slow
def test_dpo_cli_writes_the_same_logs(tiny_model_dir, tmp_path):
    out = tmp_path / "dpo"
    cmd = [
        sys.executable,
        DPO_CLI,
        os.path.join(ROOT, "llm/config/tiny/dpo_lora_argument.json"),
        "--output_dir",
        str(out),
        "--model_name_or_path",
        tiny_model_dir,
        "--max_steps",
        "4",
        "--logging_steps",
        "2",
        "--report_to",
        "visualdl",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^model tiny-llama \| lora \| .*train \d+ pairs", r.stdout, re.M), r.stdout
    assert len([line for line in r.stdout.splitlines() if PROGRESS.match(line)]) == 2, r.stdout
    assert "reward accuracy:" in r.stdout and "DEBUG" not in r.stdout + r.stderr
    assert "Training Configuration Arguments" in (out / "train.log").read_text()
    scalars = visualdl_scalars(str(out / "runs" / "*" / "vdlrecords*"))
    assert [s for s, _ in scalars["train/loss"]] == [2, 4] and [s for s, _ in scalars["eval/loss"]] == [4]
    check_loss_png(out / "loss.png")


def test_show_summary_tabulates_fine_tuning_and_dpo_runs(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "llm", "tools"))
    try:
        import show_summary
    finally:
        sys.path.pop(0)
    runs = {
        "sft": {
            "method": "lora",
            "trainable_params": 18688,
            "train_loss": 2.1612,
            "eval_loss_before_train": 7.5,
            "eval_loss": 0.75,
            "eval_accuracy": 0.902,
            "tokens_trained": 229993,
            "train_time_s": 50.0,
        },
        "dpo": {
            "method": "lora",
            "trainable_params": 18688,
            "train_loss": 0.38,
            "eval": {"eval_loss": 0.79, "eval_rewards/accuracies": 0.625},
            "tokens_trained": 900,
            "train_time_s": 2.0,
        },
    }
    for name, summary in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "run_summary.json").write_text(json.dumps(summary))
    assert show_summary.main([str(tmp_path / "sft"), str(tmp_path / "dpo")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("run ")
    assert re.search(r"sft +lora +18,688 +2\.1612 +7\.5000 -> 0\.7500 \(0\.100\) +0\.9020 +4,600 +0:50$", lines[1])
    assert re.search(r"dpo +lora +18,688 +0\.3800 +- -> 0\.7900 +0\.6250 +450 +0:02$", lines[2])
    assert show_summary.main([str(tmp_path / "missing")]) == 2  # bad input (docs/reliability.md)
