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


def test_check_detects_a_rejected_answer_that_sees_the_chosen_one(tiny_model_dir, tiny_tokenizer, tiny_pairs,
                                                                   monkeypatch):
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
    r = packing_check.check_pair_packing(model, tiny_pairs[:4], 256, tiny_tokenizer.pad_token_id, flash_mask=False,
                                         greedy=False)
    assert r["max_rel_diff"] > 1e-3, r


def test_check_packing_tool_recognises_preference_data(tiny_model_dir, tmp_path):
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, os.path.join(ROOT, "llm", "tools", "check_packing.py"),
                        os.path.join(ROOT, "llm", "config", "tiny", "dpo_lora_argument.json"),
                        "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path), "--zero_padding", "true",
                        "--use_flash_attention", "true", "--flash_mask", "true", "--check_examples", "12"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert out["pairs"] == 12 and out["rows"] < 12 and out["ok"] and out["max_rel_diff"] <= 1e-4
