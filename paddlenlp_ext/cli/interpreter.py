"""Is this Python the project's environment?  Checked first by every ``llm/`` script.

A newcomer who runs ``python llm/run_finetune.py ...`` with the system Python
after ``make setup`` would otherwise meet a traceback ending in "run make setup",
which is wrong advice: setup ran, into ``.venv/``.  This module imports nothing
heavy: it only asks whether paddle and paddlenlp can be found.
"""

import importlib.util
import os
import sys
from typing import Optional

REQUIRED = ("paddle", "paddlenlp")


def interpreter_problem(
    repo_root: str, executable: str = sys.executable, find=importlib.util.find_spec
) -> Optional[str]:
    """What to do when this interpreter lacks paddle/paddlenlp, or None when it has them.

    >>> interpreter_problem("/repo", "/usr/bin/python3", find=lambda name: None)[:60]
    '/usr/bin/python3 has no paddle, paddlenlp; this project inst'
    """
    missing = [name for name in REQUIRED if find(name) is None]
    if not missing:
        return None
    venv_python = os.path.join(repo_root, ".venv", "bin", "python")
    head = f"{executable} has no {', '.join(missing)}; "
    if os.path.exists(venv_python) and os.path.realpath(executable) != os.path.realpath(venv_python):
        return (
            head + f"this project installs them into {os.path.join(repo_root, '.venv')} (make setup): "
            f"activate it with `source {os.path.join(repo_root, '.venv', 'bin', 'activate')}`, or run the script "
            f"with {venv_python}"
        )
    return head + f"this project installs them into {os.path.join(repo_root, '.venv')}: run `make setup` in {repo_root}"


def require_project_interpreter(script_path: str) -> None:
    """Exit 2 with :func:`interpreter_problem`'s advice when paddle/paddlenlp cannot be imported.

    ``script_path`` is the calling script's ``__file__``; the repository root is the
    directory above ``llm/``.
    """
    here = os.path.dirname(os.path.abspath(script_path))
    while os.path.basename(here) != "llm" and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    problem = interpreter_problem(os.path.dirname(here))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
