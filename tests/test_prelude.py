"""Every script's first statement (cli/prelude.py): the project's Python, and no library import noise (issue 25)."""

import doctest
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from paddlenlp_ext.cli import interpreter, prelude

NOISE = ("No ccache found", "replacing distutils", "OMP_NUM_THREADS")


@pytest.mark.parametrize("module", [prelude, interpreter])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_interpreter_without_paddle_is_told_to_activate_the_venv(tmp_path):
    os.makedirs(tmp_path / ".venv" / "bin")
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    msg = interpreter.interpreter_problem(
        str(tmp_path), "/usr/bin/python3", find=lambda name: None if name == "paddlenlp" else object()
    )
    assert msg.startswith("/usr/bin/python3 has no paddlenlp; ")
    assert f"source {tmp_path}/.venv/bin/activate" in msg and "make setup" in msg
    assert interpreter.interpreter_problem(str(tmp_path), "/usr/bin/python3", find=lambda name: object()) is None


def _system_python_without_paddle():
    exe = shutil.which("python3", path="/usr/bin:/bin")
    if exe is None or os.path.realpath(exe) == os.path.realpath(sys.executable):
        return None
    r = subprocess.run(
        [exe, "-c", "import importlib.util as u; print(u.find_spec('paddle') is None)"], capture_output=True, text=True
    )
    return exe if r.stdout.strip() == "True" else None


@pytest.mark.parametrize("script", ["llm/run_finetune.py", "llm/predict/predictor.py", "llm/merge_lora_params.py"])
def test_system_python_gets_advice_not_a_traceback(script):
    exe = _system_python_without_paddle()
    if exe is None:
        pytest.skip("no system python3 without paddle on this machine")
    r = subprocess.run([exe, os.path.join(ROOT, script), "--help"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: {exe} has no paddle, paddlenlp; ")


def test_paddle_import_lecture_is_dropped_and_the_rest_passes(capfd):
    import io

    out = io.StringIO()
    stream = prelude.LineDroppingStream(out, prelude.DROPPED_STDERR_PREFIXES)
    print("WARNING: OMP_NUM_THREADS set to 2, not 1. The computation ...", file=stream)
    print("PLEASE USE OMP_NUM_THREADS WISELY.", file=stream)
    print("error: something real", file=stream)
    stream.write("partial")
    stream.write(" line\n")
    assert out.getvalue() == "error: something real\npartial line\n"


def test_tools_print_no_library_noise(tiny_model_dir, tmp_path):
    """data_report imports paddle/paddlenlp (tokenizer): none of their import-time warnings reach the user."""
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm/tools/data_report.py"),
            os.path.join(ROOT, "llm/config/tiny/lora_argument.json"),
            "--output_dir",
            str(tmp_path / "o"),
            "--model_name_or_path",
            tiny_model_dir,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for noise in NOISE:
        assert noise not in r.stdout + r.stderr, noise
