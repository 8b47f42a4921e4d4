"""QLoRA through the CLI: LoRA on a quantized frozen base learns for every algo; reload re-quantizes."""

import json

import pytest

from test_e2e import run_cli, summary

# end-to-end through the CLI: `make test-slow` (CI runs it after `make test`)
pytestmark = pytest.mark.slow

ALGOS = ["weight_only_int8", "weight_only_int4", "nf4", "fp4"]
# the tiny model's MLP down_proj has in_features 176 = 2 * 64 + 48: at the default weight_blocksize 64 every
# channel of it ends in a short block of 48; fp4 runs with blocks of 16 (which divide every layer) for contrast
BLOCK = {"nf4": (), "fp4": ("--weight_blocksize", "16")}
# q, k, v, o, gate, up, down of both decoder layers ([in, out]: 64x64, 64x32, 64x32, 64x64, 64x176 twice, 176x64)
LAYERS, PARAMS = 14, 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 176 * 3)


def _counts(q):
    """(layers, params) quantized, from the run summary's stats (streaming loader's or quantize_model's keys)."""
    return q.get("quantized_layers", q.get("layers_replaced")), q.get("params_quantized", q.get("params"))


@pytest.mark.parametrize("algo", ALGOS)
def test_lora_on_quantized_base_lowers_loss(tiny_model_dir, tmp_path, algo):
    extra = BLOCK[algo] + ("--weight_double_quant", "true") if algo in BLOCK else ()
    _, out = run_cli(
        "llm/config/tiny/lora_argument.json",
        tmp_path,
        "--max_steps",
        "20",
        "--per_device_train_batch_size",
        "8",
        "--weight_quantize_algo",
        algo,
        *extra,
    )
    s = summary(out)
    assert s["method"] == f"lora+{algo}"
    assert _counts(s["quantization"]) == (LAYERS, PARAMS)  # every target, down_proj included
    assert s["eval_loss"] < 0.85 * s["eval_loss_before_train"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["quantization"]["weight_quantize_algo"] == algo
    if algo == "nf4":
        # default weight_blocksize 64 on down_proj's 176 inputs (used to be refused): a short last block of 48
        assert cfg["quantization"]["weight_blocksize"] == 64
        # evaluating the adapter re-quantizes the base the same way
        _, out2 = run_cli(
            "llm/config/tiny/lora_argument.json",
            tmp_path,
            "--lora_path",
            out,
            "--do_train",
            "false",
            "--eval_before_train",
            "false",
            name="reload",
        )
        s2 = summary(out2)
        assert _counts(s2["quantization"]) == (LAYERS, PARAMS)
        assert s2["eval_loss"] == pytest.approx(s["eval_loss"], rel=1e-5)


def test_a_block_size_no_format_can_take_is_a_clear_error(tiny_model_dir, tmp_path):
    r, _ = run_cli(
        "llm/config/tiny/lora_argument.json",
        tmp_path,
        "--max_steps",
        "2",
        "--weight_quantize_algo",
        "nf4",
        "--weight_blocksize",
        "7",
        check=False,
    )
    assert r.returncode == 2
    assert "weight_blocksize must be a positive even integer" in r.stderr and "Traceback" not in r.stderr
