"""Run ``llm/predict/server.py`` as a child process on a free loopback port (tests and bench/serve.py).

    with ServerProcess(["--model_name_or_path", "build/tiny-llama"]) as server:
        server.url            # http://127.0.0.1:PORT (the server picked the port: --port 0)
        server.log()          # what it printed so far (stderr + stdout)
        server.terminate()    # SIGTERM; returns the exit code once it drained and exited

The ready line ``[serve] ready on http://HOST:PORT`` is what ``start`` waits for; a server that
exits first raises RuntimeError with its output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "llm", "predict", "server.py")
READY = re.compile(r"\[serve\] ready on (http://\S+?) ")


class ServerProcess:
    def __init__(self, args: List[str], timeout: float = 180.0, python: Optional[str] = None):
        self.args, self.timeout = ["--port", "0"] + list(args), timeout
        self.python = python or sys.executable
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self.lines: List[str] = []
        self._ready = threading.Event()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()  # the process ended (its output is complete)

    def start(self) -> "ServerProcess":
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([self.python, SCRIPT] + self.args, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.time() + self.timeout
        while not self._ready.wait(0.2):
            if time.time() > deadline:
                self.kill()
                raise RuntimeError(f"the server was not ready within {self.timeout:.0f}s:\n{self.log()}")
        if self.url is None:
            self.proc.wait(10)
            raise RuntimeError(f"the server exited ({self.proc.returncode}) before it was ready:\n{self.log()}")
        return self

    def log(self) -> str:
        return "".join(self.lines)

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM, then wait for the drain; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
