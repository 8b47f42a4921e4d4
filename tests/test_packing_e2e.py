"""Packing end to end: loss invariance on the tiny model, the tools, lazy streaming and resume."""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA_DIR, ROOT

from paddlenlp_ext.data.streaming import StreamingPackedDataset
from paddlenlp_ext.data.tokenize import tokenize_example


def multi_turn_dir(tmp_path, n=24):
    rng = np.random.RandomState(0)
    d = tmp_path / "multi"
    d.mkdir()
    lines = []
    for i in range(n):
        turns = int(rng.randint(1, 4))
        src = [f"type#dress*color#{c}" for c in rng.choice(["red", "blue", "green"], turns)]
        tgt = [f"A {c} dress, turn {t}." for t, c in enumerate(rng.choice(["soft", "warm"], turns))]
        row = {"src": src, "tgt": tgt}
        if i % 3 == 0:
            row["context"] = {"system": "Write ads."}
        lines.append(json.dumps(row))
    for split in ("train", "dev"):
        (d / f"{split}.json").write_text("\n".join(lines) + "\n")
    return str(d)


def tiny_features(tok, data_dir, n, max_length=128):
    from paddlenlp_ext.data.reader import read_examples

    exs = read_examples([os.path.join(data_dir, "train.json")])[:n]
    return [tokenize_example(e, tok, 64, max_length, False)[0] for e in exs]


@pytest.mark.parametrize("attention", ["eager", "flash_dense_mask", "flash_mask"])
@pytest.mark.parametrize("data", ["advertise", "multi_turn"])
def test_packed_loss_and_grads_equal_unpacked(tiny_model_dir, tiny_tokenizer, tmp_path, attention, data):
    """eager: dense mask through the model's own attention; flash_dense_mask: use_flash_attention
    with a dense packed mask (Paddle's CPU SDPA ignores the mask when is_causal is set; our
    patch applies it); flash_mask: FlashMask start rows through the CPU kernel."""
    from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM

    from paddlenlp_ext.integrations.flashmask import cpu_flashmask
    from paddlenlp_ext.training.packing_check import check_packing

    data_dir = DATA_DIR if data == "advertise" else multi_turn_dir(tmp_path)
    feats = tiny_features(tiny_tokenizer, data_dir, 12, max_length=200)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    flash_mask = attention == "flash_mask"
    config.use_flash_attention = attention != "eager"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config)
    with cpu_flashmask() if config.use_flash_attention else contextlib.nullcontext():
        r = check_packing(model, feats, 256, tiny_tokenizer.pad_token_id, flash_mask=flash_mask)
    assert r["packs"] < r["examples"]
    assert r["loss_abs_diff"] <= 1e-5 and r["grad_max_rel_diff"] <= 1e-5, r


def test_check_packing_tool_and_data_report_tool(tiny_model_dir, tmp_path):
    base = [
        os.path.join(ROOT, "llm/config/tiny/sft_argument.json"),
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(tmp_path / "o"),
        "--zero_padding",
        "true",
        "--greedy_zero_padding",
        "true",
    ]
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm/tools/check_packing.py"),
            *base,
            "--use_flash_attention",
            "true",
            "--flash_mask",
            "true",
            "--check_examples",
            "8",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["ok"] and out["flash_mask"] and out["examples"] == 8
    mt = multi_turn_dir(tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "llm/tools/data_report.py"),
            *base,
            "--dataset_name_or_path",
            mt,
            "--max_length",
            "64",
            "--src_length",
            "16",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)["train"]
    for key in (
        "examples",
        "truncated_examples",
        "packs",
        "padding_ratio",
        "supervised_fraction",
        "tokens",
        "length_histogram",
    ):
        assert key in rep, key
    assert rep["examples"] == 24 and rep["packing"] == "greedy"
    # the definition, from the report's own counts: rows of max_length 64 minus the real tokens in them
    assert rep["padding_ratio"] == pytest.approx(1 - rep["tokens"] / (rep["packs"] * 64), abs=1e-6)
    assert rep["packs"] < rep["examples"] and rep["padding_ratio"] < 0.25
    assert sum(rep["length_histogram"].values()) == 24


def _stream(tok, group_size=16, start=None, packed=True):
    tokenize = lambda ex: tokenize_example(ex, tok, 64, 256, False)  # noqa: E731
    return StreamingPackedDataset(
        [os.path.join(DATA_DIR, "train.json")],
        tokenize,
        256,
        tok.pad_token_id,
        greedy=True,
        group_size=group_size,
        seed=3,
        start=start,
        packed=packed,
    )


def _take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def test_stream_resumes_at_cursor_without_replay(tiny_tokenizer):
    full = _stream(tiny_tokenizer)
    rows = _take(full, 40)
    for k in (0, 5, 7, 23):  # inside and at the edges of groups
        cursor = full.position_after(k)
        resumed = _stream(tiny_tokenizer, start=cursor)
        again = _take(resumed, 10)
        for a, b in zip(rows[k : k + 10], again):
            assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(a["labels"], b["labels"])
        # no replay: the resumed stream read only from its group start on
        assert resumed.stats["examples"] <= full.stats["examples"] - cursor.group_index * 16 + 16
    # deterministic, and every group packs into rows of max_length
    assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(rows, _take(_stream(tiny_tokenizer), 40)))
    assert all(len(r["input_ids"]) == 256 for r in rows)


def test_stream_reads_one_group_at_a_time(tiny_tokenizer):
    """Memory is bounded by the group: taking 20 rows reads only the examples in
    them plus at most one group ahead (examples are >= 65 tokens, so <= 3 per row of 256)."""
    ds = _stream(tiny_tokenizer, group_size=8)
    _take(ds, 20)
    assert ds.stats["examples"] <= 20 * 3 + 8
    assert ds.stats["examples"] < 2000


def test_lazy_run_resumes_from_checkpoint(tiny_model_dir, tmp_path):
    cli = os.path.join(ROOT, "llm/run_finetune.py")
    common = [
        sys.executable,
        cli,
        os.path.join(ROOT, "llm/config/tiny/sft_argument.json"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name_or_path",
        DATA_DIR,
        "--output_dir",
        str(tmp_path / "o"),
        "--zero_padding",
        "true",
        "--greedy_zero_padding",
        "true",
        "--lazy",
        "true",
        "--greedy_group_size",
        "64",
        "--per_device_train_batch_size",
        "2",
        "--save_strategy",
        "steps",
        "--save_steps",
        "6",
        "--eval_before_train",
        "false",
        "--do_eval",
        "false",
    ]
    r = subprocess.run(common + ["--max_steps", "6"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = tmp_path / "o" / "checkpoint-6"
    assert json.loads((ckpt / "data_state.json").read_text())["skip_rows"] == 12
    r = subprocess.run(
        common + ["--max_steps", "12", "--resume_from_checkpoint", str(ckpt)], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "lazy stream resumes at" in r.stdout + r.stderr
    s = json.loads((tmp_path / "o" / "run_summary.json").read_text())
    assert s["global_steps"] == 12
    # the resumed stream re-read only its current group (64 examples), not the 6 x 2 rows before it
    assert s["data"]["train"]["stream"]["examples"] <= 3 * 64


def test_cli_trains_with_zero_padding_and_flash_mask_on_cpu(tiny_model_dir, tmp_path):
    from test_e2e import run_cli, summary

    r, out = run_cli(
        "llm/config/tiny/sft_argument.json",
        tmp_path,
        "--max_steps",
        "20",
        "--per_device_train_batch_size",
        "2",
        "--zero_padding",
        "true",
        "--greedy_zero_padding",
        "true",
        "--use_flash_attention",
        "true",
        "--flash_mask",
        "true",
    )
    s = summary(out)
    assert "flashmask_attention (block-sparse, CPU; packed documents: per document)" in r.stderr
    train = s["data"]["train"]
    assert train["packing"] == "greedy" and train["packs"] < train["examples"]
    assert s["eval_loss"] < 0.8 * s["eval_loss_before_train"]
    # only example tokens are counted: 20 steps x 2 rows x 256 slots, minus padding
    assert s["tokens_trained"] <= 20 * 2 * 256 and s["tokens_trained"] > 20 * 2 * 256 * (
        1 - train["padding_ratio"] - 0.1
    )


def test_resume_refuses_incomplete_checkpoint(tiny_model_dir, tmp_path):
    from test_e2e import run_cli

    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text("{}")  # a save cut short: no completion marker
    r, _ = run_cli(
        "llm/config/tiny/sft_argument.json", tmp_path, "--max_steps", "6", "--resume_from_checkpoint", ckpt, check=False
    )
    assert r.returncode == 2 and "is incomplete" in r.stderr
