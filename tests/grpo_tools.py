"""Tools for tests/test_grpo_tools.py (importable as ``grpo_tools``: tests/ is on the path of the test process,
and the tool process inherits it)."""

import os
import socket
import subprocess
import time


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "done"


def fetch(port: int) -> str:
    """Open a TCP connection to 127.0.0.1 and read a line.

    Args:
        port: The port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(("127.0.0.1", port))
        return s.recv(100).decode()


def resolve(host: str) -> str:
    """Resolve a host name.

    Args:
        host: The name.
    """
    return socket.gethostbyname(host)


def run_program() -> str:
    """Start a program."""
    return subprocess.run(["echo", "hi"], capture_output=True, text=True).stdout


def crash() -> str:
    """Exit the process."""
    os._exit(3)


def chatty(x: int) -> int:
    """Print, then answer.

    Args:
        x: A number.
    """
    print("noise on stdout", x)
    return x * 2


def no_doc(x: int):
    return x
