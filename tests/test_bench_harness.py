"""The benchmarks' shared harness (bench/harness.py) and the rule that every benchmark uses it.

Fast: the harness imports no paddle, and the commands it runs here are small Python one-liners.
"""

import ast
import doctest
import glob
import json
import os
import subprocess
import sys
import time

import pytest

from bench import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: benchmarks not on the harness yet (none: a new one starts on it)
NOT_YET: set = set()
MiB = 2**20


def test_docstring_examples():
    assert doctest.testmod(harness).failed == 0


def test_peak_rss_is_the_commands_own_not_the_parents():
    hold = bytearray(300 * MiB)  # the benchmark's own memory: a child spawned from it must not report it
    hold[::4096] = b"x" * len(hold[::4096])
    small = harness.run([sys.executable, "-c", "print('hi')"], name="small", mark=None)
    big = harness.run(
        [sys.executable, "-c", "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096])"], name="big", mark=None
    )
    assert small.ok and small.output.strip() == "hi"
    assert small.peak_rss_bytes < 100 * MiB, small.peak_rss_bytes
    assert 200 * MiB < big.peak_rss_bytes < 300 * MiB, big.peak_rss_bytes
    assert big.wall_s > 0
    del hold


def test_peak_rss_covers_the_process_tree():
    grandchild = "b = bytearray(150 * 2**20); b[::4096] = b'x' * len(b[::4096])"
    cmd = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"]
    r = harness.run(cmd, name="tree", mark=None)
    assert r.peak_rss_bytes > 150 * MiB, r.peak_rss_bytes


def test_step_marks_give_the_commands_cpu_share():
    busy = (
        "import time\nfor i in range(3):\n    t = time.process_time()\n    while time.process_time() - t < 0.2: pass\n"
        "    print(f'step {i + 1}/3 loss 1.0', flush=True)\n"
        "time.sleep(2)"
    )  # alive while its last line is read: a mark of a command that ended has no CPU to read
    lines = []
    r = harness.run([sys.executable, "-c", busy], name="busy", on_line=lines.append)
    assert len(r.marks) == 3 and lines[0] == "step 1/3 loss 1.0"
    # between the first and the last step line the command burnt 2 x 0.2 s of CPU (the share of the wall time
    # that is depends on the machine's other load)
    cpu = r.marks[-1][1] - r.marks[0][1]
    assert 0.35 <= cpu <= 0.7, r.marks
    assert r.cpu_pct == pytest.approx(100 * cpu / (r.marks[-1][0] - r.marks[0][0]))
    assert 0 < r.cpu_pct <= 120, r.cpu_pct


def test_a_failed_command_exits_with_its_output_or_is_returned(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('what went wrong'); sys.exit(3)"]
    r = harness.run(cmd, name="failing", check=False, mark=None)
    assert r.returncode == 3 and not r.ok and "what went wrong" in r.tail()
    with pytest.raises(SystemExit, match="failing failed \\(exit 3\\)[\\s\\S]*what went wrong"):
        harness.run(cmd, name="failing", mark=None, log=str(tmp_path / "log"))
    assert "what went wrong" in (tmp_path / "log").read_text()


def test_the_runs_summary_losses_and_median_step(tmp_path):
    write = (
        "import json, sys; d = sys.argv[1]; "
        "json.dump({'step_times_s': [9.0, 1.0, 3.0, 2.0]}, open(d + '/run_summary.json', 'w')); "
        "json.dump({'log_history': [{'loss': 2.5}, {'eval_loss': 9}, {'loss': 2.0}]}, "
        "open(d + '/trainer_state.json', 'w'))"
    )
    r = harness.run([sys.executable, "-c", write, str(tmp_path)], out_dir=str(tmp_path), mark=None)
    assert r.summary["step_times_s"][0] == 9.0
    assert r.median_step_s() == 2.0  # the first (warm-up) step left out
    assert r.losses() == [2.5, 2.0]


def test_require_shared_exits_2_naming_the_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        harness.require_shared(str(tmp_path / "absent.json"))
    assert e.value.code == 2 and "absent.json" in capsys.readouterr().err


def test_in_process_phase_peak():
    assert harness.reset_peak()
    before = harness.rss_peak()
    b = bytearray(100 * MiB)
    b[::4096] = b"x" * len(b[::4096])
    assert harness.rss_peak() >= before + 90 * MiB
    del b


def test_interleave_times_every_variant_after_a_warm_up():
    calls = []
    times, results = harness.interleave(
        {"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}, repeats=2
    )
    assert calls == ["a", "b"] * 3 and results == {"a": 1, "b": 2}
    assert [len(t) for t in times.values()] == [2, 2]


def _bench_scripts():
    return sorted(
        p
        for p in glob.glob(os.path.join(ROOT, "bench", "*.py"))
        if os.path.basename(p) not in NOT_YET | {"__init__.py", "harness.py"}
    )


@pytest.mark.parametrize("path", _bench_scripts(), ids=os.path.basename)
def test_every_benchmark_runs_its_commands_through_the_harness(path):
    """No benchmark launches a process itself, measures peak RSS its own way, or imports a sibling through
    ``sys.path``: ``subprocess``/``resource`` are the harness's, siblings are imported as ``bench.<name>``."""
    tree = ast.parse(open(path).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"subprocess", "resource"}, sorted(imported & {"subprocess", "resource"})
    siblings = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "bench", "*.py"))}
    assert not imported & siblings, f"import {sorted(imported & siblings)} as bench.<name>"
    # (putting another project's directory first, as the PaddleNLP worker does for its llm/, is not this)
    inserts = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "insert"
        and ast.unparse(n.func.value) == "sys.path"
        and any(w in ast.unparse(n) for w in ("__file__", "ROOT", "REPO", "HERE", "bench"))
    ]
    assert not inserts, f"{inserts}: import the package (bench.<name>) instead"
    timers = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "/usr/bin/time"]
    assert not timers, "peak RSS: the harness's, not /usr/bin/time"


def test_a_benchmark_runs_as_a_module_and_as_a_file():
    for cmd in ([sys.executable, "-m", "bench.e2e_trl_dpo", "--help"], [sys.executable, "bench/e2e_trl_dpo.py"]):
        # the TRL DPO worker imports its sibling as bench.e2e_trl; without a spec it stops at argv
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
        assert "ModuleNotFoundError" not in r.stderr, r.stderr
        assert "IndexError" in r.stderr or "JSONDecodeError" in r.stderr, r.stderr


SERVER = """
import signal, sys, time
hold = bytearray(120 * 2**20); hold[::4096] = b"x" * len(hold[::4096])
signal.signal(signal.SIGTERM, lambda *a: (print("draining", flush=True), sys.exit(0)))
print("[serve] ready on http://127.0.0.1:1234 (pid)", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_server_is_ready_at_its_line_and_stopped_with_sigterm():
    import re

    with harness.Server(
        [sys.executable, "-c", SERVER], ready=re.compile(r"ready on (http://\S+)"), name="srv", timeout=60
    ) as s:
        assert s.ready.group(1) == "http://127.0.0.1:1234"
        r = s.stop()
    assert r.returncode == 0 and "draining" in r.output and "draining" in s.output()
    assert 120 * MiB < r.peak_rss_bytes < 250 * MiB, r.peak_rss_bytes
    assert s.stop() is r  # stopping twice returns the same run


def test_a_server_that_exits_before_it_is_ready_stops_the_benchmark():
    import re

    cmd = [sys.executable, "-c", "print('no model here'); raise SystemExit(2)"]
    with pytest.raises(SystemExit, match="srv was not ready \\(exit 2[\\s\\S]*no model here"):
        harness.Server(cmd, ready=re.compile("ready on"), name="srv", timeout=60)


def test_an_interrupted_run_stops_the_command(tmp_path):
    """A benchmark stopped mid-run (Ctrl-C, a failing callback) leaves no command running."""
    pid_file = tmp_path / "pid"
    script = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        "print('step 1/2 x', flush=True); time.sleep(60)"
    )

    def stop(line):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        harness.run([sys.executable, "-c", script], on_line=stop)
    pid = int(pid_file.read_text())
    for _ in range(50):  # the command gets SIGTERM; give it a moment to go
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail("the command outlived the interrupted run")


def test_time_calls_warms_up_then_times_each_call():
    calls = []
    wall, cpu = harness.time_calls(lambda: calls.append(1), repeats=3)
    assert len(calls) == 4 and len(wall) == len(cpu) == 3 and min(wall) >= 0 and min(cpu) >= 0


def test_flags_shape_and_json_report_helpers(tmp_path):
    """The shared pieces the benchmarks build their CLI overrides, model shapes and --json reports from."""
    assert harness.flags(max_steps=3, do_eval="false", learning_rate=1e-4) == [
        "--max_steps",
        "3",
        "--do_eval",
        "false",
        "--learning_rate",
        "0.0001",
    ]
    assert harness.PACKED == ["--zero_padding", "true", "--greedy_zero_padding", "true"] + [
        "--use_flash_attention",
        "true",
        "--flash_mask",
        "true",
    ]
    shape = harness.llama_shape(64, 128, 2, 4, 2, vocab_size=32000)
    assert list(shape.items()) == [
        ("hidden_size", 64),
        ("intermediate_size", 128),
        ("num_hidden_layers", 2),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("vocab_size", 32000),
    ]
    harness.write_json(None, {"a": 1})  # no --json: nothing written, no error
    out = tmp_path / "r.json"
    harness.write_json(str(out), {"a": 1, "p": tmp_path}, default=str)
    assert json.loads(out.read_text()) == {"a": 1, "p": str(tmp_path)}
    assert out.read_text().startswith('{\n  "a"')  # indent 2, as the reports were written before
