"""Bad checkpoints through the real CLI: a clear error naming the tensor/file, exit 2, before training."""

import json
import shutil

import pytest

from test_e2e import run_cli


def sharded_copy(tiny_model_dir, tmp_path):
    """The tiny model re-saved as several safetensors shards (+ index), tokenizer files alongside."""
    from paddlenlp.transformers import AutoModelForCausalLM

    dst = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.save_pretrained(str(dst), max_shard_size="200KB", safe_serialization=True)
    for f in ("sentencepiece.bpe.model", "special_tokens_map.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_dir}/{f}", dst / f)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    return dst, index


QLORA = ("--weight_quantize_algo", "nf4", "--weight_double_quant", "true", "--max_steps", "2")


def test_sharded_checkpoint_streams_and_trains(tiny_model_dir, tmp_path):
    dst, _ = sharded_copy(tiny_model_dir, tmp_path)
    r, out = run_cli("llm/config/tiny/lora_argument.json", tmp_path, "--model_name_or_path", dst, *QLORA)
    s = json.loads((out / "run_summary.json").read_text())
    assert s["quantization"]["quantized_layers"] == 14 and len(s["quantization"]["files"]) >= 3


@pytest.mark.parametrize("breakage", ["shape", "missing_shard"])
def test_bad_checkpoint_is_a_clear_error_exit_2(tiny_model_dir, tmp_path, breakage):
    dst, index = sharded_copy(tiny_model_dir, tmp_path)
    if breakage == "shape":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["intermediate_size"] = 192  # the checkpoint's MLP weights are 176 wide
        (dst / "config.json").write_text(json.dumps(cfg))
        expect = ["mlp", "176", "192"]
    else:
        name = sorted(set(index["weight_map"].values()))[1]
        (dst / name).unlink()
        expect = [name]
    r, out = run_cli("llm/config/tiny/lora_argument.json", tmp_path, "--model_name_or_path", dst, *QLORA, check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.split("config error:", 1)[-1]
    assert all(e in err for e in expect), err[-2000:]
    assert "Traceback" not in r.stderr
    assert not (out / "trainer_state.json").exists()  # failed before training
