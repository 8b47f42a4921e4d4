"""One global order, one normalization: layouts reproduce one process (through the real CLI).

Data parallel and sharding stage 1 run on CPU (``paddle.distributed.launch --nproc_per_node 2``,
gloo); gradient accumulation 2 x 2 is compared with batch 4.  Per-step losses (relative) and the final
weights (absolute) must equal the single-process run's within 1e-4, for LoRA, full fine-tuning and LoRA-DPO.
(PaddleNLP's own sampler and per-rank token means differ by 2e-3 to 7e-3 relative here.)
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA_DIR, ROOT

pytestmark = pytest.mark.slow

LAYOUTS = {  # name: (processes, per-device batch, accumulation, extra keys)
    "single": (1, 4, 1, []),
    "accumulation_2x2": (1, 2, 2, []),
    "data_parallel_2": (2, 2, 1, []),
    "sharding_stage1_2": (2, 2, 1, ["--sharding", "stage1", "--sharding_parallel_degree", "2"]),
}
# lr 1e-3: Adam turns fp32 summation-order noise in near-zero gradients into updates of size ~lr
METHODS = {
    "lora": ["--lora", "true", "--learning_rate", "1e-3"],
    "full": ["--lora", "false", "--learning_rate", "1e-3"],
}


def run(tmp_path, model_dir, method, layout):
    procs, per_device, accumulation, extra = LAYOUTS[layout]
    out = str(tmp_path / f"{method}_{layout}")
    if method == "dpo_lora":  # packed preference rows; the loss is the global batch's pair mean
        config, script = "dpo_lora_argument.json", "run_dpo.py"
        keys = ["--learning_rate", "1e-3"]
    else:
        config, script = "lora_argument.json", "run_finetune.py"
        keys = ["--dataset_name_or_path", DATA_DIR, "--eval_before_train", "false", *METHODS[method]]
    args = [
        os.path.join(ROOT, "llm", "config", "tiny", config),
        "--model_name_or_path",
        model_dir,
        "--output_dir",
        out,
        "--max_steps",
        "4",
        "--logging_steps",
        "1",
        "--warmup_steps",
        "0",
        "--do_eval",
        "false",
        "--per_device_train_batch_size",
        str(per_device),
        "--gradient_accumulation_steps",
        str(accumulation),
        *keys,
        *extra,
    ]
    script = os.path.join(ROOT, "llm", script)
    if procs == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            "--nproc_per_node",
            str(procs),
            "--log_dir",
            out + "_launch",
            script,
            *args,
        ]
    # a fatal signal in a worker prints the Python stack of every thread into its workerlog
    r = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, env={**os.environ, "PYTHONFAULTHANDLER": "1"}
    )
    # each worker's own log first, by name (the launcher's output repeats rank 0's)
    logs = "".join(
        f"--- {os.path.basename(f)} (end) ---\n{open(f).read()[-2500:]}\n"
        for f in sorted(glob.glob(out + "_launch/workerlog.*"))
    )
    assert r.returncode == 0, logs + r.stderr[-1500:] + (r.stdout[-2000:] if procs == 1 else "")
    state = json.load(open(os.path.join(out, "trainer_state.json")))
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    return losses, weights(out)


def weights(out):
    from safetensors.numpy import load_file

    files = sorted(glob.glob(os.path.join(out, "*.safetensors")))
    assert files, os.listdir(out)
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("layouts")
    return tmp, {m: run(tmp, tiny_model_dir, m, "single") for m in [*METHODS, "dpo_lora"]}


@pytest.mark.parametrize("method", [*METHODS, "dpo_lora"])
@pytest.mark.parametrize("layout", ["accumulation_2x2", "data_parallel_2", "sharding_stage1_2"])
def test_layout_reproduces_one_process(reference, tiny_model_dir, method, layout):
    tmp, ref = reference
    ref_losses, ref_weights = ref[method]
    losses, w = run(tmp, tiny_model_dir, method, layout)
    assert len(losses) == len(ref_losses) == 4
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=0)
    assert w.keys() == ref_weights.keys()
    for name in ref_weights:
        # absolute 1e-4: Adam's update of a near-zero gradient amplifies fp32 summation-order noise
        np.testing.assert_allclose(
            w[name].astype(np.float64), ref_weights[name].astype(np.float64), rtol=0, atol=1e-4, err_msg=name
        )
    # the compared weights are trained ones: LoRA's B starts at 0, full fine-tuning moves the base
    start = weights(tiny_model_dir) if method == "full" else {k: np.zeros_like(v) for k, v in ref_weights.items()}
    assert any(not np.allclose(ref_weights[k], start[k]) for k in ref_weights if k in start)
