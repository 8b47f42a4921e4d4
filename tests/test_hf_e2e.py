"""Hugging Face (transformers-layout) directories through the CLIs: fine-tune (LoRA, nf4 QLoRA), DPO, merge, predict.

Each directory is what the hub ships: transformers' save_pretrained of a random
tiny model (bf16, sharded) plus a tokenizer.json-only tokenizer.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import DATA_DIR, ROOT, run_jobs
from hf_models import edit_config, save_hf_model
from test_hf_tokenizer import build as build_tokenizer

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

FINETUNE = os.path.join(ROOT, "llm", "run_finetune.py")
DPO = os.path.join(ROOT, "llm", "run_dpo.py")
MERGE = os.path.join(ROOT, "llm", "merge_lora_params.py")
PREDICT = os.path.join(ROOT, "llm", "predict", "predictor.py")
LORA_CONFIG = os.path.join(ROOT, "llm", "config", "tiny", "lora_argument.json")
TOKENIZER_STYLE = {"llama": "llama3", "qwen2": "qwen2", "mistral": "llama3", "qwen3": "qwen2"}


def run(cmd, check=True):
    r = subprocess.run([sys.executable, *map(str, cmd)], capture_output=True, text=True, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """family -> a bf16, sharded transformers checkpoint with a tokenizer.json-only tokenizer (vocab 704)."""
    out = {}
    for family, style in TOKENIZER_STYLE.items():
        d = str(tmp_path_factory.mktemp(family))
        save_hf_model(d, family, dtype="bfloat16", max_shard_size="200KB", vocab_size=704, initializer_range=0.2)
        build_tokenizer(d, style)
        assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) >= 2
        out[family] = d
    return out


def finetune(model_dir, out, *overrides, check=True):
    return run(
        [
            FINETUNE,
            LORA_CONFIG,
            "--model_name_or_path",
            model_dir,
            "--dataset_name_or_path",
            DATA_DIR,
            "--output_dir",
            out,
            "--max_steps",
            "20",
            "--per_device_train_batch_size",
            "8",
            "--logging_steps",
            "1",
            "--learning_rate",
            "3e-2",
            "--warmup_steps",
            "0",
            "--do_eval",
            "false",
            "--src_length",
            "64",
            "--max_length",
            "128",
            *overrides,
        ],
        check=check,
    )


def loss_fell(out):
    """(first, last): mean training loss of the first and the last 3 steps."""
    with open(os.path.join(out, "trainer_state.json")) as f:
        losses = [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]
    assert len(losses) == 20
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, losses
    return first, last


def summary(out):
    with open(os.path.join(out, "run_summary.json")) as f:
        return json.load(f)


def predictions(model_dir, prompts, out, *extra):
    run(
        [
            PREDICT,
            "--model_name_or_path",
            model_dir,
            "--data_file",
            prompts,
            "--output_file",
            out,
            "--decode_strategy",
            "greedy_search",
            "--src_length",
            "48",
            "--max_length",
            "64",
            "--device",
            "cpu",
            *extra,
        ]
    )
    with open(out, encoding="utf-8") as f:
        return [json.loads(line)["output"] for line in f]


@pytest.fixture(scope="module")
def lora_runs():
    return {}  # family -> output dir of its LoRA run (the merge test reuses them)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_lora_and_nf4_finetune(hf_dirs, lora_runs, tmp_path, family):
    base = hf_dirs[family]
    lora, qlora = str(tmp_path / "lora"), str(tmp_path / "qlora")

    def lora_run():
        finetune(base, lora)
        s = summary(lora)
        assert s["method"] == "lora" and s["load"]["layout"] == "transformers", s
        loss_fell(lora)

    def nf4_run():
        finetune(base, qlora, "--weight_quantize_algo", "nf4")
        q = summary(qlora)
        assert q["method"] == "lora+nf4" and q["quantization"]["layout"] == "transformers", q
        assert q["quantization"]["quantized_layers"] == 14, q["quantization"]
        loss_fell(qlora)

    failures = run_jobs({"lora": lora_run, "nf4": nf4_run})  # independent: two at a time
    if "lora" not in failures:
        lora_runs[family] = lora
    assert not failures, (family, failures)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_merge_into_the_transformers_base_and_predict(hf_dirs, lora_runs, tmp_path, family):
    if family not in lora_runs:
        pytest.skip(f"needs test_lora_and_nf4_finetune[{family}]'s adapter")
    base, lora = hf_dirs[family], lora_runs[family]
    merged = str(tmp_path / "merged")
    m = run([MERGE, "--model_name_or_path", base, "--lora_path", lora, "--merge_model_path", merged, "--device", "cpu"])
    info = json.load(open(os.path.join(merged, "merge_info.json")))
    # verify: the merged model's logits equal base + adapter's (the base read through the transposes)
    assert info["verify"]["status"] == "passed" and info["modules_merged"] == 14, m.stdout[-2000:]
    assert os.path.isfile(os.path.join(merged, "tokenizer.json"))

    prompts = str(tmp_path / "prompts.json")
    with open(prompts, "w") as f:
        for src in ("type#shirt*color#red", "你好"):
            f.write(json.dumps({"src": src}, ensure_ascii=False) + "\n")

    # the merged bf16 weights round W + delta once more than base + adapter in float32: answers may differ
    def from_merged():
        got = predictions(merged, prompts, str(tmp_path / "p1.json"))
        assert all(got), got

    def with_adapter():
        got = predictions(base, prompts, str(tmp_path / "p2.json"), "--lora_path", lora)
        assert all(got), got

    failures = run_jobs({"merged": from_merged, "base + adapter": with_adapter})
    assert not failures, (family, failures)


def test_dpo_on_a_transformers_directory(hf_dirs, tmp_path):
    out = tmp_path / "dpo"
    data = os.path.join(ROOT, "llm", "data", "dpo_tiny")
    run(
        [
            DPO,
            os.path.join(ROOT, "llm", "config", "tiny", "dpo_lora_argument.json"),
            "--output_dir",
            out,
            "--model_name_or_path",
            hf_dirs["qwen2"],
            "--train_dataset_path",
            data,
            "--dev_dataset_path",
            data,
            "--max_steps",
            "10",
            "--do_eval",
            "false",
        ]
    )
    s = summary(out)
    assert s["load"]["layout"] == "transformers" and s["method"] == "lora"
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert losses and losses[-1] < losses[0]


def test_what_the_decoder_would_compute_otherwise_is_refused_with_exit_2(hf_dirs, tmp_path):
    """llama trains on our decoder: a RoPE it does not compute (dynamic) and load-time fusion (it keeps the
    projections as stored) are refused at config time (yarn, which PaddleNLP's llama ignored, is computed now)."""
    d = tmp_path / "dynamic"
    shutil.copytree(hf_dirs["llama"], d)
    edit_config(str(d), rope_scaling={"rope_type": "dynamic", "factor": 4.0})

    def fused_qkv():
        r = finetune(hf_dirs["llama"], str(tmp_path / "o"), "--fuse_attention_qkv", "true", check=False)
        assert r.returncode == 2 and "trains on our decoder" in r.stderr and "Traceback" not in r.stderr, (
            r.returncode,
            r.stderr[-2000:],
        )

    def dynamic():
        r = finetune(str(d), str(tmp_path / "o2"), check=False)
        assert r.returncode == 2 and "rope_scaling.rope_type='dynamic'" in r.stderr and "Traceback" not in r.stderr, (
            r.returncode,
            r.stderr[-2000:],
        )

    failures = run_jobs({"fuse_attention_qkv": fused_qkv, "dynamic": dynamic})
    assert not failures, failures
