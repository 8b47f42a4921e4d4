"""A current transformers (5.x) as a judge, from its own venv.

transformers 5.x needs tokenizers >= 0.22, which clashes with paddlenlp 3.0.0b4's pin, so it
cannot live in the project's venv.  :func:`hf5_python` builds ``build/hf5-venv`` once (reused
afterwards; about 25 s): a venv of the base interpreter with ``transformers==HF5_VERSION`` and
its own dependencies, plus a ``.pth`` that appends the project venv's site-packages *after* its
own, so torch (2.13 CPU, ~800 MB) is shared instead of reinstalled (measured: 24 s vs 60 s with
the torch wheel installed into it).  When it cannot be built the calling test is skipped with
the reason.  :func:`judge` runs ``tests/hf5_worker.py`` in that venv; arrays and results travel
as ``.npy`` / JSON files.
"""

import json
import os
import site
import subprocess
import sys

import pytest

HF5_VERSION = "5.24.0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, "build", "hf5-venv")
WORKER = os.path.join(ROOT, "tests", "hf5_worker.py")
_READY = os.path.join(VENV, ".ready")


def _python() -> str:
    return os.path.join(VENV, "bin", "python")


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _shared_site_packages() -> str:
    """The project venv's site-packages that holds torch ('' when none does)."""
    shared = [p for p in site.getsitepackages() if os.path.isdir(os.path.join(p, "torch"))]
    # resolved: a worktree's .venv is a symlink to the shared venv the judge was built against
    return os.path.realpath(shared[0]) if shared else ""


def _build() -> str:
    """Build the venv; '' on success, else why not (the skip reason)."""
    import shutil

    if os.path.isdir(VENV):
        shutil.rmtree(VENV)
    base = os.path.join(sys.base_prefix, "bin", "python3")
    steps = [
        [base, "-m", "venv", VENV],
        [
            _python(),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-compile",
            f"transformers=={HF5_VERSION}",
        ],
    ]
    for cmd in steps:
        try:
            r = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{' '.join(cmd[:4])}: {e}"
        if r.returncode != 0:
            return f"{' '.join(cmd[:6])} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
    # torch from the project venv, after the judge's own packages (its transformers/tokenizers win)
    shared = _shared_site_packages()
    if not shared:
        return "torch is not installed in the project venv"
    own = subprocess.run(
        [_python(), "-c", "import site; print(site.getsitepackages()[0])"],
        env=_clean_env(),
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(os.path.join(own, "zz_project_venv.pth"), "w") as f:
        f.write(shared + "\n")
    r = subprocess.run(
        [_python(), "-c", "import torch, transformers; print(transformers.__version__)"],
        env=_clean_env(),
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 or r.stdout.strip() != HF5_VERSION:
        return f"the judge venv does not import transformers {HF5_VERSION} with torch: {r.stderr.strip()[-300:]}"
    with open(_READY, "w") as f:  # which project venv it leans on: another one (a new clone's) rebuilds it
        f.write(shared)
    return ""


def hf5_python() -> str:
    """The judge venv's python (built on first use); skips the test when it cannot be built."""
    import fcntl

    os.makedirs(os.path.dirname(VENV), exist_ok=True)
    with open(VENV + ".lock", "w") as lock:  # two pytest runs at once: one builds, the other waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = ""
        if os.path.isfile(_READY):
            with open(_READY) as f:
                ready = f.read()
        if not ready or ready != _shared_site_packages():
            why = _build()
            if why:
                pytest.skip(f"transformers {HF5_VERSION} judge venv ({VENV}) could not be built: {why}")
    return _python()


def judge(command: str, workdir: str, **args):
    """Run ``hf5_worker.py command`` with ``args`` (JSON) in the judge venv; returns its JSON result."""
    req = os.path.join(workdir, f"{command}_request.json")
    res = os.path.join(workdir, f"{command}_result.json")
    with open(req, "w") as f:
        json.dump(args, f)
    r = subprocess.run(
        [hf5_python(), WORKER, command, req, res], env=_clean_env(), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"transformers {HF5_VERSION} judge failed:\n{r.stderr[-3000:]}"
    with open(res) as f:
        return json.load(f)
