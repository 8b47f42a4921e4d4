"""A newcomer's first commands (issue 25): configs from the repo root and from llm/, path messages,
``--device cpu`` for PaddleNLP's GPU configs, output_dir write problems, command-line blame.

Fast: config-time behaviour (no paddle).  Slow: the real CLI from ``llm/`` on a GPU config with
``--device cpu``, and an evaluation-only run.
"""

import errno
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT
from paddlenlp_ext.config.device import cpu_changes
from paddlenlp_ext.config.parse import ConfigError, load_config
from paddlenlp_ext.config.paths import missing_path_text, repo_root_of, resolve_from_root
from paddlenlp_ext.config.resume import output_dir_problems

LLM = os.path.join(ROOT, "llm")
CLI = os.path.join(LLM, "run_finetune.py")


@pytest.mark.parametrize(
    "module", ["paddlenlp_ext.config.paths", "paddlenlp_ext.config.device", "paddlenlp_ext.config.output_dir"]
)
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0


def test_shipped_config_runs_from_llm_dir_with_root_relative_paths(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.chdir(LLM)
    cfg = load_config("./config/tiny/sft_argument.json", ["--output_dir", str(tmp_path / "o")])
    assert cfg.model.model_name_or_path == os.path.join(ROOT, "build/tiny-llama")
    assert cfg.data.dataset_name_or_path == os.path.join(ROOT, "llm/data/advertise")
    assert f"is not in the current directory {LLM}; found from the repository root" in cfg.derived["model_name_or_path"]
    # a path given on the command line is the user's: relative to the current directory, never remapped
    with pytest.raises(ConfigError) as e:
        load_config(
            "./config/tiny/sft_argument.json",
            ["--output_dir", str(tmp_path / "o"), "--dataset_name_or_path", "llm/data/advertise"],
        )
    assert f"(looked for {os.path.join(LLM, 'llm/data/advertise')})" in e.value.report()
    assert "[dataset_name_or_path from the command line]" in e.value.report()


def test_root_resolution_only_for_configs_in_a_checkout(tmp_path):
    assert repo_root_of(str(tmp_path / "my.json")) is None
    assert repo_root_of(os.path.join(LLM, "config", "tiny", "x.json")) == ROOT
    cfg = os.path.join(LLM, "config", "tiny", "x.json")
    assert resolve_from_root({"model_name_or_path": "build/tiny-llama", "output_dir": "output/x"}, cfg, cwd=LLM) == {
        "model_name_or_path": os.path.join(ROOT, "build/tiny-llama")
    }  # outputs follow the current directory
    assert resolve_from_root({"model_name_or_path": "build/tiny-llama"}, cfg, cwd=ROOT) == {}


def test_missing_model_and_hub_id_messages_name_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = {
        "model_name_or_path": "meta-llama/Llama-2-7b",
        "dataset_name_or_path": DATA_DIR,
        "output_dir": str(tmp_path / "o"),
        "do_train": True,
    }
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "c.json"))
    msg = e.value.report()
    assert (
        f"model_name_or_path 'meta-llama/Llama-2-7b' does not exist (looked for {tmp_path}/meta-llama/Llama-2-7b)"
        in msg
    )
    assert (
        "models are never downloaded; download it first (e.g. `huggingface-cli download meta-llama/Llama-2-7b "
        "--local-dir Llama-2-7b`)"
        in msg
        and "config.json" not in msg
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ConfigError, match=re.escape(f"is not a model directory: {tmp_path / 'empty'} has no config.json")
    ):
        load_config(str(tmp_path / "c.json"), ["--model_name_or_path", "empty"])
    assert "never downloaded" not in missing_path_text("model_name_or_path", "./missing/dir")


def test_predictor_names_the_path_it_tried(tmp_path):
    from paddlenlp_ext.predict.options import _model_config

    problems = []
    assert _model_config("meta-llama/Llama-2-7b", problems) == {}
    assert problems[0].startswith("--model_name_or_path 'meta-llama/Llama-2-7b' does not exist (looked for /")
    assert "huggingface-cli download" in problems[0]


def test_output_dir_read_only_mount_is_named_as_such(tmp_path, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    [msg] = output_dir_problems(str(tmp_path / "run"), "cfg.json")
    assert f"cannot be created in {str(tmp_path)!r}: read-only file system (EROFS)" in msg
    assert "permission denied" not in msg


def test_output_dir_in_proc_exits_2_without_a_traceback(tiny_model_dir):
    r = subprocess.run(
        [
            sys.executable,
            CLI,
            os.path.join(LLM, "config/tiny/lora_argument.json"),
            "--output_dir",
            "/proc/out",
            "--model_name_or_path",
            tiny_model_dir,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "output_dir '/proc/out' cannot be created in '/proc'" in r.stderr and "Traceback" not in r.stderr
    assert "[output_dir from the command line]" in r.stderr


# -- PaddleNLP's GPU configs on a CPU: --device cpu ------------------------------------------------------
GPU_CONFIGS = sorted(
    glob.glob(os.path.join(LLM, "config", "llama", "*.json")) + glob.glob(os.path.join(LLM, "config", "qwen", "*.json"))
)


def cpu_command(path, model_dir):
    """The documented CPU command's overrides (README, docs/compat.md) for a shipped GPU config."""
    if "dpo" in os.path.basename(path):
        data = os.path.join(LLM, "data", "dpo_tiny")
        return "dpo", [
            "--model_name_or_path",
            model_dir,
            "--train_dataset_path",
            data,
            "--dev_dataset_path",
            data,
            "--device",
            "cpu",
        ]
    return "sft", ["--model_name_or_path", model_dir, "--dataset_name_or_path", DATA_DIR, "--device", "cpu"]


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: "/".join(p.split(os.sep)[-2:]))
def test_every_shipped_gpu_config_loads_with_device_cpu(path, tiny_model_dir, tiny_qwen2_dir, tmp_path):
    model = tiny_qwen2_dir if "/qwen/" in path else tiny_model_dir
    mode, overrides = cpu_command(path, model)
    cfg = load_config(path, overrides + ["--output_dir", str(tmp_path / "o")], mode=mode)
    t = cfg.training
    assert not t.get("fp16") and not (t.get("bf16") and t.get("fp16_opt_level") == "O2")
    assert t.get("tensor_parallel_degree", 1) == 1 and t.get("pipeline_parallel_degree", 1) == 1
    assert "device=cpu" in cfg.derived["bf16"]


def test_without_device_cpu_the_gpu_settings_are_refused_not_changed(tiny_model_dir, tmp_path, monkeypatch):
    from paddlenlp_ext.config import environment

    monkeypatch.setattr(
        environment, "paddle_build", lambda: {"installed": True, "cuda": False, "xpu": False, "version": "3.3.1"}
    )
    with pytest.raises(ConfigError) as e:
        load_config(
            os.path.join(LLM, "config/llama/sft_argument.json"),
            ["--model_name_or_path", tiny_model_dir, "--dataset_name_or_path", DATA_DIR],
        )
    assert "fp16_opt_level=O2 needs a GPU" in e.value.report() and "tensor_parallel_degree=4" in e.value.report()
    assert cpu_changes({"bf16": True, "fp16_opt_level": "O2", "tensor_parallel_degree": 4}, processes=4) == {
        "bf16": False
    }  # a 4-process CPU launch keeps its tensor parallel degree


@pytest.mark.slow
def test_gpu_config_from_llm_dir_with_device_cpu_trains(tiny_model_dir, tmp_path):
    cmd = [
        sys.executable,
        "run_finetune.py",
        "./config/llama/sft_argument.json",
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name_or_path",
        DATA_DIR,
        "--device",
        "cpu",
        "--output_dir",
        str(tmp_path / "o"),
        "--max_steps",
        "2",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
        "--per_device_eval_batch_size",
        "8",
        "--max_length",
        "64",
        "--src_length",
        "32",
        "--save_strategy",
        "no",
        "--do_eval",
        "false",
        "--load_best_model_at_end",
        "false",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=LLM)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "derived setting: tensor_parallel_degree = 1 (device=cpu, 1 process; was 4)" in r.stdout
    assert "derived setting: bf16 = False (device=cpu, 1 process; was True)" in r.stdout
    summary = json.loads((tmp_path / "o" / "run_summary.json").read_text())
    assert summary["global_steps"] == 2 and 0 < summary["train_loss"] < 20


@pytest.mark.slow
def test_eval_only_run_evaluates_once(tiny_model_dir, tmp_path):
    cmd = [
        sys.executable,
        CLI,
        os.path.join(LLM, "config/tiny/sft_argument.json"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name_or_path",
        DATA_DIR,
        "--output_dir",
        str(tmp_path / "o"),
        "--do_train",
        "false",
        "--per_device_eval_batch_size",
        "32",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "before training" not in r.stdout and re.search(r"eval loss: +\d+\.\d{4}", r.stdout), r.stdout


# -- the predictor's chat on a terminal -------------------------------------------------------------------
def scripted_session(tok, answers):
    from test_predict import ScriptedModel

    from paddlenlp_ext.predict.options import PredictOptions
    from paddlenlp_ext.predict.session import Session

    model = ScriptedModel(answers, tok.eos_token_id)
    session = Session(
        model=model,
        tokenizer=tok,
        use_template=False,
        eos_ids=[tok.eos_token_id],
        pad_id=0,
        device="cpu",
        description="scripted",
    )
    return session, PredictOptions("unused", src_length=64, max_length=128, decode_strategy="greedy_search")


def test_chat_escapes_control_bytes_but_keeps_newlines_and_saves_the_exact_text(tiny_tokenizer, tmp_path):
    import io

    from paddlenlp_ext.predict.run import chat

    tok = tiny_tokenizer
    weird = tok.convert_tokens_to_ids(["<0x1B>", "<0x07>", "<0x00>", "<0x08>", "<0x0A>", "<0x09>"])
    red = tok("red", add_special_tokens=False)["input_ids"]
    session, o = scripted_session(tok, [red + weird + red])
    o.output_file = str(tmp_path / "chat.json")
    out = io.StringIO()
    assert chat(session, o, io.StringIO("type#coat\n"), out) == 1
    shown = out.getvalue()
    assert "red\\x1b\\x07\\x00\\x08\n\tred" in shown.replace(" ", "")
    assert not any(c in shown for c in "\x1b\x07\x00\x08")
    saved = json.loads((tmp_path / "chat.json").read_text())["output"]
    assert "\x1b\x07\x00\x08\n\t" in saved  # the file keeps what the model said


class FakeTTY:
    def isatty(self):
        return True


def test_ctrl_d_on_a_terminal_prints_a_newline_and_ends_the_chat(tiny_tokenizer, monkeypatch):
    import builtins
    import io

    from paddlenlp_ext.predict.run import chat

    session, o = scripted_session(tiny_tokenizer, [])
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stdin", tty)
    monkeypatch.delitem(sys.modules, "readline", raising=False)

    def ctrl_d(prompt):
        out.write(prompt)
        raise EOFError

    monkeypatch.setattr(builtins, "input", ctrl_d)
    out = io.StringIO()
    assert chat(session, o, tty, out) == 0
    assert out.getvalue().endswith("user> \n")  # the shell's prompt starts on a line of its own
    assert "readline" in sys.modules  # input() edits the line and keeps the history (Up arrow)


# -- the docs show what the program prints --------------------------------------------------------------
def doc_block_after(doc: str, first_line: str) -> str:
    with open(os.path.join(ROOT, "docs", doc), encoding="utf-8") as f:
        text = f.read()
    start = text.index(first_line)
    return text[start : text.index("```", start)]


def test_parallel_md_plan_memory_sample_is_the_program_output():
    block = doc_block_after("parallel.md", "$ python llm/tools/plan_memory.py llm/config/llama/lora_argument.json")
    argv = [
        "llm/config/llama/lora_argument.json",
        "--model_name_or_path",
        "meta-llama/Llama-2-13b",
        "--device_memory",
        "24GB",
    ]
    r = subprocess.run(
        [sys.executable, os.path.join(LLM, "tools", "plan_memory.py")] + argv, capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    assert block.split("\n", 2)[2] == r.stdout


def test_logging_md_console_sample_has_the_memory_plan_line():
    from paddlenlp_ext.planner import estimate_for_run, format_one_line

    block = doc_block_after("logging.md", "derived setting: lora_alpha")
    line = format_one_line(estimate_for_run(load_config(os.path.join(LLM, "config/tiny/lora_argument.json"))))
    assert line + " -- fits in" in block  # the free memory after it is the machine's
    assert block.index("derived setting") < block.index("memory plan:") < block.index("model tiny-llama")


def test_demo_configs_both_write_visualdl_records():
    for name in ("sft_argument.json", "lora_argument.json"):
        cfg = load_config(os.path.join(LLM, "config/tiny", name))
        assert cfg.training.get("report_to", "visualdl") in ("visualdl", ["visualdl"]), name


def test_final_table_of_a_resumed_run_says_the_train_time_spans_the_resume():
    from paddlenlp_ext.training.console import final_table

    rows = final_table({"train_time_s": 5.51, "train_time_before_resume_s": 2.2, "wall_time_s": 4.6}, "out", [])
    assert "  time:" in rows[0] and rows[0].endswith("train 0:06 (0:02 of it before the resume), this process 0:05")
    assert final_table({"train_time_s": 5.51, "wall_time_s": 6.0}, "out", [])[0].endswith("train 0:06, total 0:06")


def test_device_cpu_in_the_file_next_to_gpu_settings_is_still_refused(tiny_model_dir, tmp_path):
    cfg = {
        "model_name_or_path": tiny_model_dir,
        "dataset_name_or_path": DATA_DIR,
        "output_dir": str(tmp_path / "o"),
        "do_train": True,
        "device": "cpu",
        "bf16": True,
        "fp16_opt_level": "O2",
    }
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="fp16_opt_level=O2 needs a GPU"):
        load_config(str(tmp_path / "c.json"))
    assert load_config(str(tmp_path / "c.json"), ["--device", "cpu"]).training["bf16"] is False
