"""eval_with_do_generation: metric math (worked examples), prompts, and the CLI path."""

import json
import math

import pytest

from paddlenlp_ext.data.reader import Example
from paddlenlp_ext.data.tokenize import generation_prompt
from paddlenlp_ext.evaluation.metrics import corpus_bleu, rouge_l, score, tokenize


def test_tokenize_words_punctuation_and_cjk():
    assert tokenize("A red dress, 红色.") == ["a", "red", "dress", ",", "红", "色", "."]


def test_bleu_worked_examples():
    # BLEU-4 (Papineni et al. 2002): BP * exp(sum_n log(p_n) / 4), p_n = clipped n-gram matches / n-grams of the
    # prediction, pooled over the corpus; BP = exp(1 - r/c) when c <= r (c, r: corpus prediction/reference
    # lengths), else 1.  The n > 1 precisions are add-one smoothed, (m + 1) / (t + 1) (Lin & Och 2004).
    assert corpus_bleu(["the cat sat"], ["the cat sat"]) == pytest.approx(1.0)
    # "the cat" vs "the cat sat": p1 = 2/2, p2 = (1+1)/(1+1), p3 = p4 = (0+1)/(0+1); BP = exp(1 - 3/2)
    assert corpus_bleu(["the cat"], ["the cat sat"]) == pytest.approx(math.exp(-0.5))  # 0.6065306597
    # pred "the cat sat on the mat" (c = 6), ref "the cat sat on a red mat" (r = 7):
    #   1-grams the x2, cat, sat, on, mat; "the" clipped to its 1 reference count -> p1 = 5/6
    #   2-grams the-cat cat-sat sat-on on-the the-mat: 3 in the ref           -> p2 = (3+1)/(5+1) = 4/6
    #   3-grams the-cat-sat cat-sat-on sat-on-the on-the-mat: 2 in the ref      -> p3 = (2+1)/(4+1) = 3/5
    #   4-grams the-cat-sat-on cat-sat-on-the sat-on-the-mat: 1 in the ref      -> p4 = (1+1)/(3+1) = 2/4
    #   p1 p2 p3 p4 = 5/6 * 4/6 * 3/5 * 1/2 = 1/6; BP = exp(1 - 7/6) = exp(-1/6)
    #   BLEU = (1/6) ** (1/4) * exp(-1/6) = 0.638943 * 0.846482 = 0.540854
    assert corpus_bleu(["the cat sat on the mat"], ["the cat sat on a red mat"]) == pytest.approx(
        (1 / 6) ** 0.25 * math.exp(-1 / 6)
    )
    assert corpus_bleu(["the cat sat on the mat"], ["the cat sat on a red mat"]) == pytest.approx(0.5408537)
    # clipping, and no brevity penalty when the prediction is longer (c = 4 > r = 2):
    # "the the the the" vs "the cat": p1 = min(4, 1)/4 = 1/4, p2 = (0+1)/(3+1), p3 = (0+1)/(2+1), p4 = (0+1)/(1+1)
    # BLEU = (1/4 * 1/4 * 1/3 * 1/2) ** (1/4) = (1/96) ** (1/4) = 0.319472
    assert corpus_bleu(["the the the the"], ["the cat"]) == pytest.approx((1 / 96) ** 0.25)
    # corpus BLEU pools counts and lengths (it is not a mean of sentence scores):
    # ["the cat sat", "dog"] vs ["the cat sat", "a dog"]: p1 = 4/4, p2 = (2+1)/(2+1), p3 = (1+1)/(1+1),
    # p4 = (0+1)/(0+1); c = 4, r = 5 -> BLEU = BP = exp(1 - 5/4) = 0.778801
    assert corpus_bleu(["the cat sat", "dog"], ["the cat sat", "a dog"]) == pytest.approx(math.exp(-0.25))
    # no unigram matches: p1 = 0 -> 0 (p1 is not smoothed)
    assert corpus_bleu(["dog"], ["the cat sat"]) == 0.0
    assert corpus_bleu([""], ["x"]) == 0.0


def test_rouge_l_worked_example():
    # ROUGE-L (Lin 2004): P = LCS/len(pred), R = LCS/len(ref), F1 = 2PR/(P+R) = 2 LCS / (len(pred) + len(ref))
    assert rouge_l("the red dress", "a red dress") == pytest.approx(2 / 3)  # LCS "red dress": 2*2/(3+3)
    # LCS of "the cat sat on the mat" (6) and "the cat sat on a red mat" (7) is "the cat sat on mat" = 5, a
    # subsequence, not a substring (the longest common substring "the cat sat on" has 4):
    # P = 5/6, R = 5/7, F1 = 2*5/(6+7) = 10/13 = 0.769231
    assert rouge_l("the cat sat on the mat", "the cat sat on a red mat") == pytest.approx(10 / 13)
    # order matters (it is not bag-of-words): LCS("mat the", "the mat") = 1 -> F1 = 2*1/(2+2)
    assert rouge_l("mat the", "the mat") == pytest.approx(0.5)
    assert rouge_l("", "") == 1.0 and rouge_l("a", "") == 0.0


def test_score_worked_example():
    # exact match 1/2; ROUGE-L is the mean of the pairs' F1, (1 + 0)/2 (not the F1 of the joined texts, 0.4);
    # BLEU pools the corpus: p1 = 1/2 ("yes" of "yes no"), no 2/3/4-grams in the predictions ((0+1)/(0+1) = 1
    # each), c = 2 < r = 3 -> BP = exp(1 - 3/2); BLEU = (1/2) ** (1/4) * exp(-1/2) = 0.840896 * 0.606531 = 0.510029
    s = score(["yes", "no"], ["yes", "maybe so"])
    assert s == {"exact_match": 0.5, "bleu4": pytest.approx(0.5**0.25 * math.exp(-0.5)), "rouge_l": 0.5}
    # exact match compares whole strings: case and punctuation count (unlike the BLEU/ROUGE tokens)
    # (surrounding spaces are stripped): only the first of these three matches "A red dress."
    assert score([" A red dress. ", "a red dress.", "A red dress"], ["A red dress."] * 3)["exact_match"] == 1 / 3


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
    src = "type#dress*color#red"
    (data / "train.json").write_text(json.dumps({"src": src, "tgt": "A red dress."}) + "\n")
    (data / "dev.json").write_text((json.dumps({"src": src, "tgt": "A red dress, size M."}) + "\n") * 3)
    # 30 steps memorize the one training answer (each of its tokens gets p > 0.999, so the top_p 0.9 nucleus is
    # that one token and sampling is deterministic); the dev reference differs, so every metric has a known value.
    # Later overrides win: the dataset is ours, not run_cli's default.
    r, out = run_cli(
        "llm/config/tiny/sft_argument.json",
        tmp_path,
        "--max_steps",
        "30",
        "--warmup_steps",
        "0",
        "--learning_rate",
        "0.01",
        "--per_device_train_batch_size",
        "3",
        "--eval_before_train",
        "false",
        "--max_length",
        "48",
        "--src_length",
        "24",
        "--eval_with_do_generation",
        "true",
        "--save_generation_output",
        "true",
        "--top_k",
        "5",
        "--top_p",
        "0.9",
        "--dataset_name_or_path",
        data,
        name="gen",
    )
    preds = [json.loads(line) for line in (out / "generated_predictions.json").read_text().splitlines()]
    assert [(p["prediction"], p["reference"]) for p in preds] == [("A red dress.", "A red dress, size M.")] * 3
    # prediction tokens: a red dress .  (4 each, c = 12); reference: a red dress , size m .  (7 each, r = 21)
    #   exact match 0
    #   BLEU (pooled over the 3 pairs): p1 = 12/12; p2 = (6+1)/(9+1) (a-red, red-dress match; dress-. does not);
    #     p3 = (3+1)/(6+1) (a-red-dress); p4 = (0+1)/(3+1); p1 p2 p3 p4 = 1 * 7/10 * 4/7 * 1/4 = 1/10;
    #     BP = exp(1 - 21/12) = exp(-3/4); BLEU = (1/10) ** (1/4) * exp(-3/4) = 0.562341 * 0.472367 = 0.265629
    #   ROUGE-L: LCS "a red dress ." = 4, F1 = 2*4/(4+7) = 8/11 = 0.727273 for each pair
    expected = {"eval_exact_match": 0.0, "eval_bleu4": 0.1**0.25 * math.exp(-0.75), "eval_rouge_l": 8 / 11}
    s = summary(out)
    assert {k: s[k] for k in expected} == pytest.approx(expected)
    assert "generation eval: eval_exact_match 0.0000, eval_bleu4 0.2656, eval_rouge_l 0.7273" in r.stdout
    assert json.loads((out / "eval_results.json").read_text())["eval_bleu4"] == pytest.approx(expected["eval_bleu4"])


def test_prompt_and_reference_every_format():
    from paddlenlp_ext.data.conversation import Renderer
    from paddlenlp_ext.data.formats import parse_record
    from paddlenlp_ext.evaluation.generation import prompt_and_reference
    from test_formats import SIMPLE, Tok

    tok = Tok()
    no_template = Renderer(tok, 64, 64, False)
    msgs = {
        "messages": [
            {"role": "user", "content": "color#red"},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "type#dress"},
            {"role": "assistant", "content": "A dress."},
        ]
    }
    ex = Example(src=["color#red", "type#dress"], tgt=["Red.", "A dress."], origin="d:1")
    want = prompt_and_reference(ex, no_template)
    assert want[1:] == ("A dress.", "type#dress")
    for rec in (
        msgs,
        {
            "conversations": [
                {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in msgs["messages"]
            ]
        },
        {"instruction": "type#dress", "output": "A dress.", "history": [["color#red", "Red."]]},
    ):
        assert prompt_and_reference(parse_record(rec, "auto", "d:1"), no_template) == want  # same as src/tgt
    jinja = Renderer(tok, 64, 64, False, {False: SIMPLE}, Tok.special_tokens_map, train_on_prompt=True)
    ids, ref, _ = prompt_and_reference(parse_record(msgs, "auto", "d:1"), jinja)
    inv = {v: k for k, v in tok.vocab.items()}
    assert [inv[i] for i in ids] == [
        "<user>",
        "color#red",
        "</s>",
        "<assistant>",
        "Red.",
        "</s>",
        "<user>",
        "type#dress",
        "</s>",
        "<assistant>",
    ] and ref == "A dress."


@pytest.mark.slow
def test_cli_eval_with_do_generation_on_a_messages_dev_file(tiny_model_dir, tmp_path):
    """The CLI test above with OpenAI messages files: the same prompts (no template), so the same metrics."""
    from test_e2e import run_cli, summary

    data = tmp_path / "data"
    data.mkdir()
    src = "type#dress*color#red"

    def rec(answer):
        return json.dumps({"messages": [{"role": "user", "content": src}, {"role": "assistant", "content": answer}]})

    (data / "train.jsonl").write_text(rec("A red dress.") + "\n")
    (data / "dev.jsonl").write_text((rec("A red dress, size M.") + "\n") * 3)
    r, out = run_cli(
        "llm/config/tiny/sft_argument.json",
        tmp_path,
        "--max_steps",
        "30",
        "--warmup_steps",
        "0",
        "--learning_rate",
        "0.01",
        "--per_device_train_batch_size",
        "3",
        "--eval_before_train",
        "false",
        "--max_length",
        "48",
        "--src_length",
        "24",
        "--eval_with_do_generation",
        "true",
        "--save_generation_output",
        "true",
        "--top_k",
        "5",
        "--top_p",
        "0.9",
        "--dataset_name_or_path",
        data,
        name="gen",
    )
    preds = [json.loads(line) for line in (out / "generated_predictions.json").read_text().splitlines()]
    assert [(p["prediction"], p["reference"], p["src"]) for p in preds] == [
        ("A red dress.", "A red dress, size M.", src)
    ] * 3
    expected = {"eval_exact_match": 0.0, "eval_bleu4": 0.1**0.25 * math.exp(-0.75), "eval_rouge_l": 8 / 11}
    s = summary(out)
    assert {k: s[k] for k in expected} == pytest.approx(expected)
