"""One console policy (docs/logging.md): at the default log level every script's terminal output is ours.

Each ``llm/`` script runs as a user types it (a subprocess, the tiny model, small inputs); the test
fails on any line of PaddleNLP's or Paddle's own logging (:data:`NOISE`).  The
``paddle.distributed.launch`` case is ``slow``.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
for _name in ("GLOG_minloglevel", "GLOG_v"):  # the policy's defaults, not the caller's shell
    ENV.pop(_name, None)

#: (what, pattern) of library output that must not reach the console at the default level
NOISE = [
    ("PaddleNLP/Paddle log line", re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[\s*[A-Z]+\s*\]")),
    ("paddle.distributed.launch INFO", re.compile(r"LAUNCH INFO")),
    ("glog line", re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d")),
    ("Python warning", re.compile(r"(User|Deprecation|Future|Runtime)Warning")),
    ("tqdm bar", re.compile(r"\d+%\|.*\|\s*\d+/\d+|\d+/\d+ \[\d+:\d+<")),
    ("ANSI colour code", re.compile(r"\x1b\[\d*(;\d+)*m")),
    ("library INFO via the root logger", re.compile(r"^INFO ")),
]


def noise_lines(text: str):
    """[(what, line)] for each line of ``text`` that is library logging."""
    found = []
    for line in text.splitlines():
        for what, pattern in NOISE:
            if pattern.search(line):
                found.append((what, line))
                break
    return found


def test_noise_patterns_catch_library_lines_and_pass_ours():
    library = [
        "\x1b[32m[2026-11-25 12:11:42,613] [    INFO]\x1b[0m - Loading configuration file build/tiny-llama/config.json",
        "[2026-11-25 12:11:34,738] [    INFO] config.py:54 - PyTorch version 2.13.0+cpu available.",
        "LAUNCH INFO 2026-11-25 12:00:00,000 -----------  Configuration  ----------------------",
        "I1125 12:00:00.123456  1234 tcp_utils.cc:107] Retry to connect to 127.0.0.1:6170 while the server is not yet listening.",
        "W1125 12:00:00.123456  1234 gpu_resources.cc:119] Please NOTE: device: 0",
        "/x/site-packages/paddle/y.py:3: VisibleDeprecationWarning: API is deprecated",
        "Skipping the first batches:  40%|████      | 2/5 [00:00<00:00, 10.1it/s]",
        "INFO paddlenlp_ext.quant.linear: QuantizedLinear(nf4): forward path = dequant",
    ]
    assert [line for _, line in noise_lines("\n".join(library))] == library  # every one caught
    ours = [
        "step  10/150 (  7%)  loss 7.1777  lr 1.00e-02  3,180 tok/s  elapsed 0:05  ETA 1:07",
        "model tiny-llama | lora | trainable 18,688 / 176,704 (10.58%) | train 2,000 examples",
        "merged: output/m (verified: max |diff| 1.2e-06)",
        "summary:",
        "  train loss:    2.1612 (150 steps)",
    ]
    assert noise_lines("\n".join(ours)) == []


def run(script, *args, cwd=ROOT, timeout=300):
    cmd = [sys.executable, os.path.join(ROOT, *script.split("/")), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=ENV, timeout=timeout)


def console_problems(name, r, rc=0):
    """What is wrong with a finished script's console: its exit code, and each library line it printed."""
    if r.returncode != rc:
        return [f"{name}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"]
    noise = noise_lines(r.stdout) + noise_lines(r.stderr)
    return [f"{name} printed library logging: [{w}] {line!r}" for w, line in noise]


def assert_quiet(name, r, rc=0):
    problems = console_problems(name, r, rc)
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """A 4-step LoRA run (saving a checkpoint at step 2, evaluation, load_best_model_at_end), its output dir."""
    out = tmp_path_factory.mktemp("noise") / "lora"
    r = run(
        "llm/run_finetune.py",
        "llm/config/tiny/lora_argument.json",
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        out,
        "--max_steps",
        4,
        "--logging_steps",
        2,
        "--per_device_train_batch_size",
        4,
        "--per_device_eval_batch_size",
        16,
        "--eval_before_train",
        "false",
        "--evaluation_strategy",
        "steps",
        "--eval_steps",
        2,
        "--save_strategy",
        "steps",
        "--save_steps",
        2,
        "--load_best_model_at_end",
        "true",
        "--metric_for_best_model",
        "loss",
        "--report_to",
        "none",
        "--use_fused_rms_norm",
        "true",
    )
    return out, r


def test_finetune_console_is_ours_and_the_best_model_notice_is_our_line(lora_run):
    out, r = lora_run
    assert_quiet("run_finetune", r)
    notice = [line for line in r.stdout.splitlines() if line.startswith("Loading best model from")]
    assert len(notice) == 1 and "/checkpoint-" in notice[0] and "(loss = 7." in notice[0], r.stdout
    log = (out / "train.log").read_text()
    assert "[    INFO] PaddleNLP - " in log  # PaddleNLP's records are in train.log, not gone


def test_llm_meta_notice_is_a_console_line(lora_run):
    """A GPU-only fusion set on a CPU run is said on stdout, as our line (and in train.log)."""
    out, r = lora_run
    notice = (
        "notice: use_fused_rms_norm=True is a GPU-only fused kernel (same results, other speed); this run is "
        "on CPU, where the unfused ops run"
    )
    assert r.stdout.splitlines().count(notice) == 1, r.stdout
    assert notice not in r.stderr and notice in (out / "train.log").read_text()


def test_final_table_lists_only_what_was_written(lora_run):
    """--report_to none: no VisualDL records, and the table's outputs do not claim any."""
    out, r = lora_run
    outputs = [line for line in r.stdout.splitlines() if line.strip().startswith("outputs:")]
    assert len(outputs) == 1 and outputs[0].endswith(": adapter, loss.png, train.log, run_summary.json"), r.stdout
    assert not (out / "runs").exists()


@pytest.mark.slow  # a second training run; the fast suite keeps the first
def test_resume_draws_no_skipping_bar(lora_run, tmp_path):
    """Resuming mid-epoch: PaddleNLP's "Skipping the first batches" bar is not drawn (stderr is a pipe)."""
    out, _ = lora_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    r = run(
        "llm/run_finetune.py",
        "llm/config/tiny/lora_argument.json",
        "--model_name_or_path",
        ROOT + "/build/tiny-llama",
        "--output_dir",
        resumed,
        "--max_steps",
        4,
        "--logging_steps",
        2,
        "--per_device_train_batch_size",
        4,
        "--do_eval",
        "false",
        "--eval_before_train",
        "false",
        "--save_strategy",
        "no",
        "--resume_from_checkpoint",
        "true",
        "--overwrite_output_dir",
        "false",
        "--report_to",
        "none",
    )
    assert_quiet("run_finetune (resumed)", r)
    assert "Skipping the first batches" not in r.stdout + r.stderr
    assert "step 4/4" in r.stdout.replace("  ", " ")


def test_merge_predict_and_tools_console_is_ours(lora_run, tiny_model_dir, tmp_path):
    out, _ = lora_run
    prompts = tmp_path / "prompts.json"
    with open(os.path.join(ROOT, "llm", "data", "demo_prompts.json"), encoding="utf-8") as f:
        prompts.write_text("".join(f.readlines()[:2]))
    runs = {
        "merge_lora_params": (
            "llm/merge_lora_params.py",
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            out,
            "--merge_model_path",
            tmp_path / "merged",
        ),
        "tools/merge_lora_params": (
            "llm/tools/merge_lora_params.py",
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            out,
            "--output_path",
            tmp_path / "merged_tools",
        ),
        "predictor": (
            "llm/predict/predictor.py",
            "--model_name_or_path",
            tiny_model_dir,
            "--lora_path",
            out,
            "--data_file",
            prompts,
            "--output_file",
            tmp_path / "pred.json",
            "--src_length",
            64,
            "--max_length",
            72,
        ),
        "check_packing": (
            "llm/tools/check_packing.py",
            "llm/config/tiny/lora_argument.json",
            "--model_name_or_path",
            tiny_model_dir,
            "--check_examples",
            2,
        ),
        "data_report": (
            "llm/tools/data_report.py",
            "llm/config/tiny/lora_argument.json",
            "--model_name_or_path",
            tiny_model_dir,
        ),
        "make_tiny_model": ("llm/tools/make_tiny_model.py", "--output", tmp_path / "tiny", "--force"),
        "plan_memory": (
            "llm/tools/plan_memory.py",
            "llm/config/tiny/lora_argument.json",
            "--model_name_or_path",
            tiny_model_dir,
        ),
        "show_summary": ("llm/tools/show_summary.py", out),
        "run_dpo": (
            "llm/run_dpo.py",
            "llm/config/tiny/dpo_lora_argument.json",
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            tmp_path / "dpo",
            "--max_steps",
            2,
            "--logging_steps",
            1,
            "--per_device_train_batch_size",
            2,
            "--per_device_eval_batch_size",
            8,
        ),
    }
    with ThreadPoolExecutor(2) as pool:  # two at a time: the machine's cores
        results = dict(zip(runs, pool.map(lambda args: run(*args), runs.values())))
    problems = [p for name, r in results.items() for p in console_problems(name, r)]
    assert not problems, "\n".join(problems)
    assert len((tmp_path / "pred.json").read_text().splitlines()) == 2
    assert json.loads(results["data_report"].stdout)["train"]["examples"] == 2000


def test_quantized_forward_path_line_is_not_on_the_console(capfd):
    """The QLoRA predictor's "forward path" INFO record (quant/probe.py) stays off the console
    under the policy (prelude installs the root handler at WARNING before paddle adds its INFO one)."""
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from paddlenlp_ext.cli.prelude import prepare_script; prepare_script(%r)\n"
        "import logging; logging.getLogger('paddlenlp_ext.quant.linear').info('forward path = dequant')\n"
        "logging.getLogger('paddlenlp_ext.quant.linear').warning('a real warning')\n"
    ) % (ROOT, __file__)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "forward path" not in r.stdout + r.stderr and "a real warning" in r.stderr


#: the launch command docs/logging.md tells users to type (CPU data parallel over gloo)
LAUNCH = [
    sys.executable,
    "-W",
    "ignore:No ccache found",
    "-m",
    "paddle.distributed.launch",
    "--log_level",
    "WARNING",
    "--nproc_per_node",
    "2",
]


@pytest.mark.slow
def test_launch_console_is_rank_0_and_ours(tiny_model_dir, tmp_path):
    """Under the documented launch command: no LAUNCH INFO, FLAGS banner or glog line; our lines once
    (rank 0); each rank's full output in log/workerlog.N."""
    cmd = LAUNCH + [
        os.path.join(ROOT, "llm", "run_finetune.py"),
        os.path.join(ROOT, "llm/config/tiny/lora_argument.json"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name_or_path",
        os.path.join(ROOT, "llm", "data", "advertise"),
        "--output_dir",
        str(tmp_path / "out"),
        "--max_steps",
        "2",
        "--logging_steps",
        "1",
        "--eval_before_train",
        "false",
        "--do_eval",
        "false",
        "--report_to",
        "none",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600)
    assert_quiet("launch run_finetune", r)
    assert r.stdout.count("step 2/2 (100%)") == 1 and r.stdout.count("summary:") == 1, r.stdout
    assert "Modified FLAGS" not in r.stdout + r.stderr
    assert (tmp_path / "log" / "workerlog.1").exists() and (tmp_path / "out" / "train.rank1.log").exists()


@pytest.mark.slow  # three more training runs; the fast suite keeps SFT, DPO and the tools
def test_alignment_scripts_console_is_ours(tiny_model_dir, tmp_path):
    """run_kto, run_reward, run_grpo and reward_score print only our lines at the default level."""
    short = ("--model_name_or_path", tiny_model_dir, "--max_steps", 2, "--logging_steps", 1)
    runs = {
        "run_kto": (
            "llm/run_kto.py",
            "llm/config/tiny/kto_lora_argument.json",
            *short,
            "--output_dir",
            tmp_path / "kto",
        ),
        "run_reward": (
            "llm/run_reward.py",
            "llm/config/tiny/reward_lora_argument.json",
            *short,
            "--output_dir",
            tmp_path / "reward",
        ),
        "run_grpo": (
            "llm/run_grpo.py",
            "llm/config/tiny/grpo_argument.json",
            *short,
            "--num_generations",
            2,
            "--max_completion_length",
            4,
            "--output_dir",
            tmp_path / "grpo",
        ),
    }
    with ThreadPoolExecutor(2) as pool:  # two at a time: the machine's cores
        results = dict(zip(runs, pool.map(lambda args: run(*args), runs.values())))
    results["reward_score"] = run(
        "llm/predict/reward_score.py",
        "--model_name_or_path",
        tmp_path / "reward",
        "--input_file",
        "llm/data/reward_tiny/dev.json",
        "--output_file",
        tmp_path / "s.jsonl",
    )
    problems = [p for name, r in results.items() for p in console_problems(name, r)]
    assert not problems, "\n".join(problems)
    assert "pair accuracy" in results["reward_score"].stdout
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 32
