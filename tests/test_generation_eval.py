"""eval_with_do_generation: metric math (worked examples), prompts, and the CLI path."""

import json
import os

import pytest

from paddlenlp_ext.data.reader import Example
from paddlenlp_ext.data.tokenize import generation_prompt
from paddlenlp_ext.evaluation.metrics import corpus_bleu, rouge_l, score, tokenize


def test_tokenize_words_punctuation_and_cjk():
    assert tokenize("A red dress, 红色.") == ["a", "red", "dress", ",", "红", "色", "."]


def test_bleu_worked_examples():
    assert corpus_bleu(["the cat sat"], ["the cat sat"]) == pytest.approx(1.0)
    # all (smoothed) precisions are 1; brevity penalty exp(1 - 3/2)
    assert corpus_bleu(["the cat"], ["the cat sat"]) == pytest.approx(0.6065306597)
    assert corpus_bleu(["dog"], ["the cat sat"]) == 0.0
    assert corpus_bleu([""], ["x"]) == 0.0


def test_rouge_l_worked_example():
    assert rouge_l("the red dress", "a red dress") == pytest.approx(2 / 3)
    assert rouge_l("", "") == 1.0 and rouge_l("a", "") == 0.0


def test_score_keys_and_exact_match():
    s = score(["yes", "no"], ["yes", "maybe"])
    assert s["exact_match"] == 0.5 and 0 < s["rouge_l"] < 1 and set(s) == {"exact_match", "bleu4", "rouge_l"}


def test_generation_prompt_is_everything_before_last_target(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = Example(src=["color#red", "type#dress"], tgt=["Red.", "A dress."])
    prompt, ref = generation_prompt(ex, tok, 64, 128, False)
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    expected = [tok.bos_token_id] + enc("color#red") + enc("Red.") + [tok.eos_token_id] + enc("type#dress")
    assert prompt == expected and ref == "A dress."


def test_cli_eval_with_do_generation(tiny_model_dir, tmp_path):
    from test_e2e import run_cli, summary

    data = tmp_path / "data"
    data.mkdir()
    rows = [json.dumps({"src": "type#dress*color#red", "tgt": "A red dress."})] * 3
    for split in ("train", "dev"):
        (data / f"{split}.json").write_text("\n".join(rows) + "\n")
    # later overrides win: the dataset is ours, not run_cli's default
    r, out = run_cli("llm/config/tiny/sft_argument.json", tmp_path, "--do_train", "false", "--max_length", "48",
                     "--src_length", "24", "--eval_with_do_generation", "true", "--save_generation_output", "true",
                     "--top_k", "5", "--top_p", "0.9", "--dataset_name_or_path", data, name="gen")
    s = summary(out)
    for k in ("eval_exact_match", "eval_bleu4", "eval_rouge_l"):
        assert 0.0 <= s[k] <= 1.0
    preds = [json.loads(line) for line in (out / "generated_predictions.json").read_text().splitlines()]
    assert len(preds) == 3 and preds[0]["reference"] == "A red dress."
    assert "generation eval:" in r.stdout
    assert "eval_bleu4" in json.loads((out / "eval_results.json").read_text())
