"""MoE rows through llm/run_finetune.py with the router's load-balancing loss (slow).

Every decoder MoE row (family table: ``decoder`` and ``Arch.mlp == "moe"``) gets a transformers-saved
checkpoint (tests/test_decoder_cli.save_row: bf16, sharded, tokenizer.json).  LoRA with
``router_aux_loss_coef`` > 0 trains with a falling loss (and so do nf4 QLoRA and full fine-tuning); the aux loss and the per-layer expert load
are logged on their own (trainer_state.json's log_history, run_summary.json's ``moe``) and finite;
the alias gives the same run; what is not wired is refused at config time (exit 2, naming the key).
"""

import json
import math
import os

import pytest

from paddlenlp_ext.models.family_table import FAMILIES
from test_decoder_cli import finetune, losses, save_row

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

MOE_ROWS = [k for k, f in FAMILIES.items() if f.decoder and f.arch is not None and f.arch.mlp == "moe"]


def _logged(out):
    with open(os.path.join(out, "trainer_state.json")) as f:
        return [h for h in json.load(f)["log_history"] if "loss" in h]


@pytest.mark.parametrize("model_type", MOE_ROWS)
def test_lora_with_router_aux_loss_trains_and_logs_it(model_type, tmp_path):
    base = save_row(model_type, str(tmp_path / "base"))
    out = str(tmp_path / "lora")
    r = finetune(base, out, "--router_aux_loss_coef", "0.05")
    got = losses(out)
    assert len(got) == 20 and sum(got[-3:]) < 0.9 * sum(got[:3]), (model_type, got)
    logs = _logged(out)
    assert all(math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in logs), logs
    n_layers = len([k for k in logs[0] if k.startswith("expert_load_max_over_mean/")])
    assert n_layers >= 1
    for h in logs:
        loads = [h[f"expert_load_max_over_mean/moe_layer_{i}"] for i in range(n_layers)]
        assert all(math.isfinite(v) and v >= 1.0 for v in loads), h
    assert "aux loss" in r.stdout and "expert load max/mean" in r.stdout
    with open(os.path.join(out, "run_summary.json")) as f:
        moe = json.load(f)["moe"]
    assert moe["router_aux_loss_coef"] == 0.05 and len(moe["logged"]) == 20


#: nf4 QLoRA (experts quantized while streaming) and full fine-tuning, each with the aux loss in the training loss
_METHODS = {"nf4": (("--weight_quantize_algo", "nf4"), "lora+nf4"),
            "full": (("--lora", "false", "--learning_rate", "3e-3"), "full")}


@pytest.mark.parametrize("method", sorted(_METHODS))
@pytest.mark.parametrize("model_type", MOE_ROWS)
def test_qlora_and_full_with_router_aux_loss_train(model_type, method, tmp_path):
    base = save_row(model_type, str(tmp_path / "base"))
    out = str(tmp_path / method)
    extra, name = _METHODS[method]
    finetune(base, out, "--router_aux_loss_coef", "0.05", *extra)
    got = losses(out)
    assert len(got) == 20 and sum(got[-3:]) < 0.9 * sum(got[:3]), (model_type, method, got)
    assert all(math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in _logged(out))
    with open(os.path.join(out, "run_summary.json")) as f:
        summary = json.load(f)
    assert summary["method"] == name and summary["moe"]["router_aux_loss_coef"] == 0.05


def test_alias_no_coef_and_refusals(tmp_path):
    model_type = MOE_ROWS[0]
    base = save_row(model_type, str(tmp_path / "base"))
    # the alias is the same key: the same first step's aux loss
    out = str(tmp_path / "alias")
    finetune(base, out, "--moe_aux_loss_coef", "0.05", "--max_steps", "2")
    assert _logged(out)[0]["aux_loss"] > 0
    # no key and a checkpoint without output_router_logits: no aux loss (as transformers), nothing logged
    out = str(tmp_path / "none")
    finetune(base, out, "--max_steps", "2")
    assert "aux_loss" not in _logged(out)[0]
    with open(os.path.join(out, "run_summary.json")) as f:
        assert "moe" not in json.load(f)
    for extra, key in ((("--moe_router_bias_update_rate", "0.001"), "moe_router_bias_update_rate"),
                       (("--freeze_router", "true"), "freeze_router"),
                       (("--router_aux_loss_coef", "0.1", "--moe_aux_loss_coef", "0.2"), "moe_aux_loss_coef"),
                       (("--tensor_parallel_degree", "2"), "tensor_parallel_degree")):
        r = finetune(base, str(tmp_path / key), *extra, check=False)
        assert r.returncode == 2 and key in (r.stdout + r.stderr), (key, r.stdout[-2000:], r.stderr[-2000:])


def test_aux_loss_key_refused_on_a_dense_model(tmp_path):
    base = save_row("ernie4_5", str(tmp_path / "base"))
    r = finetune(base, str(tmp_path / "out"), "--router_aux_loss_coef", "0.01", check=False)
    assert r.returncode == 2 and "router_aux_loss_coef" in (r.stdout + r.stderr)


def test_merge_refusal_advice_works(tmp_path):
    """A LoRA on an MoE row: merging is refused (exit 2, naming the way out), and that way out -- the
    predictor with --lora_path -- answers."""
    from test_decoder_cli import PREDICT, run

    model_type = MOE_ROWS[0]
    base = save_row(model_type, str(tmp_path / "base"))
    out = str(tmp_path / "lora")
    finetune(base, out, "--max_steps", "2")
    merge = os.path.join(os.path.dirname(PREDICT), "..", "merge_lora_params.py")
    r = run([merge, "--model_name_or_path", base, "--lora_path", out, "--merge_model_path", str(tmp_path / "m")],
            check=False)
    assert r.returncode == 2 and "--lora_path" in (r.stdout + r.stderr), (r.stdout[-2000:], r.stderr[-2000:])
    prompts = tmp_path / "prompts.json"
    prompts.write_text('{"src": "hello world"}\n', encoding="utf-8")
    pred = tmp_path / "pred.json"
    run([PREDICT, "--model_name_or_path", base, "--lora_path", out, "--data_file", prompts, "--output_file", pred,
         "--src_length", "32", "--max_length", "48", "--device", "cpu"])
    rows = [json.loads(line) for line in pred.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 1 and "output" in rows[0], rows


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "mixtral", "qwen2_moe"])
def test_paddlenlp_layout_checkpoint_trains_with_the_aux_loss(model_type, tmp_path):
    """A checkpoint saved by PaddleNLP's own MoE class (PaddleNLP layout; its forward crashes on Paddle 3.3) trains
    on the decoder row with LoRA and the aux loss, as the transformers-layout one does."""
    from hf_tokenizers import build as build_tokenizer
    from test_moe_parity import save_paddlenlp_moe

    base = str(tmp_path / "base")
    save_paddlenlp_moe(model_type, base, vocab_size=704, std=0.05)
    build_tokenizer(base, "llama3")
    out = str(tmp_path / "lora")
    finetune(base, out, "--router_aux_loss_coef", "0.05")
    got = losses(out)
    assert len(got) == 20 and sum(got[-3:]) < 0.9 * sum(got[:3]), (model_type, got)
    assert all(math.isfinite(h["aux_loss"]) and h["aux_loss"] > 0 for h in _logged(out))
    with open(os.path.join(out, "run_summary.json")) as f:
        assert json.load(f)["load"]["layout"] == "paddlenlp"
