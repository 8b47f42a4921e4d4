"""DPO on the rows our decoder builds (``Family.decoder``): the pair rows' masks and position ids are honoured.

Fast: per decoder row (tiny transformers-saved model of ``test_decoder_parity``, its non-default knobs: windows,
soft-caps, longrope, NoPE layers, ...), packed preference rows (several pairs per row; the rejected answer
restarts its positions at len(prompt) and must not see the chosen one) give every chosen / rejected log-prob of
each answer run alone (``dpo.packing_check``), with FlashMask start rows and with the dense 4-D mask.
Slow: ``llm/run_dpo.py`` LoRA DPO through the CLI on a transformers-saved checkpoint of two rows.
"""

import json
import os

import numpy as np
import pytest

from paddlenlp_ext.models.family_table import FAMILIES, feature_problem
from test_decoder_parity import VOCAB, build

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DECODER_ROWS = [k for k, f in FAMILIES.items() if f.decoder]


def _pairs(n=6, seed=0, short=False):
    rng = np.random.default_rng(seed)

    def ids(lo, hi):
        return [int(t) for t in rng.integers(3, VOCAB, size=int(rng.integers(lo, hi)))]

    if short:
        return [{"prompt": ids(2, 5), "chosen": ids(2, 5), "rejected": ids(2, 5)} for _ in range(n)]
    return [{"prompt": ids(3, 8), "chosen": ids(2, 7), "rejected": ids(2, 7)} for _ in range(n)]


#: longrope rows switch short -> long factors on the largest position of the batch (transformers' per-forward
#: switch), so packed rows are exact while every position stays below original_max_position_embeddings (16 in
#: the test's phi3; Phi-3-mini-128k: 4096): rows of 16 there.  Above it one pair can switch another's RoPE.
ROW_LENGTH = {"phi3": 16}


@pytest.mark.parametrize("flash_mask", [True, False], ids=["start_rows", "dense_mask"])
@pytest.mark.parametrize("model_type", DECODER_ROWS)
def test_packed_pair_logps_equal_each_answer_alone(model_type, flash_mask, tmp_path_factory):
    from paddlenlp_ext.dpo.packing_check import check_pair_packing

    _, _, ours = build(model_type, tmp_path_factory)
    length = ROW_LENGTH.get(model_type, 64)
    r = check_pair_packing(ours, _pairs(short=length < 64), length, 0, flash_mask=flash_mask)
    assert r["rows"] < r["pairs"] == 6  # really packed
    assert r["max_rel_diff"] <= 1e-5 and r["max_abs_diff"] <= 1e-3, (model_type, r)


def test_dpo_is_allowed_on_every_decoder_row():
    dense = [k for k in DECODER_ROWS if FAMILIES[k].arch.mlp != "moe"]
    assert len(dense) >= 7 and all(feature_problem(k, "dpo") is None for k in dense)
    # the MoE rows too: the policy forward's router aux loss joins the DPO loss (tests/test_moe_align.py)
    moe = [k for k in DECODER_ROWS if FAMILIES[k].arch.mlp == "moe"]
    assert len(moe) >= 6 and all(feature_problem(k, "dpo") is None for k in moe)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gemma2", "phi3"])
def test_lora_dpo_through_the_cli(model_type, tmp_path):
    """llm/run_dpo.py (LoRA, packed pairs with FlashMask start rows) on a transformers-saved bf16 sharded checkpoint:
    the DPO loss falls and the chosen answers gain on the rejected ones (reward margin rises)."""
    from conftest import ROOT
    from test_decoder_cli import run, save_row

    base = save_row(model_type, str(tmp_path / "base"))
    out = tmp_path / "dpo"
    run(
        [
            os.path.join(ROOT, "llm", "run_dpo.py"),
            os.path.join(ROOT, "llm", "config", "tiny", "dpo_lora_argument.json"),
            "--model_name_or_path",
            base,
            "--output_dir",
            out,
            "--max_steps",
            "12",
            "--do_eval",
            "false",
            "--max_seq_len",
            "256",
            "--max_prompt_len",
            "128",
            "--learning_rate",
            "2e-2",
            "--warmup_steps",
            "0",
            "--zero_padding",
            "true",
            "--flash_mask",
            "true",
            "--use_flash_attention",
            "true",
        ]
    )
    with open(out / "trainer_state.json") as f:
        logs = [h for h in json.load(f)["log_history"] if "loss" in h]
    loss = [h["loss"] for h in logs]
    assert len(loss) == 12 and sum(loss[-3:]) < 0.8 * sum(loss[:3]), (model_type, loss)
