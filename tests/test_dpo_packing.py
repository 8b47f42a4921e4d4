"""Packed preference pairs give the same per-pair log-probs as each answer run alone (dpo/packing_check)."""

import contextlib
import os

import numpy as np
import pytest

from conftest import ROOT

DPO_TINY = os.path.join(ROOT, "llm", "data", "dpo_tiny", "train.json")


@pytest.fixture(scope="module")
def tiny_pairs(tiny_tokenizer):
    from paddlenlp_ext.dpo.data import read_preference_files, tokenize_preference_examples

    examples = read_preference_files([DPO_TINY])
    pairs, stats = tokenize_preference_examples(examples, tiny_tokenizer, 256, 128, use_chat_template=False)
    lengths = [len(p["prompt"]) + len(p["chosen"]) + len(p["rejected"]) for p in pairs]
    assert len(set(lengths)) > 5  # varied lengths
    return pairs


def model_for(tiny_model_dir, flash):
    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.use_flash_attention = flash
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config)


@pytest.mark.parametrize("attention", ["eager_dense_mask", "flash_mask"])
def test_packed_pair_logps_equal_each_answer_alone(tiny_model_dir, tiny_tokenizer, tiny_pairs, attention):
    from paddlenlp_ext.dpo.packing_check import check_pair_packing
    from paddlenlp_ext.integrations.flashmask import cpu_flashmask

    flash = attention == "flash_mask"
    model = model_for(tiny_model_dir, flash)
    with cpu_flashmask() if flash else contextlib.nullcontext():
        r = check_pair_packing(model, tiny_pairs[:16], 256, tiny_tokenizer.pad_token_id, flash_mask=flash)
    assert r["rows"] < r["pairs"] == 16  # really packed
    assert r["max_rel_diff"] <= 1e-5 and r["max_abs_diff"] <= 1e-3, r


def test_check_detects_a_rejected_answer_that_sees_the_chosen_one(
    tiny_model_dir, tiny_tokenizer, tiny_pairs, monkeypatch
):
    """Negative control: the same check on rows whose rejected answer can see the chosen one fails."""
    from paddlenlp_ext.dpo import packing_check, pair_rows

    real = pair_rows.build_pair_row

    def leaky(pairs, max_length=None, pad_token_id=0):
        row = real(pairs, max_length, pad_token_id)
        n = int(row["length"])
        row["attn_mask_startend_row_indices"][:n] = n  # one causal span: rejected sees chosen (and other pairs)
        return row

    monkeypatch.setattr(pair_rows, "build_pair_row", leaky)
    model = model_for(tiny_model_dir, False)
    r = packing_check.check_pair_packing(
        model, tiny_pairs[:4], 256, tiny_tokenizer.pad_token_id, flash_mask=False, greedy=False
    )
    assert r["max_rel_diff"] > 1e-3, r


def test_check_packing_tool_recognises_preference_data(tiny_model_dir, tmp_path):
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm", "tools", "check_packing.py"),
            os.path.join(ROOT, "llm", "config", "tiny", "dpo_lora_argument.json"),
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            "--zero_padding",
            "true",
            "--use_flash_attention",
            "true",
            "--flash_mask",
            "true",
            "--check_examples",
            "12",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout[r.stdout.index("{") :])
    assert out["pairs"] == 12 and out["rows"] < 12 and out["ok"] and out["max_rel_diff"] <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lm_head_at_scored_rows_equals_the_full_forward(request, tiny_tokenizer, tiny_pairs, family, monkeypatch):
    """scored_logits' body + lm_head on the T scored rows == the model's full [B, S, V] forward:
    the same per-answer log-probs and the same gradients (so training is unchanged, only cheaper)."""
    import paddle

    from paddlenlp_ext.dpo import logps as logps_mod
    from paddlenlp_ext.dpo.pair_rows import PreferenceCollator, PreferenceDataset
    from paddlenlp_ext.models import heads

    model_dir = request.getfixturevalue("tiny_model_dir" if family == "llama" else "tiny_qwen2_dir")
    model = model_for(model_dir, False)
    assert heads.split_lm_head(model) is not None  # the cheap path is really taken for this family
    ds = PreferenceDataset(
        tiny_pairs[:8], 256, packing="greedy", pad_token_id=tiny_tokenizer.pad_token_id, shuffle=False
    )
    batch = PreferenceCollator(tiny_tokenizer.pad_token_id, False, 256)([ds[i] for i in range(len(ds))])
    inputs = {k: paddle.to_tensor(batch[k]) for k in ("input_ids", "position_ids", "attention_mask")}
    index, tok, seg = (paddle.to_tensor(batch[k]) for k in ("logp_index", "logp_token", "logp_segment"))

    def run():
        model.clear_gradients()
        logits, idx = logps_mod.scored_logits(model, inputs, index)
        c, r, _, _ = logps_mod.pair_logps(logits, idx, tok, seg, int(batch["num_pairs"]))
        (c.sum() - 2 * r.sum()).backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        return c.numpy(), r.numpy(), list(logits.shape), grads

    c1, r1, shape1, g1 = run()
    monkeypatch.setattr(heads, "split_lm_head", lambda m, router_aux=False: None)
    c2, r2, shape2, g2 = run()
    assert shape1[:2] == [1, int(tok.shape[0])] and shape2[:2] == list(batch["input_ids"].shape)
    np.testing.assert_allclose(c1, c2, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(r1, r2, rtol=1e-5, atol=1e-4)
    assert g1.keys() == g2.keys() and len(g1) > 5
    for name in g1:
        # fp32 sums in another order: compare relative to the gradient's scale
        scale = max(1e-6, float(np.abs(g2[name]).max()))
        np.testing.assert_allclose(g1[name], g2[name], rtol=1e-4, atol=1e-5 * scale, err_msg=name)
