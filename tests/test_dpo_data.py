"""Preference data for DPO: validation, truncation, pair rows, masks, packing, collator."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from paddlenlp_ext.data.packed_row import startend_to_dense_mask
from paddlenlp_ext.data.reader import DataError
from paddlenlp_ext.dpo.data import (
    build_preference_datasets,
    fit_pair,
    read_preference_files,
    tokenize_preference_examples,
)
from paddlenlp_ext.dpo.pair_rows import PreferenceCollator, PreferenceDataset, build_pair_row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "llm", "data", "dpo_tiny")

PAIR = {"prompt": [11, 12, 13], "chosen": [21, 22], "rejected": [31, 32]}


def test_single_pair_worked_example():
    r = build_pair_row([PAIR])
    assert r["input_ids"].tolist() == [11, 12, 13, 21, 22, 31, 32]
    assert r["position_ids"].tolist() == [0, 1, 2, 3, 4, 3, 4]
    assert r["attn_mask_startend_row_indices"].dtype == np.int32
    assert r["attn_mask_startend_row_indices"].tolist() == [7, 7, 7, 5, 5, 7, 7]
    # chosen[0] <- 2, chosen[1] <- 3, rejected[0] <- 2 (last prompt token), rejected[1] <- 5
    assert r["logp_index"].tolist() == [2, 3, 2, 5]
    assert r["logp_token"].tolist() == [21, 22, 31, 32]
    assert r["logp_segment"].tolist() == [0, 0, 1, 1]


def test_dense_mask_from_start_rows():
    expected = np.array(
        [
            # p  p  p  c  c  r  r
            [1, 0, 0, 0, 0, 0, 0],  # prompt
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],  # chosen
            [1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 1, 0],  # rejected: sees the prompt, not chosen
            [1, 1, 1, 0, 0, 1, 1],
        ],
        dtype=bool,
    )
    start = build_pair_row([PAIR])["attn_mask_startend_row_indices"]
    assert (startend_to_dense_mask(start) == expected).all()
    batch = PreferenceCollator(0, flash_mask=False)([build_pair_row([PAIR])])
    assert batch["attention_mask"].dtype == np.bool_ and batch["attention_mask"].shape == (1, 1, 7, 7)
    assert (batch["attention_mask"][0, 0] == expected).all()
    assert "attn_mask_startend_row_indices" not in batch


def test_two_pairs_packed_in_one_row_and_batch_offsets():
    second = {"prompt": [41, 42], "chosen": [51], "rejected": [61, 62]}
    r = build_pair_row([PAIR, second], max_length=14, pad_token_id=0)
    assert r["input_ids"].tolist() == [11, 12, 13, 21, 22, 31, 32, 41, 42, 51, 61, 62, 0, 0]
    assert r["position_ids"].tolist() == [0, 1, 2, 3, 4, 3, 4, 0, 1, 2, 2, 3, 0, 1]
    assert r["attn_mask_startend_row_indices"].tolist() == [7, 7, 7, 5, 5, 7, 7, 12, 12, 10, 12, 12, 12, 12]
    assert r["logp_index"].tolist() == [2, 3, 2, 5, 8, 8, 10]
    assert r["logp_token"].tolist() == [21, 22, 31, 32, 51, 61, 62]
    assert r["logp_segment"].tolist() == [0, 0, 1, 1, 2, 3, 3]
    # second row of a batch: indices shift by S, pairs continue the numbering
    b = PreferenceCollator(0, flash_mask=True, max_length=14)([r, build_pair_row([PAIR], 14)])
    assert b["num_pairs"] == 3 and b["num_real_tokens"] == 12 + 7  # padding excluded
    assert b["attn_mask_startend_row_indices"].shape == (2, 1, 14, 1)
    assert b["attn_mask_startend_row_indices"].dtype == np.int32
    assert b["logp_index"].tolist() == [2, 3, 2, 5, 8, 8, 10, 16, 17, 16, 19]
    assert b["logp_segment"].tolist() == [0, 0, 1, 1, 2, 3, 3, 4, 4, 5, 5]
    assert b["input_ids"].dtype == np.int64 and b["logp_index"].dtype == np.int64
    mask = startend_to_dense_mask(b["attn_mask_startend_row_indices"][0, 0, :, 0])
    assert not mask[7:, :7].any() and not mask[:, 12:].any() and not mask[12:].any()


def test_unpacked_rows_padded_per_batch_and_padding_never_scored():
    short = {"prompt": [41], "chosen": [51], "rejected": [61]}
    b = PreferenceCollator(0, flash_mask=True)([build_pair_row([short]), build_pair_row([PAIR])])
    S = b["input_ids"].shape[1]
    assert S == 7
    assert b["input_ids"][0].tolist() == [41, 51, 61, 0, 0, 0, 0]
    assert b["attn_mask_startend_row_indices"][0, 0, :, 0].tolist() == [3, 2, 3, 3, 3, 3, 3]
    rows, cols = np.divmod(b["logp_index"], S)
    for r, c in zip(rows.tolist(), cols.tolist()):
        assert b["input_ids"][r, c] != 0  # every scored position is a real token


def _write(tmp_path, lines, name="train.json"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(p)


def test_every_error_case_is_reported_with_file_line(tmp_path):
    ok = '{"src": "q", "tgt": [], "response": ["a", "b"], "sort": [1, 0]}'
    path = _write(
        tmp_path,
        [
            ok,
            '{"src": "q", "tgt": [], "response": ["a", "b"], "sort": [2, 2]}',  # 2 tie
            '{"src": "q", "tgt": [], "sort": [1, 0]}',  # 3 missing response
            '{"src": "q", "tgt": [], "response": ["a", "  "], "sort": [1, 0]}',  # 4 empty response
            '{"src": "q", "tgt": [], "response": ["a", "b", "c"], "sort": [1, 0]}',  # 5 three responses
            '{"src": ["q1", "q2"], "tgt": [], "response": ["a", "b"], "sort": [1, 0]}',  # 6 src != tgt+1
            '{"src": "q", "tgt": [], "response": ["a", "b"], "sort": [1, 0]',  # 7 bad JSON
            "",
            ok,
        ],
    )
    with pytest.raises(DataError) as ei:
        read_preference_files([path])
    problems = ei.value.problems
    assert len(problems) == 6
    expect = {
        2: "sort values tie",
        3: "missing key(s) 'response'",
        4: "response 1 is empty",
        5: "exactly 2 strings (got 3)",
        6: "mismatched turns: 2 src and 0 tgt",
        7: "invalid JSON",
    }
    for (line, text), msg in zip(sorted(expect.items()), problems):
        assert msg.startswith(f"{path}:{line}: ") and text in msg, msg


def test_chosen_is_higher_sort_and_strings_allowed(tmp_path):
    path = _write(tmp_path, ['{"src": ["h", "q"], "tgt": "t", "response": ["a", "b"], "sort": [0.1, 0.7]}'])
    (ex,) = read_preference_files([path])
    assert (ex.src, ex.tgt, ex.chosen, ex.rejected) == (["h", "q"], ["t"], "b", "a")


def test_fit_pair_truncation_rules():
    # fits: untouched
    assert fit_pair([1], [], [5], [6, 2], [7, 2], 8, 4)[:3] == ([1, 5], [6, 2], [7, 2])
    # prompt cut from the left to max_prompt_len (prefix kept), then responses in proportion
    prompt, c, r, info = fit_pair([1], [], [5, 6, 7, 8], [20, 21, 22, 23, 2], [30, 31, 2], 8, 2)
    assert prompt == [1, 8]
    assert (c, r) == ([20, 21, 22], [30, 31, 2])  # rest 6: chosen int(5/8*6)=3, rejected the other 3
    assert info == {"truncated_prompt": True, "truncated_response": True, "dropped_rounds": 0}
    # a prefix longer than the prompt budget: the prompt keeps its last tokens (no refusal), the answers the rest
    assert fit_pair([1, 2, 3], [], [5], [6, 2], [7, 2], 5, 4)[:3] == ([2, 3, 5], [6], [7])
    # the reported case: a long multi-turn history is cut (oldest round first) before the prompt, so the
    # prompt is bounded by max_prompt_len history included and the pair always fits
    history = [[10] * 300, [11] * 300]
    prompt, c, r, info = fit_pair([1], history, [5] * 80, [6] * 100 + [2], [7] * 50 + [2], 512, 256)
    assert prompt == [1] + [5] * 80 and (c, r) == ([6] * 100 + [2], [7] * 50 + [2])
    assert info == {"truncated_prompt": False, "truncated_response": False, "dropped_rounds": 2}


def test_truncation_counted_and_every_pair_fits(tiny_tokenizer, tmp_path):
    long = " ".join(["word"] * 60)
    path = _write(
        tmp_path,
        [
            json.dumps({"src": "short question", "tgt": [], "response": ["yes", "no"], "sort": [1, 0]}),
            json.dumps({"src": long, "tgt": [], "response": [long, "no"], "sort": [1, 0]}),
        ],
    )
    exs = read_preference_files([path])
    pairs, st = tokenize_preference_examples(exs, tiny_tokenizer, 32, 16, False)  # "short question": 12 tokens
    assert st["pairs"] == 2 and st["truncated_prompts"] == 1 and st["truncated_responses"] == 1
    assert st["truncated_examples"] == 1 and st["dropped_examples"] == 0
    assert all(len(p["prompt"]) + len(p["chosen"]) + len(p["rejected"]) <= 32 for p in pairs)
    assert len(pairs[1]["prompt"]) == 16 and len(pairs[0]["prompt"]) == 12
    # max_prompt_len 40 > what 32 leaves for two answers: the prompt gets 30, each answer keeps a token
    pairs, st = tokenize_preference_examples(exs, tiny_tokenizer, 32, 40, False)
    assert len(pairs[1]["prompt"]) == 30 and len(pairs[1]["chosen"]) == 1 and len(pairs[1]["rejected"]) == 1


def _check_batch_against_unpacked(batch, pairs_in_order):
    """Every scored position attends exactly to the unpacked context of the token it predicts."""
    S = batch["input_ids"].shape[1]
    start = batch["attn_mask_startend_row_indices"][:, 0, :, 0]
    masks = [startend_to_dense_mask(s) for s in start]
    for i, (flat, tok, seg) in enumerate(zip(batch["logp_index"], batch["logp_token"], batch["logp_segment"])):
        row, p = divmod(int(flat), S)
        pair = pairs_in_order[int(seg) // 2]
        answer = pair["rejected"] if seg % 2 else pair["chosen"]
        k = sum(1 for s in batch["logp_segment"][:i] if s == seg)  # index of the token inside its answer
        assert answer[k] == tok
        context = list(pair["prompt"]) + list(answer[:k])
        seen = np.flatnonzero(masks[row][p])
        assert batch["input_ids"][row, seen].tolist() == context
        assert batch["position_ids"][row, seen].tolist() == list(range(len(context)))
    for seg in range(2 * batch["num_pairs"]):
        pair = pairs_in_order[seg // 2]
        assert int((batch["logp_segment"] == seg).sum()) == len(pair["rejected"] if seg % 2 else pair["chosen"])


@pytest.mark.parametrize("packing", [None, "in_order", "greedy"])
def test_property_mask_matches_unpacked_context(packing):
    rng = np.random.default_rng(0)
    pairs = [
        {
            "prompt": rng.integers(3, 100, rng.integers(1, 6)).tolist(),
            "chosen": rng.integers(3, 100, rng.integers(1, 5)).tolist(),
            "rejected": rng.integers(3, 100, rng.integers(1, 5)).tolist(),
        }
        for _ in range(40)
    ]
    ds = PreferenceDataset(pairs, max_length=24, packing=packing, shuffle=False)
    if packing:
        assert len(ds) < len(pairs)
    collator = PreferenceCollator(0, flash_mask=True, max_length=24 if packing else None)
    order = [j for pack in ds.packs for j in pack]
    for b0 in range(0, len(ds), 3):
        rows = [ds[i] for i in range(b0, min(b0 + 3, len(ds)))]
        used = [j for pack in ds.packs[b0 : b0 + 3] for j in pack]
        _check_batch_against_unpacked(collator(rows), [pairs[j] for j in used])
    assert sorted(order) == list(range(len(pairs)))


def _args(**kw):
    base = dict(
        train_dataset_path=TINY,
        dev_dataset_path=os.path.join(TINY, "dev.json"),
        max_seq_len=256,
        max_prompt_len=128,
        zero_padding=True,
        greedy_zero_padding=True,
        lazy=False,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_build_preference_datasets_on_tiny_data(tiny_tokenizer):
    data = build_preference_datasets(_args(), tiny_tokenizer, do_train=True, do_eval=True, flash_mask=True)
    assert data.reports["train"]["pairs"] == 32 and data.reports["dev"]["pairs"] == 16
    assert data.reports["train"]["packing"] == "greedy" and data.reports["train"]["rows"] < 32
    batch = data.collator([data.train[0], data.train[1]])
    assert batch["input_ids"].shape == (2, 256)
    assert set(batch) == {
        "input_ids",
        "position_ids",
        "attn_mask_startend_row_indices",
        "logp_index",
        "logp_token",
        "logp_segment",
        "num_pairs",
        "num_real_tokens",
        "real_tokens",
    }
    plain = build_preference_datasets(
        _args(zero_padding=False, greedy_zero_padding=False),
        tiny_tokenizer,
        do_train=False,
        do_eval=True,
        flash_mask=False,
    )
    assert plain.train is None and len(plain.dev) == 16
    b = plain.collator([plain.dev[0], plain.dev[1]])
    assert b["attention_mask"].shape[:2] == (2, 1) and b["num_pairs"] == 2
    eos = tiny_tokenizer.eos_token_id
    assert b["logp_token"][b["logp_segment"] == 0][-1] == eos  # chosen ends with eos
    # lazy: the same pairs, streamed group by group (one epoch of the stream scores the same tokens)
    lazy = build_preference_datasets(
        _args(lazy=True, resume_cursor=None),
        tiny_tokenizer,
        do_train=True,
        do_eval=False,
        flash_mask=True,
        group_size=32,
    )  # a group = one epoch
    assert lazy.reports["train"]["lazy"] is True
    stream = iter(lazy.train)
    streamed = [next(stream) for _ in range(len(data.train))]  # the first group holds all 32 pairs
    assert sum(int(r["num_pairs"]) for r in streamed) == 32
    assert sum(len(r["logp_token"]) for r in streamed) == data.reports["train"]["scored_tokens"]
    assert lazy.collator(streamed[:2])["input_ids"].shape == (2, 256)
    with pytest.raises(ValueError, match="needs zero_padding"):
        build_preference_datasets(
            _args(zero_padding=False), tiny_tokenizer, do_train=True, do_eval=False, flash_mask=True
        )
