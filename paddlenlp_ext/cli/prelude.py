"""The first statement of every ``llm/`` script that loads Paddle: :func:`prepare_script`.

It runs before paddle is imported and, in this order,

1. checks that this Python is the project's environment (``cli/interpreter.py``: a system
   Python after ``make setup`` is told to activate ``.venv``, exit 2);
2. sets Paddle's CPU math up (``runtime/cpu_env.py``: MKL/OpenMP threads, MKL's code path;
   docs/cpu.md);
3. silences what importing the libraries prints that is no news to a user (docs/logging.md):
   Paddle's "No ccache found" and setuptools' "replacing distutils" warnings, and Paddle's
   stderr lecture about ``OMP_NUM_THREADS`` > 1, which step 2 sets on purpose, and the
   "Modified FLAGS detected" banner of a ``paddle.distributed.launch`` rank.  Everything
   else on stderr passes through untouched;
4. applies the console policy (``runtime/console_policy.py``, docs/logging.md): Paddle's glog
   INFO/WARNING lines off, the root logger at WARNING before ``import paddle`` raises it,
   library-raised Python warnings off the console, and then (importing paddlenlp) PaddleNLP's
   console handler at WARNING.  A training run's ``log_level`` and train.log take over from there
   (``training/logfile.py``).
"""

import sys
import warnings

from ..runtime.console_policy import apply_before_import
from ..runtime.cpu_env import setup_cpu
from .interpreter import require_project_interpreter

#: warnings (message regexes) raised while paddle / paddlenlp import, never actionable for a user
IMPORT_WARNINGS = ("No ccache found", "Setuptools is replacing distutils")
#: lines paddle.base prints to stderr at import when OMP_NUM_THREADS > 1 (paddle/base/__init__.py), and
#: the banner ``paddle.distributed.init_parallel_env`` writes on every rank of a launch listing the FLAGS
#: that differ from their defaults (paddle/distributed/parallel.py ``_print_modified_flags``)
DROPPED_STDERR_PREFIXES = (
    "WARNING: OMP_NUM_THREADS set to",
    "PLEASE USE OMP_NUM_THREADS WISELY",
    "======================= Modified FLAGS detected",
    "FLAGS(name=",
    "=" * 71 + "\n",
)


class LineDroppingStream:
    """A text stream that passes every write through except lines starting with ``prefixes``.

    ``print(x, file=s)`` writes ``x`` and then ``"\\n"`` separately; the newline after a
    dropped text is dropped too.

    >>> import io
    >>> out = io.StringIO(); s = LineDroppingStream(out, ("NOISE",))
    >>> print("NOISE: ignore me", file=s); print("real error", file=s)
    >>> out.getvalue()
    'real error\\n'
    """

    def __init__(self, stream, prefixes):
        self._stream = stream
        self._prefixes = tuple(prefixes)
        self._drop_newline = False

    def write(self, text):
        if self._drop_newline and text == "\n":
            self._drop_newline = False
            return len(text)
        self._drop_newline = False
        if text.startswith(self._prefixes):
            self._drop_newline = not text.endswith("\n")
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name):  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def quiet_import_noise() -> None:
    """Filter :data:`IMPORT_WARNINGS` and :data:`DROPPED_STDERR_PREFIXES` for this process."""
    for message in IMPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    if not isinstance(sys.stderr, LineDroppingStream):
        sys.stderr = LineDroppingStream(sys.stderr, DROPPED_STDERR_PREFIXES)


def prepare_script(script_file: str, config_first: bool = False):
    """Steps 1-4 above; returns the CPU decision (``cpu_env.CpuDecision``).

    ``config_first``: the script validates its JSON config before loading any library (the training
    CLIs: a config error exits 2 without importing paddle), so step 4 is left to the run, which routes
    PaddleNLP's logger itself (``integrations.logging.route_paddlenlp_logger``).
    """
    require_project_interpreter(script_file)
    decision = setup_cpu()
    quiet_import_noise()
    apply_before_import()
    if not config_first:
        from ..integrations.logging import quiet_paddlenlp_console  # imports paddle: after steps 1-3

        quiet_paddlenlp_console()
    return decision
