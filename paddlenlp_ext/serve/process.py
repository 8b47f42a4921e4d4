"""Run ``llm/predict/server.py`` as a child process on a free loopback port (tests, and lm-eval runs through serve/evaluate.py).

    with ServerProcess(["--model_name_or_path", "build/tiny-llama"]) as server:
        server.url            # http://127.0.0.1:PORT (the server picked the port: --port 0)
        server.log()          # what it printed so far (stderr + stdout)
        server.terminate()    # SIGTERM; returns the exit code once it drained and exited

The ready line ``[serve] ready on http://HOST:PORT`` is what ``start`` waits for; a server that
exits first raises RuntimeError with its output.

``malformed_requests`` are the requests every server must refuse with a 4xx OpenAI-style error
(tests/test_serve_e2e.py sends them); ``post`` sends one with the standard library.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, List, Optional, Tuple

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
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [self.python, SCRIPT] + self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        )
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


def post(url: str, body: Any, timeout: float = 120.0) -> Tuple[int, Any]:
    """(status, decoded JSON) of a POST; ``body`` bytes are sent as they are, anything else as JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def malformed_requests(model: str) -> List[Tuple[str, str, Any]]:
    """[(what, path, body)]: 22 requests a server must refuse with a 4xx JSON error and survive."""
    msg = [{"role": "user", "content": "hi"}]
    chat = "/v1/chat/completions"

    def ok(**kw):
        return {"model": model, "messages": msg, **kw}

    return [
        ("bad JSON", chat, b"{not json"),
        ("not UTF-8", chat, b"\xff\xfe"),
        ("body not an object", chat, [1, 2]),
        ("unknown model", chat, {"model": "no-such-model", "messages": msg}),
        ("no model", chat, {"messages": msg}),
        ("no messages", chat, {"model": model}),
        ("negative max_tokens", chat, ok(max_tokens=-5)),
        ("huge max_tokens", chat, ok(max_tokens=10**9)),
        ("1 MB prompt", chat, {"model": model, "messages": [{"role": "user", "content": "x " * 500000}]}),
        ("max_tokens of the wrong type", chat, ok(max_tokens="ten")),
        ("bad role", chat, {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("no user turn to answer", chat, {"model": model, "messages": [{"role": "assistant", "content": "hi"}]}),
        ("temperature out of range", chat, ok(temperature=3)),
        ("top_p 0", chat, ok(top_p=0)),
        ("stream not a boolean", chat, ok(stream="yes")),
        ("n over the limit", chat, ok(n=1000)),
        ("five stop sequences", chat, ok(stop=["a", "b", "c", "d", "e"])),
        ("messages a string", chat, {"model": model, "messages": "hello"}),
        ("token id outside the vocabulary", "/v1/completions", {"model": model, "prompt": [1, 2, 10**9]}),
        ("echo while streaming", "/v1/completions", {"model": model, "prompt": "hi", "echo": True, "stream": True}),
        ("unknown parameter", "/v1/completions", {"model": model, "prompt": "hi", "bogus_option": 1}),
        ("5 MB body", chat, b"x" * (5 * 1024 * 1024)),
    ]
