"""The child process that runs GRPO's tools: ``python -m paddlenlp_ext.grpo.tool_worker SPEC [SPEC ...]``.

It cuts itself off from the network first, then imports the tools (``"package.module:function"``) and
answers one call per line on its protocol pipe (the original stdout; the tools' own prints go to
stderr, which the parent discards)::

    parent -> {"name": "add", "arguments": {"a": 2, "b": 3}}
    child  -> {"ok": true, "content": "5"}
    parent -> {"name": "add", "arguments": {"a": 2}}
    child  -> {"ok": false, "content": "{\\"error\\": \\"TypeError: add() missing 1 required positional argument: 'b'\\"}"}

"No network" means, in this process and whatever it imports:

1. when the kernel allows unprivileged user namespaces, ``unshare(CLONE_NEWUSER | CLONE_NEWNET)``: the
   process has its own network namespace with only a loopback device that is down, so no packet
   leaves it whatever code runs (C extensions included);
2. always, a PEP 578 audit hook (it cannot be removed once added) that refuses creating any socket,
   resolving host names, starting programs (subprocess, os.system, os.exec*, os.posix_spawn) and
   loading C functions through ctypes, with PermissionError -- which the tool sees as an exception,
   so its call's result is an error message.

The first line the child writes says which layers are active: ``{"ready": true, "isolation": [...]}``.
"""

from __future__ import annotations

import json
import os
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

#: audit events refused inside the worker (prefix match on the event name)
REFUSED = {
    "socket.__new__": "creating a socket",
    "socket.getaddrinfo": "resolving a host name",
    "socket.gethostbyname": "resolving a host name",
    "socket.gethostbyaddr": "resolving a host name",
    "socket.getnameinfo": "resolving a host name",
    "subprocess.Popen": "starting a program",
    "os.system": "starting a program",
    "os.exec": "starting a program",
    "os.posix_spawn": "starting a program",
    "os.spawn": "starting a program",
    "pty.spawn": "starting a program",
    "ctypes.dlopen": "loading C code",
    "ctypes.dlsym": "loading C code",
}


def _audit(event: str, args) -> None:
    what = REFUSED.get(event)
    if what is None and event.startswith(("os.exec", "os.spawn")):
        what = "starting a program"
    if what is not None:
        raise PermissionError(f"GRPO tools run without network: {what} is refused ({event})")


def isolate_network() -> list:
    """Cut this process off from the network (the module docstring's two layers); returns the active layers."""
    layers = []
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            layers.append("network namespace")
    except (OSError, AttributeError):  # no libc unshare (not Linux): the audit hook alone
        pass
    sys.addaudithook(_audit)
    layers.append("audit hook")
    return layers


def result_text(value) -> str:
    """A tool's return value as the tool message's content: a string stays, JSON-able values become JSON.

    >>> result_text("5"), result_text(5), result_text({"t": 20}), result_text(None)
    ('5', '5', '{"t": 20}', 'null')
    """
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def error_text(exc: BaseException) -> str:
    """An exception as the tool message's content (what the model sees, as TRL's ``{"error": ...}``).

    >>> error_text(ZeroDivisionError("division by zero"))
    '{"error": "ZeroDivisionError: division by zero"}'
    """
    return json.dumps({"error": f"{type(exc).__name__}: {exc}"}, ensure_ascii=False)


def run_call(funcs, request) -> dict:
    """One call -> ``{"ok", "content"}``; any exception of the tool is its (error) result."""
    name = request.get("name")
    func = funcs.get(name)
    if func is None:
        return {"ok": False, "content": json.dumps({"error": f"unknown tool {name!r}; tools: {sorted(funcs)}"})}
    args = request.get("arguments")
    if not isinstance(args, dict):
        return {"ok": False, "content": json.dumps({"error": "the arguments must be a JSON object"})}
    try:
        return {"ok": True, "content": result_text(func(**args))}
    except Exception as e:  # the tool failed: the model sees the error (architecture test: allowed here)
        return {"ok": False, "content": error_text(e)}


def main(specs) -> None:
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the protocol pipe; fd 1 becomes stderr for prints
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    layers = isolate_network()
    import importlib

    funcs = {}
    for spec in specs:
        module_name, func_name = spec.split(":")
        funcs[func_name] = getattr(importlib.import_module(module_name), func_name)
    proto.write(json.dumps({"ready": True, "isolation": layers}) + "\n")
    proto.flush()
    for line in sys.stdin:
        if line.strip():
            proto.write(json.dumps(run_call(funcs, json.loads(line)), ensure_ascii=False) + "\n")
            proto.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
