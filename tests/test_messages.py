"""User-facing messages name the mistake and what to do (issue 25: items 6, 9)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from paddlenlp_ext.config.json_errors import describe_json_error


def _message(text):
    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(text)
    return describe_json_error("c.json", text, e.value)


@pytest.mark.parametrize(
    "text,expected",
    [
        ('{\n  "a": 1,\n  "b": 2,\n}\n', 'c.json:3:9: invalid JSON: trailing comma before "}"'),
        ('{"a": [1, 2,\n]}', 'c.json:1:12: invalid JSON: trailing comma before "]"'),
        ('{\n  "a": 1, // note\n  "b": 2\n}', 'c.json:2:11: invalid JSON: JSON has no comments; remove "// note"'),
        ('{\n  # note\n  "a": 1\n}', 'c.json:2:3: invalid JSON: JSON has no comments; remove "# note"'),
        ('{\n  /* note */ "a": 1\n}', 'c.json:2:3: invalid JSON: JSON has no comments; remove "/* note */ "a": 1"'),
        ('{"a": 1 "b": 2}', "c.json:1:9: invalid JSON: Expecting ',' delimiter"),
    ],
)
def test_describe_json_error(text, expected):
    assert _message(text).startswith(expected)


def test_cli_reports_trailing_comma_line(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text('{\n  "output_dir": "x",\n  "lora": true,\n}\n', encoding="utf-8")
    r = subprocess.run([sys.executable, f"{ROOT}/llm/run_finetune.py", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2
    assert f'{cfg}:3:15: invalid JSON: trailing comma before "}}"' in r.stderr + r.stdout


def _pnlp_merge_args(argv, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pnlp_merge_script", f"{ROOT}/llm/tools/merge_lora_params.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        return mod.parse_arguments(argv), ""
    except SystemExit as e:
        assert e.code == 2
        return None, capsys.readouterr().err


def test_paddlenlp_merge_script_takes_our_output_flag(capsys):
    args, _ = _pnlp_merge_args(["--lora_path", "a", "--merge_model_path", "out"], capsys)
    assert args.merge_model_path == "out"


def test_paddlenlp_merge_script_names_an_unknown_flag(capsys):
    # without the check argparse reports the missing --output_path, never the typo
    args, err = _pnlp_merge_args(["--lora_path", "a", "--merge_model_pth", "out"], capsys)
    assert args is None and "unrecognized arguments: --merge_model_pth (unknown flags" in err


def _doc_files():
    import glob

    return [f"{ROOT}/README.md", *sorted(glob.glob(f"{ROOT}/docs/*.md"))]


def test_docs_name_no_machine_paths_and_no_brace_expansions():
    """Issue 25 item 8: a command copied from the docs works on the reader's machine, in bash."""
    import re

    brace = re.compile(r"\S*\{[\w.-]+(,[\w.-]+)+\}\S*")  # bash expands {sft,lora}_x.json into two arguments
    problems = []
    for path in _doc_files():
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if re.search(r"(?<![\w.])/(work|home|root|Users)/", line):
                    problems.append(f"{path}:{n}: machine path: {line.strip()}")
                if line.lstrip().startswith((".venv/bin/python", "python ")) and brace.search(line):
                    problems.append(f"{path}:{n}: brace expansion in a command: {line.strip()}")
    assert not problems, "\n".join(problems)
