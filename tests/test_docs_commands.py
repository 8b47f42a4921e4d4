"""The docs check: every shell command in README.md and docs/*.md marked runnable runs and exits as documented.

A fenced ```bash block directly preceded by the line ``<!-- runnable -->`` is runnable
(docs/docs_check.md).  Each command in it (a ``\\``-continued line counts as one; ``#`` comment
lines are skipped) runs with bash in a workspace that mirrors the repository root (every entry
symlinked, but a fresh ``output/`` and ``log/``), ``python`` meaning this test's interpreter; it
must exit 0, or N when the command ends with the comment ``# exit N``.  The commands of one file
run in order in one workspace, so a later block may use an earlier block's output.  A command
that uses ``output/tiny_lora`` finds a short LoRA run of the tiny model there (4 steps,
llm/config/tiny/lora_argument.json), so the merge / predict / summary commands stay cheap.
"""

import doctest
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import List, NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- runnable -->"
EXIT_COMMENT = re.compile(r"#\s*exit\s+(\d+)\s*$")
#: what is prepared in the workspace for commands that mention it
TINY_LORA = "output/tiny_lora"


class Command(NamedTuple):
    doc: str  # path relative to the repo
    line: int  # 1-based line of the command's first line
    text: str  # the command, continuation lines joined
    exit_code: int


def runnable_commands(doc: str, text: str) -> List[Command]:
    """The commands of the runnable blocks of one markdown text.

    >>> md = "x\\n<!-- runnable -->\\n```bash\\n# a comment\\npython a.py \\\\\\n  --k v\\npython b.py  # exit 2\\n```\\n"
    >>> [(c.line, c.text, c.exit_code) for c in runnable_commands("d.md", md)]
    [(5, 'python a.py --k v', 0), (7, 'python b.py', 2)]
    >>> runnable_commands("d.md", "```bash\\npython not_marked.py\\n```\\n")
    []
    >>> runnable_commands("d.md", "~~~\\n<!-- runnable -->\\n```bash\\npython in_an_example.py\\n```\\n~~~\\n")
    []
    """
    lines = text.splitlines()
    commands, i, fence = [], 0, None  # fence: the fence string of the (unmarked) block we are in
    while i < len(lines):
        stripped = lines[i].strip()
        if fence is not None:
            fence = None if stripped == fence else fence
        elif stripped.startswith(("```", "~~~")):
            fence = stripped[: len(stripped) - len(stripped.lstrip(stripped[0]))]
        elif stripped == MARKER:
            if i + 1 >= len(lines) or lines[i + 1].strip() != "```bash":
                raise ValueError(f"{doc}:{i + 1}: {MARKER} must be followed by a ```bash block")
            i += 2
            while i < len(lines) and lines[i].strip() != "```":
                start, parts = i, []
                while lines[i].rstrip().endswith("\\"):
                    parts.append(lines[i].rstrip()[:-1].strip())
                    i += 1
                parts.append(lines[i].strip())
                i += 1
                cmd = " ".join(p for p in parts if p)
                if not cmd or cmd.startswith("#"):
                    continue
                m = EXIT_COMMENT.search(cmd)
                code = int(m.group(1)) if m else 0
                cmd = cmd[: m.start()].rstrip() if m else cmd  # other trailing comments: bash skips them
                commands.append(Command(doc, start + 1, cmd, code))
        i += 1
    return commands


def documented_commands() -> List[Command]:
    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    found = []
    for path in docs:
        with open(path, encoding="utf-8") as f:
            found += runnable_commands(os.path.relpath(path, ROOT), f.read())
    return found


def make_workspace(path) -> str:
    """A directory that looks like the repo root: symlinks to its entries, fresh output/ and log/."""
    os.makedirs(path)
    for name in os.listdir(ROOT):
        if name not in ("output", "log", ".git"):
            os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
    os.makedirs(os.path.join(path, "output"))
    return path


def environment() -> dict:
    """``python`` is this interpreter: its bin directory (the venv's) first on PATH."""
    bin_dir = os.path.dirname(sys.executable)
    assert os.path.basename(sys.executable) == "python" or os.path.exists(os.path.join(bin_dir, "python"))
    return dict(
        os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=ROOT, OMP_NUM_THREADS="1"
    )


@pytest.fixture(scope="module")
def tiny_lora(tiny_model_dir, tmp_path_factory):
    """output/tiny_lora: the README's LoRA config for 4 steps (an adapter, train.log, run_summary.json),
    run once in a workspace of its own; copied into each doc's workspace that needs it."""
    workspace = make_workspace(str(tmp_path_factory.mktemp("docs") / "repo"))
    r = subprocess.run(
        [
            "python",
            "llm/run_finetune.py",
            "llm/config/tiny/lora_argument.json",
            "--max_steps",
            "4",
            "--logging_steps",
            "2",
            "--eval_before_train",
            "false",
            "--per_device_eval_batch_size",
            "64",
        ],
        cwd=workspace,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return os.path.join(workspace, TINY_LORA)


COMMANDS = documented_commands()
BY_DOC = {}
for _c in COMMANDS:
    BY_DOC.setdefault(_c.doc, []).append(_c)


def test_parser_examples():
    assert doctest.testmod(sys.modules[__name__]).failed == 0


def test_a_wrong_exit_code_is_caught(tmp_path):
    """The check can fail: a command documented as exit 0 that exits 2 is reported with file:line."""
    (c,) = runnable_commands("x.md", "<!-- runnable -->\n```bash\npython -c 'raise SystemExit(2)'\n```\n")
    r = subprocess.run(["bash", "-c", c.text], env=environment(), capture_output=True, timeout=60)
    assert (c.doc, c.line, c.exit_code, r.returncode) == ("x.md", 3, 0, 2)
    with pytest.raises(ValueError, match="x.md:1: <!-- runnable --> must be followed"):
        runnable_commands("x.md", "<!-- runnable -->\n```\nls\n```\n")


def test_the_docs_mark_commands_runnable():
    """The check checks something: README or docs mark commands, among them an error's exit 2."""
    assert len(COMMANDS) >= 5, COMMANDS
    assert any(c.exit_code == 2 for c in COMMANDS)


@pytest.mark.parametrize("doc", sorted(BY_DOC))
def test_runnable_commands_exit_as_documented(doc, request, tmp_path):
    env = environment()
    workspace = make_workspace(str(tmp_path / "repo"))
    if any(TINY_LORA in c.text for c in BY_DOC[doc]):
        shutil.copytree(request.getfixturevalue("tiny_lora"), os.path.join(workspace, TINY_LORA), symlinks=True)
    for c in BY_DOC[doc]:
        r = subprocess.run(
            ["bash", "-c", c.text],
            cwd=workspace,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
        )
        assert r.returncode == c.exit_code, (
            f"{c.doc}:{c.line}: `{c.text}` exited {r.returncode}, the doc says {c.exit_code}\n"
            f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        )


def test_shlex_can_split_every_command():
    """A quoting mistake in a doc is reported with its file:line."""
    for c in COMMANDS:
        try:
            shlex.split(c.text)
        except ValueError as e:
            pytest.fail(f"{c.doc}:{c.line}: {e}")
