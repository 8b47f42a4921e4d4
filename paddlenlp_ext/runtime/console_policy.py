"""One console policy for every ``llm/`` script (docs/logging.md, "One console policy").

What reaches a user's terminal at the default log level is ours: our own lines, warnings and
errors.  The libraries' chatter goes to the run's ``train.log`` (training runs,
``training/logfile.py``) or nowhere (tools, merge, predict).  This module holds the part of the
policy that must be in place *before* Paddle loads (stdlib only, no paddle import):

* :func:`quiet_native_logs`: Paddle's C++ (glog) INFO and WARNING lines (``I1125 ...``,
  ``W1125 ...``) are off unless the user set ``GLOG_minloglevel`` / ``GLOG_v`` himself;
* :func:`install_root_handler`: the root logger gets its stderr handler now, at WARNING, so
  ``import paddle`` (which adds an INFO handler only to a root logger without one) leaves it at
  WARNING and libraries' INFO records during import (``datasets``: "PyTorch version ...
  available") are dropped;
* :func:`quiet_library_warnings`: Python warnings raised inside installed packages (Paddle's
  deprecation notices, ...) stay off the console; warnings of this repository's code are shown.

PaddleNLP's own logger exists only after ``import paddlenlp``:
``integrations.logging.quiet_paddlenlp_console`` sets its console level (``prelude`` calls it).
"""

import logging
import os
import sys
import warnings

#: glog environment defaults: ERROR and above only (0 INFO, 1 WARNING, 2 ERROR), no verbose logs
NATIVE_LOG_DEFAULTS = {"GLOG_minloglevel": "2", "GLOG_v": "0"}
ROOT_FORMAT = "%(levelname)s %(name)s: %(message)s"


def is_library_file(filename: str) -> bool:
    """Code of an installed package or of Python itself (not this repository, not the user's scripts).

    >>> is_library_file(os.path.join(sys.prefix, "lib", "python3.11", "site-packages", "paddle", "x.py"))
    True
    >>> is_library_file(os.path.abspath(__file__))
    False
    """
    path = os.path.abspath(filename or "")
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts or path.startswith("<"):
        return True
    return any(path.startswith(os.path.join(p, "lib")) for p in {sys.prefix, sys.base_prefix})


def quiet_native_logs(environ=os.environ) -> None:
    """Set :data:`NATIVE_LOG_DEFAULTS` where the user has not (read by Paddle's C++ core when it loads)."""
    for name, value in NATIVE_LOG_DEFAULTS.items():
        environ.setdefault(name, value)


def install_root_handler() -> None:
    """A WARNING stderr handler on a root logger that has none (see the module docstring)."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(ROOT_FORMAT))
        root.addHandler(handler)
    root.setLevel(logging.WARNING)


def quiet_library_warnings() -> None:
    """Python warnings from library code are not shown; the rest are, as Python shows them.

    The displaced ``warnings.showwarning`` is kept as ``__wrapped__`` of the new one:
    ``training.logfile.warnings_to_log`` shows library warnings with it at ``log_level info``.
    """
    if getattr(warnings.showwarning, "__wrapped__", None) is not None:
        return
    original = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not is_library_file(filename):
            original(message, category, filename, lineno, file, line)

    showwarning.__wrapped__ = original
    warnings.showwarning = showwarning


def apply_before_import() -> None:
    """The three steps above, in the order Paddle's import needs them."""
    quiet_native_logs()
    install_root_handler()
    quiet_library_warnings()
