"""GRPO's tools: their sandboxed execution (the JSON schemas of the tools: ``config/tool_schema.py``).

:class:`ToolRunner` executes calls in one long-lived child process (``tool_worker.py``: no network, the
tools' prints discarded), each with ``tool_timeout`` seconds; a call that times out or kills the child
gets an error result and the next call starts a fresh child.  Never imports paddle.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["ToolRunner", "START_TIMEOUT"]

#: seconds the child may take to start and import the tools
START_TIMEOUT = 60.0


class ToolRunner:
    """Runs tool calls in a child process (``tool_worker.py``), each within ``timeout`` seconds.

    ``call(name, arguments)`` -> ``(content, ok)``: ``content`` is the tool message's text (the result, or
    ``{"error": ...}``), ``ok`` False for an error, a timeout or a crash of the child."""

    def __init__(self, specs: Sequence[str], timeout: float):
        self.specs, self.timeout = list(specs), float(timeout)
        self.proc: Optional[subprocess.Popen] = None
        self.isolation: List[str] = []
        self._buffer = b""
        self._eof = False

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the parent's imports
        self._eof = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paddlenlp_ext.grpo.tool_worker", *self.specs],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._buffer = b""
        line = self._read_line(time.monotonic() + max(START_TIMEOUT, self.timeout))
        if line is None or not json.loads(line).get("ready"):
            self.close()
            raise RuntimeError(
                f"the tool process did not start (tools {self.specs}); run "
                f"'python -m paddlenlp_ext.grpo.tool_worker {' '.join(self.specs)}' to see why"
            )
        self.isolation = list(json.loads(line)["isolation"])

    def _read_line(self, deadline: float) -> Optional[str]:
        """The child's next line, or None at the deadline or when it died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # end of file: the child exited
                self._eof = True
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode("utf-8")

    def call(self, name: str, arguments: Any) -> Tuple[str, bool]:
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return json.dumps({"error": f"the arguments are not JSON: {e.msg}"}), False
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write((json.dumps({"name": name, "arguments": arguments}) + "\n").encode("utf-8"))
            self.proc.stdin.flush()
        except BrokenPipeError:  # the child is gone
            self._eof, line = True, None
        else:
            line = self._read_line(time.monotonic() + self.timeout)
        if line is None:  # timed out or the child died: a fresh child for the next call
            died = self._eof or self.proc.poll() is not None
            self.close()
            what = "the tool process exited" if died else f"timed out after {self.timeout:g} s"
            return json.dumps({"error": f"{name}: {what}"}), False
        reply = json.loads(line)
        return reply["content"], bool(reply["ok"])

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:  # the pipe is already gone with the child
                    pass
            self.proc = None
