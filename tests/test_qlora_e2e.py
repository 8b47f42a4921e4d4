"""QLoRA through the CLI: LoRA on a quantized frozen base learns for every algo; reload re-quantizes."""

import json

import pytest

from test_e2e import run_cli, summary

ALGOS = ["weight_only_int8", "weight_only_int4", "nf4", "fp4"]
# the tiny model's MLP down_proj has in_features 176, so block-wise formats use blocks of 16
BLOCK = ("--weight_blocksize", "16")


@pytest.mark.parametrize("algo", ALGOS)
def test_lora_on_quantized_base_lowers_loss(tiny_model_dir, tmp_path, algo):
    extra = BLOCK + ("--weight_double_quant", "true") if algo in ("nf4", "fp4") else ()
    _, out = run_cli("llm/config/tiny/lora_argument.json", tmp_path, "--max_steps", "20",
                     "--per_device_train_batch_size", "8", "--weight_quantize_algo", algo, *extra)
    s = summary(out)
    assert s["method"] == f"lora+{algo}"
    assert s["quantization"]["layers_replaced"] == 14
    assert s["eval_loss"] < 0.85 * s["eval_loss_before_train"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["quantization"]["weight_quantize_algo"] == algo
    if algo == "nf4":  # evaluating the adapter re-quantizes the base the same way
        _, out2 = run_cli("llm/config/tiny/lora_argument.json", tmp_path, "--lora_path", out, "--do_train", "false",
                          "--eval_before_train", "false", name="reload")
        s2 = summary(out2)
        assert s2["quantization"]["algo"] == "nf4"
        assert s2["eval_loss"] == pytest.approx(s["eval_loss"], rel=1e-5)


def test_shape_the_format_cannot_take_is_a_clear_error(tiny_model_dir, tmp_path):
    r, _ = run_cli("llm/config/tiny/lora_argument.json", tmp_path, "--max_steps", "2",
                   "--weight_quantize_algo", "nf4", check=False)
    assert r.returncode == 2
    assert "in_features must be divisible by weight_blocksize=64" in r.stderr and "Traceback" not in r.stderr
