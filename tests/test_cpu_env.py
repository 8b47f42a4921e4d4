"""The CPU math set-up every entry script runs before Paddle loads (paddlenlp_ext/runtime/cpu_env.py, docs/cpu.md)."""

import ast
import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT
from paddlenlp_ext.runtime import cpu_env
from paddlenlp_ext.runtime.cpu_env import CpuFacts, cgroup_cpu_quota, decide, local_ranks, parse_cpuinfo, setup_cpu
from paddlenlp_ext.training.console import config_line

AMD = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n\n"
    "processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n"
)
MKL = "/site-packages/paddle/libs/libmklml_intel.so"


def amd(**kw):
    vendor, flags = parse_cpuinfo(AMD)
    return CpuFacts(**{"affinity": 2, "vendor": vendor, "flags": flags, "mkl_library": MKL, **kw})


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_parse_cpuinfo_reads_the_first_processor():
    assert parse_cpuinfo(AMD) == ("AuthenticAMD", frozenset({"fpu", "sse2", "avx", "fma", "avx2", "bmi2"}))
    assert parse_cpuinfo("vendor_id : \tShanghai \nflags: avx2 fma\n")[0] == "Shanghai"
    assert parse_cpuinfo("") == ("", frozenset())  # not x86 (no vendor_id): no code-path choice


def test_cgroup_v2_quota_of_2_cpus_gives_2_threads_on_a_bigger_machine(tmp_path):
    root = str(tmp_path)
    write(f"{root}/cpu.max", "max 100000\n")
    write(f"{root}/docker/abc/cpu.max", "200000 100000\n")
    quota = cgroup_cpu_quota("0::/docker/abc\n", root)
    assert quota == 2.0
    d = decide(amd(affinity=64, quota=quota), {})
    assert d.threads == 2 and d.set_env["OMP_NUM_THREADS"] == d.set_env["MKL_NUM_THREADS"] == "2"
    assert "2 threads (cgroup quota 2)" in d.text


def test_cgroup_quota_is_the_tightest_ancestor_and_rounds_up(tmp_path):
    root = str(tmp_path)
    write(f"{root}/a/cpu.max", "150000 100000\n")  # the parent limits the child that has none
    write(f"{root}/a/b/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota("0::/a/b\n", root) == 1.5
    assert decide(amd(affinity=8, quota=1.5), {}).threads == 2
    assert cgroup_cpu_quota("0::/a/b\n", str(tmp_path / "absent")) is None
    write(f"{root}/c/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota("0::/c\n", root) is None


def test_cgroup_v1_cfs_quota(tmp_path):
    root = str(tmp_path)
    write(f"{root}/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(f"{root}/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota("4:cpu,cpuacct:/\n1:name=systemd:/\n", root) is None
    write(f"{root}/cpu,cpuacct/job/cpu.cfs_quota_us", "100000\n")
    write(f"{root}/cpu,cpuacct/job/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota("4:cpu,cpuacct:/job\n", root) == 1.0
    assert decide(amd(affinity=2, quota=1.0), {}).threads == 1


def test_a_launch_of_2_ranks_on_2_cpus_gives_each_1_thread():
    env = {"PADDLE_LOCAL_SIZE": "2", "PADDLE_TRAINERS_NUM": "2"}
    d = decide(amd(affinity=2, local_ranks=local_ranks(env)), env)
    assert d.threads == 1 and d.set_env["OMP_NUM_THREADS"] == "1" and "2 local ranks" in d.text
    assert local_ranks({"PADDLE_TRAINERS_NUM": "8", "PADDLE_NNODES": "2"}) == 4  # the older launcher
    assert local_ranks({}) == 1 and local_ranks({"PADDLE_LOCAL_SIZE": "x"}) == 1
    assert decide(amd(affinity=2, local_ranks=3), {}).threads == 1  # never 0
    assert decide(amd(affinity=8, quota=4.0, local_ranks=2), {}).threads == 2


def test_the_users_settings_win():
    env = {"OMP_NUM_THREADS": "1", "MKL_DEBUG_CPU_TYPE": "4"}
    d = setup_cpu(env, facts=amd(affinity=16))
    assert env == {"OMP_NUM_THREADS": "1", "MKL_DEBUG_CPU_TYPE": "4"}  # MKL_NUM_THREADS left to the user too
    assert d.threads is None and d.set_env == {} and d.user_env == env
    assert d.text == "cpu: threads as set: OMP_NUM_THREADS=1, MKL_DEBUG_CPU_TYPE=4 as set"
    env = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # a code-path choice of the user's own: no MKL_DEBUG_CPU_TYPE
    setup_cpu(env, facts=amd())
    assert env == {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    env = {"MKL_NUM_THREADS": "3"}
    setup_cpu(env, facts=amd())
    assert env == {"MKL_NUM_THREADS": "3", "MKL_DEBUG_CPU_TYPE": "5"}


def test_the_switch_turns_everything_off():
    env = {"PADDLENLP_EXT_CPU_SETUP": "0"}
    d = setup_cpu(env, facts=amd())
    assert env == {"PADDLENLP_EXT_CPU_SETUP": "0"} and not d.enabled
    assert d.text == "cpu: set-up off (PADDLENLP_EXT_CPU_SETUP=0)"


@pytest.mark.parametrize(
    "vendor, flags, mkl, expected",
    [
        ("AuthenticAMD", {"avx2", "fma"}, MKL, ("5", "AMD CPU")),
        ("AuthenticAMD", {"avx2", "fma", "avx512f"}, MKL, ("5", "AMD CPU with AVX-512")),
        ("HygonGenuine", {"avx2", "fma"}, MKL, ("5", "Hygon CPU")),
        ("GenuineIntel", {"avx2", "fma", "avx512f"}, MKL, (None, "Intel CPU")),
        ("AuthenticAMD", {"avx", "sse2"}, MKL, (None, "AMD without AVX2/FMA")),
        ("AuthenticAMD", {"avx2", "fma"}, None, (None, "no MKL-ML in paddle/libs")),
        ("", set(), MKL, (None, "unknown CPU")),
    ],
)
def test_the_mkl_code_path_follows_the_cpu(vendor, flags, mkl, expected):
    facts = CpuFacts(affinity=2, vendor=vendor, flags=frozenset(flags), mkl_library=mkl)
    assert cpu_env.mkl_code_path(facts) == expected
    d = decide(facts, {})
    assert d.set_env.get("MKL_DEBUG_CPU_TYPE") == expected[0]
    assert d.text.endswith(("MKL AVX2 code path" if expected[0] else "MKL's own code path") + f" ({expected[1]})")


def test_the_configuration_line_ends_with_the_cpu_choice():
    line = config_line("build/tiny-llama", "lora", 10, 100, {}, cpu="cpu: 2 threads (2 CPUs)")
    assert line == "model tiny-llama | lora | trainable 10 / 100 (10.00%) | cpu: 2 threads (2 CPUs)"
    assert "cpu" not in config_line("m", "lora", 10, 100, {})


def test_setup_reads_this_machine_without_importing_paddle():
    code = (
        "import os, sys; from paddlenlp_ext.runtime.cpu_env import setup_cpu, current; d = setup_cpu(); "
        "assert 'paddle' not in sys.modules and current() is d; "
        "assert os.environ['OMP_NUM_THREADS'] == str(d.threads) == os.environ['MKL_NUM_THREADS']; print(d.text)"
    )
    env = {k: v for k, v in os.environ.items() if k not in cpu_env.THREAD_VARS + cpu_env.CODE_PATH_VARS}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**env, "PYTHONPATH": ROOT}
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("cpu: ") and " thread" in r.stdout


#: llm/ scripts that never import paddle (config/, planner/, training.console, models.family_table only),
#: so need no set-up; models_doc.py is the families helper's (models/family_table.py, paddle-free)
PADDLE_FREE_SCRIPTS = {
    "llm/tools/config_docs.py",
    "llm/tools/plan_memory.py",
    "llm/tools/show_summary.py",
    "llm/tools/models_doc.py",
}


def test_every_entry_script_sets_up_the_cpu_before_importing_the_library():
    scripts = sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "llm", "**", "*.py"), recursive=True)
    )
    assert "llm/run_finetune.py" in scripts
    for rel in scripts:
        if rel in PADDLE_FREE_SCRIPTS or not open(os.path.join(ROOT, rel)).read().strip():
            continue
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        first_call = None
        for i, node in enumerate(tree.body):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "prepare_script"
            ):
                first_call = i
                break
        assert first_call is not None, f"{rel}: call prepare_script(__file__) before importing paddlenlp_ext / paddle"
        for node in tree.body[:first_call]:
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                assert not name.startswith(("paddle", "paddlenlp")) or name == "paddlenlp_ext.cli.prelude", (
                    f"{rel}: imports {name} before prepare_script()"
                )


# -- through the real CLI ---------------------------------------------------------------------
def _run_tiny(tmp_path, name, extra_env):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in cpu_env.THREAD_VARS + cpu_env.CODE_PATH_VARS and k != cpu_env.SWITCH
    }
    out = tmp_path / name
    cmd = [
        sys.executable,
        os.path.join(ROOT, "llm", "run_finetune.py"),
        os.path.join(ROOT, "llm/config/tiny/lora_argument.json"),
        "--output_dir",
        str(out),
        "--model_name_or_path",
        os.path.join(ROOT, "build", "tiny-llama"),
        "--dataset_name_or_path",
        DATA_DIR,
        "--max_steps",
        "6",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "4",
        "--do_eval",
        "false",
        "--eval_before_train",
        "false",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**env, **extra_env})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    summary = json.loads((out / "run_summary.json").read_text())
    state = json.loads((out / "trainer_state.json").read_text())
    return r, summary, [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.mark.slow
def test_the_cli_runs_with_the_set_up_and_the_losses_do_not_change(tiny_model_dir, tmp_path):
    expected = decide(cpu_env.gather_facts({}), {})
    r_on, on, losses_on = _run_tiny(tmp_path, "on", {})
    r_off, off, losses_off = _run_tiny(tmp_path, "off", {"PADDLENLP_EXT_CPU_SETUP": "0"})
    # the variables reached the training process (read there after paddle's import) ...
    assert on["cpu"]["enabled"] is True and on["cpu"]["threads"] == expected.threads
    assert on["cpu"]["env"]["OMP_NUM_THREADS"] == on["cpu"]["env"]["MKL_NUM_THREADS"] == str(expected.threads)
    assert on["cpu"]["env"]["MKL_DEBUG_CPU_TYPE"] == expected.set_env.get("MKL_DEBUG_CPU_TYPE")
    assert "| " + expected.text in r_on.stdout  # ... and the configuration line says so
    # ... and without it, Paddle's default: one thread, MKL's own dispatch
    assert off["cpu"]["enabled"] is False and off["cpu"]["env"]["OMP_NUM_THREADS"] == "1"
    assert off["cpu"]["env"]["MKL_DEBUG_CPU_TYPE"] is None and off["cpu"]["env"]["MKL_NUM_THREADS"] is None
    assert "cpu: set-up off (PADDLENLP_EXT_CPU_SETUP=0)" in r_off.stdout
    # fp32 numerics unchanged by the threads and the code path
    assert len(losses_on) == len(losses_off) == 6
    assert losses_on == pytest.approx(losses_off, rel=1e-5)
