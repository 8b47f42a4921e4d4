"""The benchmarks' shared harness: run a command in its own process, measure it, print side-by-side tables.

Every benchmark that launches the CLI (or a worker) goes through :func:`run`, so each figure is
measured one way:

* **peak RSS** is the kernel's ``ru_maxrss`` of the process tree (the command's process and every
  descendant it waited for: the largest of them, as ``/usr/bin/time -f %M`` reports it), read with
  ``os.wait4`` by a minimal launcher process (:data:`LAUNCHER`).  The hop matters: Linux folds the
  parent's RSS into a child's ``ru_maxrss`` at exec time, so a benchmark that has just held a large
  tensor would over-report its children if it spawned them itself;
* **wall time** is the launcher's, from spawn to exit;
* **CPU%** is the command's own utime + stime (``/proc/<pid>/stat``) between the first and the last
  output line matching ``mark`` (the CLI's step lines), over the wall time between them;
* the run's ``run_summary.json`` (and ``trainer_state.json``'s losses) when ``out_dir`` is given.

A command that runs until it is stopped (a server) goes through :class:`Server`: started the same way,
ready at an output line, stopped with a signal, measured the same way.

Tables are markdown: :func:`table` for the rows, :func:`ratio_cells` for a "ours / baseline" row.
Nothing here imports paddle: a benchmark's own process stays small.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the shared demo data: next to the repository (as CI lays it), or where PADDLENLP_EXT_SHARED_DATA points
#: (a checkout elsewhere, e.g. a git worktree)
SHARED = os.environ.get("PADDLENLP_EXT_SHARED_DATA") or os.path.join(os.path.dirname(ROOT), "shared", "data")
ALPACA = os.path.join(SHARED, "alpaca_en_demo.json")
DPO_DEMO = os.path.join(SHARED, "dpo_en_demo.json")
TOKENIZER_MODEL = os.path.join(SHARED, "llama2_tokenizer.model")
TINY_MODEL = os.path.join(ROOT, "build", "tiny-llama")
GiB, MiB = 2**30, 2**20
#: the CLI's per-step log line (``step 3/10 ...``)
STEP_LINE = re.compile(r"^step +(\d+)/(\d+) ")

#: run as ``python -S -c LAUNCHER REPORT CMD...``: spawn CMD, write its pid to REPORT.pid at once, wait for
#: it with wait4 and write {"rc", "wall_s", "peak_rss_bytes"} to REPORT (stdout/stderr pass through).
LAUNCHER = r"""
import json, os, subprocess, sys, time
report, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
p = subprocess.Popen(cmd)
with open(report + ".pid", "w") as f:
    f.write(str(p.pid))
_, status, ru = os.wait4(p.pid, 0)
with open(report, "w") as f:
    json.dump({"rc": os.waitstatus_to_exitcode(status), "wall_s": time.perf_counter() - t0,
               "peak_rss_bytes": ru.ru_maxrss * 1024}, f)
"""


def require_shared(*paths: str, what: str = "this benchmark") -> None:
    """Exit 2 naming the shared data files that are missing (default: the tokenizer and the Alpaca demo)."""
    missing = [p for p in (paths or (TOKENIZER_MODEL, ALPACA)) if not os.path.isfile(p)]
    if missing:
        print(
            f"error: {what} needs the shared benchmark data; missing: {', '.join(missing)}\n"
            f"(the shared data directory: {SHARED}; ../shared/data next to the repository, or set "
            "PADDLENLP_EXT_SHARED_DATA)",
            file=sys.stderr,
        )
        sys.exit(2)


def cli(script: str, *args) -> List[str]:
    """The command of a repository script run with this interpreter: ``cli("llm/run_dpo.py", "c.json", "--x", 1)``
    -> ``[sys.executable, ROOT + "/llm/run_dpo.py", "c.json", "--x", "1"]``."""
    return [sys.executable, os.path.join(ROOT, script), *map(str, args)]


def module(name: str, *args) -> List[str]:
    """The command of a module of this repository run with this interpreter (``-m``), e.g. a bench worker."""
    return [sys.executable, "-m", name, *map(str, args)]


def flags(**kv) -> List[str]:
    """CLI overrides from keywords, in order: ``flags(max_steps=3, do_eval="false")``
    -> ``["--max_steps", "3", "--do_eval", "false"]``."""
    return [x for k, v in kv.items() for x in (f"--{k}", str(v))]


def names_arg(parser, flag: str, names, default=None, nargs: str = "+", help: Optional[str] = None) -> None:
    """A ``--flag NAME ...`` option choosing among ``names`` (default: all of them), e.g. a benchmark's
    ``--methods``: ``names_arg(p, "--methods", ["lora", "dora"])`` then ``--methods dora`` -> ``["dora"]``."""
    names = list(names)
    parser.add_argument(flag, nargs=nargs, choices=names, default=names if default is None else default,
                        metavar="NAME", help=help or f"subset of: {', '.join(names)}")  # fmt: skip


# zero padding + greedy packing + flash-mask attention: the packed mode of every packing benchmark
PACKED = flags(zero_padding="true", greedy_zero_padding="true", use_flash_attention="true", flash_mask="true")


def write_json(path: Optional[str], obj, indent: int = 2, default=None) -> None:
    """A benchmark's ``--json`` report: ``obj`` written to ``path`` (nothing when ``path`` is None or empty)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=indent, default=default)


def llama_shape(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, **more) -> dict:
    """The LlamaConfig keys of a benchmark model's shape, ``more`` after them in order:
    ``llama_shape(64, 128, 2, 4, 2, vocab_size=32000)`` -> ``{"hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000}``."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **more,
    )


def clean_env(drop: Sequence[str] = (), **set_vars: str) -> dict:
    """This process's environment without the variables ``drop`` and with ``set_vars``."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(set_vars)
    return env


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (its threads included), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """One finished command: what :func:`run` measured and, with an ``out_dir``, what the run wrote."""

    name: str
    cmd: List[str]
    returncode: int
    wall_s: float
    peak_rss_bytes: int
    output: str  # stdout and stderr, interleaved
    marks: list = field(default_factory=list)  # (wall time, command's CPU seconds) at each ``mark`` line
    out_dir: Optional[str] = None
    summary: Optional[dict] = None  # out_dir/run_summary.json

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-n:])

    @property
    def cpu_pct(self) -> Optional[float]:
        """The command's CPU% from the first to the last ``mark`` line; None with fewer than two."""
        m = self.marks
        if len(m) < 2 or m[-1][0] <= m[0][0]:
            return None
        return 100.0 * (m[-1][1] - m[0][1]) / (m[-1][0] - m[0][0])

    def trainer_state(self) -> dict:
        """out_dir/trainer_state.json (the log history)."""
        with open(os.path.join(self.out_dir, "trainer_state.json")) as f:
            return json.load(f)

    def losses(self) -> List[float]:
        """The logged training losses of out_dir/trainer_state.json."""
        return [x["loss"] for x in self.trainer_state()["log_history"] if "loss" in x]

    def median_step_s(self) -> Optional[float]:
        """Median of run_summary.json's step times without the first (warm-up) step."""
        steps = (self.summary or {}).get("step_times_s") or []
        return median(steps[1:] or steps)


class _Launch:
    """One command under the :data:`LAUNCHER`: its output lines (logged, marked, passed on) and, once it
    ended, its :class:`Run`.  :func:`run` reads the lines itself; :class:`Server` reads them on a thread."""

    def __init__(self, cmd, name, cwd, env, out_dir, log, mark, on_line):
        self.cmd = [str(c) for c in cmd]
        self.name = name or os.path.basename(self.cmd[1] if len(self.cmd) > 1 else self.cmd[0])
        self.out_dir, self.mark, self.on_line = out_dir, mark, on_line
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
        fd, self.report = tempfile.mkstemp(prefix="bench_run_", suffix=".json")
        os.close(fd)
        os.remove(self.report)
        # its own process group: an interrupted benchmark stops the command too (kill), not only the launcher
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", LAUNCHER, self.report, *self.cmd],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self.lines, self.marks, self._child = [], [], None
        self.logf = open(log, "w") if log else None

    def child(self) -> Optional[int]:
        """The command's pid (the launcher writes it as soon as it spawned it); None before that."""
        if self._child is None:
            with contextlib.suppress(OSError, ValueError):
                with open(self.report + ".pid") as f:
                    self._child = int(f.read())
        return self._child

    def pump(self) -> None:
        """Read the output to its end: each line kept, logged, timed at ``mark`` lines, passed to ``on_line``."""
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.logf:
                self.logf.write(line)
            if self.mark is not None and self.mark.search(line):
                with contextlib.suppress(OSError, TypeError, ValueError):  # the command just ended
                    self.marks.append((time.perf_counter(), cpu_seconds(self.child())))
            if self.on_line:
                self.on_line(line.rstrip("\n"))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def finish(self, check: bool) -> Run:
        """Wait for the launcher; the :class:`Run` (``check``: exit with the output's tail when it failed)."""
        self.proc.wait()
        if self.logf:
            self.logf.close()
        try:
            with open(self.report) as f:
                m = json.load(f)
        except OSError:  # the launcher itself failed
            m = {"rc": self.proc.returncode or 1, "wall_s": 0.0, "peak_rss_bytes": 0}
        for path in (self.report, self.report + ".pid"):
            if os.path.exists(path):
                os.remove(path)
        r = Run(
            self.name,
            self.cmd,
            m["rc"],
            m["wall_s"],
            m["peak_rss_bytes"],
            "".join(self.lines),
            self.marks,
            self.out_dir,
        )
        summary_path = os.path.join(self.out_dir, "run_summary.json") if self.out_dir else None
        if r.ok and summary_path and os.path.isfile(summary_path):
            with open(summary_path) as f:
                r.summary = json.load(f)
        if check and not r.ok:
            sys.exit(f"{self.name} failed (exit {r.returncode}): {' '.join(self.cmd)}\n{r.tail()}")
        return r


def run(
    cmd: Sequence[str],
    *,
    name: str = "",
    cwd: str = ROOT,
    env: Optional[dict] = None,
    out_dir: Optional[str] = None,
    log: Optional[str] = None,
    mark: Optional[re.Pattern] = STEP_LINE,
    on_line: Optional[Callable[[str], None]] = None,
    check: bool = True,
) -> Run:
    """Run ``cmd`` in its own process (see the module docstring for what is measured) and return a :class:`Run`.

    ``log``: also write the output there.  ``on_line``: called with every output line as it comes.
    ``check``: exit with the output's tail when the command fails (else the failed Run is returned).
    """
    launch = _Launch(cmd, name, cwd, env, out_dir, log, mark, on_line)
    try:
        launch.pump()
    except BaseException:  # Ctrl-C, or an on_line callback that failed
        launch.kill()
        launch.finish(check=False)
        raise
    return launch.finish(check)


class Server:
    """A long-running command (a server) in its own process, measured as :func:`run` measures one:

        with Server(cmd, ready=re.compile(r"ready on (http://\\S+)")) as s:
            s.ready.group(1)   # the match of the ready line (the URL, say)
            run = s.stop()     # SIGTERM to the command; its Run (exit code, wall time, peak RSS, output)

    Starting waits up to ``timeout`` seconds for an output line matching ``ready``; a command that exits
    or stays silent first stops the benchmark with its output (exit 1).  Leaving the ``with`` block stops
    a command still running (SIGTERM to its process group).
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        ready: re.Pattern,
        name: str = "",
        cwd: str = ROOT,
        env: Optional[dict] = None,
        log: Optional[str] = None,
        timeout: float = 180.0,
    ):
        self._launch = _Launch(cmd, name, cwd, env, None, log, None, None)
        self.ready: Optional[re.Match] = None
        self.run: Optional[Run] = None
        seen = threading.Event()

        def watch(line):
            if self.ready is None and ready.search(line):
                self.ready = ready.search(line)
                seen.set()

        self._launch.on_line = watch
        self._thread = threading.Thread(target=lambda: (self._launch.pump(), seen.set()), daemon=True)
        self._thread.start()
        if not seen.wait(timeout) or self.ready is None:
            self._launch.kill()
            out = self.stop(check=False)
            sys.exit(
                f"{self._launch.name} was not ready (exit {out.returncode}, {timeout:.0f} s at most): "
                f"{' '.join(self._launch.cmd)}\n{out.tail()}"
            )

    def output(self) -> str:
        """What the command printed so far."""
        return "".join(self._launch.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0, check: bool = False) -> Run:
        """Send ``sig`` to the command, wait (up to ``timeout`` s, then kill its group) and return its Run."""
        if self.run is None:
            child = self._launch.child()
            if child is not None and self._launch.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, sig)
            try:
                self._launch.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._launch.kill()
            self._thread.join(10)
            self.run = self._launch.finish(check)
        return self.run

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        if self.run is None:
            self.stop(timeout=30)


# ---------------------------------------------------------------- in-process phases
# A worker that times one phase of its own run (the training steps after a build, say) reads the peak of
# that phase from the kernel too: VmHWM, the high-water mark of the same RSS, after resetting it.


def _status_bytes(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_now() -> Optional[int]:
    """This process's RSS now (VmRSS), in bytes."""
    return _status_bytes("VmRSS")


def rss_peak() -> Optional[int]:
    """This process's peak RSS (VmHWM) since it started or since the last :func:`reset_peak`, in bytes."""
    return _status_bytes("VmHWM")


def usage():
    """This process's ``resource.getrusage`` (CPU times, page faults) so far: diff two for a phase."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so that :func:`rss_peak` is the peak of what follows;
    False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    peak, now = rss_peak(), rss_now()
    return peak is not None and now is not None and peak <= now + 4 * MiB


def time_calls(fn: Callable, repeats: int, warmup: int = 1) -> tuple:
    """Call ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed: ``([wall seconds], [CPU seconds])``
    of each timed call, the CPU seconds this process's over all its threads (``time.process_time``)."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def interleave(
    variants: dict, repeats: int, warmup: int = 1, context: Optional[Callable] = None, log: bool = False
) -> tuple:
    """Time in-process variants in interleaved rounds (A, B, A, B, ...), so that other load on a shared
    machine spreads over all of them: ``warmup`` untimed rounds, then ``repeats`` timed ones.

    ``variants``: name -> a function of no arguments.  ``context(name)``, when given, is a context manager
    entered around each call, outside the timing (e.g. the variant's patches).  Returns
    ``({name: [seconds of each timed round]}, {name: the function's last result})``.
    """
    times, results = {k: [] for k in variants}, {}
    for i in range(warmup + repeats):
        for name, fn in variants.items():
            with context(name) if context else contextlib.nullcontext():
                t0 = time.perf_counter()
                results[name] = fn()
                dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt)
            if log:
                print(f"  round {i} {name}: {dt:.2f} s", flush=True)
    return times, results


# ---------------------------------------------------------------- tables


def fmt(v, spec: str = ".2f") -> str:
    """``fmt(1.234, ".1f")`` -> ``'1.2'``; ``fmt(None)`` -> ``'-'``."""
    return "-" if v is None else format(v, spec)


def mean(rows: Sequence[dict], key: str) -> Optional[float]:
    """Mean of ``row[key]`` over the rows where it is not None: ``mean([{"a": 1}, {"a": None}, {"a": 3}], "a")``
    -> ``2.0``; None when there is none."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def median(values: Sequence[float]) -> Optional[float]:
    """``median([3, 1, 2])`` -> ``2``; None for no values."""
    return statistics.median(values) if values else None


def ratio(a, b) -> Optional[float]:
    """``a / b``, or None when either is missing or b is 0: ``ratio(3, 2)`` -> ``1.5``."""
    return None if a is None or not b else a / b


def ratio_cells(ours: dict, base: dict, keys: Sequence[Optional[str]], spec: str = ".2f") -> List[str]:
    """One "ours / baseline" cell per key (None: an empty cell):
    ``ratio_cells({"t": 3.0}, {"t": 2.0}, ["t", None])`` -> ``['1.50x', '']``."""
    return ["" if k is None else fmt(ratio(ours.get(k), base.get(k)), spec) + "x" for k in keys]


def verdict(value: Optional[float], limit: float, at_least: bool = False) -> str:
    """``PASS`` when value <= limit (``at_least``: >= limit), else ``FAIL``: ``verdict(0.43, 0.45)`` -> ``'PASS'``."""
    if value is None:
        return "FAIL"
    return "PASS" if (value >= limit if at_least else value <= limit) else "FAIL"


def table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table: ``table(["a", "b"], [[1, "x"]])`` -> ``'| a | b |\\n|---|---|\\n| 1 | x |'``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
