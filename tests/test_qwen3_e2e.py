"""Qwen3 end to end through the real CLIs, on the tiny Qwen3 (head_dim 32 != hidden 64 / 4 heads).

LoRA, QLoRA (nf4), full fine-tuning with zero padding + FlashMask, ``check_packing`` (exact), DPO, the merge
(verified against base + adapter) and the predictor (adapter vs merged model: the same greedy answers).
Each run is short; its loss must fall and its sizes must follow head_dim.
"""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, all_on_first_use, run_jobs

pytestmark = pytest.mark.slow

FAST = (
    "--per_device_train_batch_size",
    "8",
    "--logging_steps",
    "5",
    "--eval_before_train",
    "false",
    "--do_eval",
    "false",
)
STEPS20 = ("--max_steps", "20")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def cli(script, *args, timeout=900):
    cmd = [sys.executable, os.path.join(ROOT, script), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout)
    assert r.returncode == 0, " ".join(cmd) + "\n" + r.stdout[-3000:] + r.stderr[-5000:]
    assert "Traceback" not in r.stderr
    return r


def losses(out):
    state = json.loads((out / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def runs(tiny_qwen3_dir, tmp_path_factory):
    """name -> output dir, trained once per module (the four runs on the first use, conftest.all_on_first_use)."""
    base = tmp_path_factory.mktemp("qwen3")
    specs = {
        "lora": ("llm/run_finetune.py", "llm/config/tiny/lora_argument.json", FAST + STEPS20),
        "qlora": (
            "llm/run_finetune.py",
            "llm/config/tiny/lora_argument.json",
            FAST + STEPS20 + ("--weight_quantize_algo", "nf4"),
        ),
        "full_packed_flashmask": (
            "llm/run_finetune.py",
            "llm/config/tiny/sft_argument.json",
            FAST
            + (
                "--max_steps",
                "10",
                "--zero_padding",
                "true",
                "--greedy_zero_padding",
                "true",
                "--use_flash_attention",
                "true",
                "--flash_mask",
                "true",
            ),
        ),
        "dpo": (
            "llm/run_dpo.py",
            "llm/config/tiny/dpo_lora_argument.json",
            ("--max_steps", "5", "--per_device_train_batch_size", "4", "--do_eval", "false"),
        ),
    }

    def train(name):
        script, config, extra = specs[name]
        cli(script, config, "--model_name_or_path", tiny_qwen3_dir, "--output_dir", base / name, *extra)

    # the first use trains all four, two at a time; a test fails only if its own run failed
    trained = all_on_first_use({name: functools.partial(train, name) for name in specs})

    def get(name):
        trained(name)
        return base / name

    return get


def test_lora_trains_with_head_dim_sized_adapters(runs, tiny_qwen3_dir):
    out = runs("lora")
    c = json.loads(open(os.path.join(tiny_qwen3_dir, "config.json")).read())
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    assert q != h  # head_dim really differs from hidden / heads
    from safetensors.numpy import load_file

    t = load_file(str(out / "adapter_model.safetensors"))
    assert t["qwen3.layers.0.self_attn.q_proj.lora_B"].shape == (8, q)
    assert t["qwen3.layers.1.self_attn.k_proj.lora_B"].shape == (8, kv)
    assert t["qwen3.layers.0.self_attn.o_proj.lora_A"].shape == (q, 8)
    assert not any("norm" in k for k in t)  # LoRA targets the decoder linears only
    per_layer = 8 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h))
    s = json.loads((out / "run_summary.json").read_text())
    assert s["method"] == "lora" and s["trainable_params"] == c["num_hidden_layers"] * per_layer == 21760
    ls = losses(out)
    assert len(ls) == 4 and ls[-1] < ls[0] - 1.0, ls


def test_qlora_nf4_trains(runs):
    out = runs("qlora")
    s = json.loads((out / "run_summary.json").read_text())
    assert s["method"] == "lora+nf4" and s["trainable_params"] == 21760
    ls = losses(out)
    assert ls[-1] < ls[0] - 1.0, ls


def test_full_finetune_packed_with_flashmask_and_reload(runs, tiny_qwen3_dir):
    from paddlenlp_ext.models.registration import register_qwen3

    out = runs("full_packed_flashmask")
    s = json.loads((out / "run_summary.json").read_text())
    assert s["method"] == "full" and s["trainable_params"] == s["total_params"]
    ls = losses(out)
    assert len(ls) == 2 and ls[-1] < ls[0] - 1.0, ls
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["architectures"] == ["Qwen3ForCausalLM"]
    assert saved["head_dim"] == 32
    register_qwen3()
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM

    ids = paddle.to_tensor(np.arange(1, 9)[None])
    trained = AutoModelForCausalLM.from_pretrained(str(out), dtype="float32")
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype="float32")
    assert type(trained).__name__ == "Qwen3ForCausalLM"
    q_norm = "qwen3.layers.0.self_attn.q_norm.weight"  # the head norms were trained too
    assert np.abs(trained.state_dict()[q_norm].numpy() - base.state_dict()[q_norm].numpy()).max() > 1e-4
    assert np.abs(trained(ids)[0].numpy() - base(ids)[0].numpy()).max() > 0.1


def test_check_packing_is_exact_with_flashmask(tiny_qwen3_dir, tmp_path):
    r = cli(
        "llm/tools/check_packing.py",
        "llm/config/tiny/sft_argument.json",
        "--model_name_or_path",
        tiny_qwen3_dir,
        "--output_dir",
        tmp_path / "o",
        "--zero_padding",
        "true",
        "--greedy_zero_padding",
        "true",
        "--use_flash_attention",
        "true",
        "--flash_mask",
        "true",
        "--check_examples",
        "8",
    )
    out = json.loads(r.stdout)
    assert out["ok"] and out["flash_mask"] and out["packs"] < out["examples"] == 8
    assert out["loss_abs_diff"] <= 1e-5 and out["grad_max_rel_diff"] <= 1e-5, out


def test_dpo_trains(runs):
    out = runs("dpo")
    ls = losses(out)
    assert abs(ls[0] - np.log(2)) < 1e-4 and ls[-1] < ls[0] - 0.1, ls
    assert (out / "adapter_model.safetensors").exists()


def test_merge_then_predict_equals_adapter_predict(runs, tiny_qwen3_dir, tmp_path):
    lora = runs("lora")
    merged = tmp_path / "merged"
    common = [
        "--data_file",
        "llm/data/demo_prompts.json",
        "--decode_strategy",
        "greedy_search",
        "--max_length",
        "96",
        "--src_length",
        "48",
    ]

    def predict_with_adapter():  # runs beside the merge: it needs only the adapter
        cli(
            "llm/predict/predictor.py",
            "--model_name_or_path",
            tiny_qwen3_dir,
            "--lora_path",
            lora,
            "--output_file",
            tmp_path / "a.json",
            *common,
        )

    def merge_and_predict():
        r = cli(
            "llm/merge_lora_params.py",
            "--model_name_or_path",
            tiny_qwen3_dir,
            "--lora_path",
            lora,
            "--merge_model_path",
            merged,
        )
        assert "verify: passed" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]  # merged == base + adapter (1e-4)
        assert json.loads((merged / "config.json").read_text())["model_type"] == "qwen3"
        cli("llm/predict/predictor.py", "--model_name_or_path", merged, "--output_file", tmp_path / "m.json", *common)

    failures = run_jobs({"predict with the adapter": predict_with_adapter, "merge, then predict": merge_and_predict})
    assert not failures, failures
    read = lambda f: [json.loads(x)["output"] for x in (tmp_path / f).read_text().splitlines()]  # noqa: E731
    with_adapter, from_merged = read("a.json"), read("m.json")
    assert len(with_adapter) == 2 and all(with_adapter) and with_adapter == from_merged


def test_unsupported_setting_is_refused_with_exit_2(tiny_qwen3_dir, tmp_path):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "llm/run_finetune.py"),
        "llm/config/tiny/lora_argument.json",
        "--model_name_or_path",
        tiny_qwen3_dir,
        "--output_dir",
        str(tmp_path / "o"),
        "--fuse_attention_qkv",
        "true",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    # qwen3 runs on our decoder, which loads q/k/v as the checkpoint stores them: the key is refused, not ignored
    assert "fuse_attention_qkv=true: qwen3 trains on our decoder" in r.stdout + r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "o" / "adapter_model.safetensors").exists()
