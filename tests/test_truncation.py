"""The one truncation policy (paddlenlp_ext/data/truncation.py, docs/data.md): oldest history round first, then the
prompt from the left, then the answers' tails -- shown token by token for fine-tuning (jinja conversations) and
preference pairs (src/tgt and tool-call conversations).  Fast: a word-level tokenizer."""

import doctest
import json

import pytest

from paddlenlp_ext.data import truncation
from paddlenlp_ext.data.conversation import Renderer, fit_conversation
from paddlenlp_ext.data.formats import Conversation, Message
from test_formats import SIMPLE, Tok


def test_docstring_examples():
    assert doctest.testmod(truncation).failed == 0


def words(tok, ids):
    inv = {v: k for k, v in tok.vocab.items()} | {1: "<s>", 2: "</s>"}
    return [inv[i] for i in ids]


def conv3():
    """system + three rounds; SIMPLE renders each message as ``<role> content </s>``."""
    return Conversation(
        [
            Message("system", "sys"),
            Message("user", "q1 a b"),
            Message("assistant", "r1"),
            Message("user", "q2 c d"),
            Message("assistant", "r2"),
            Message("user", "q3 e f g h"),
            Message("assistant", "r3 x y z"),
        ],
        origin="f:7",
    )


def test_sft_whole_when_it_fits():
    tok = Tok()
    # 32 tokens: system 3, round 1 = 5 + 3, round 2 = 5 + 3, last prompt 7 + the header 1, answer 5
    feat, truncated, dropped = fit_conversation(conv3(), tok, SIMPLE, Tok.special_tokens_map, False, 32, 32)
    assert not truncated and dropped == 0 and len(feat["input_ids"]) == 31


def kept_words(tok, feat):
    return words(tok, feat["input_ids"] + [feat["labels"][-1]])


def test_sft_oldest_round_goes_first_then_the_prompt_from_the_left_then_the_answer():
    tok = Tok()
    # max_length 20: round 1 goes (24 left), then round 2 (16 fit)
    feat, truncated, dropped = fit_conversation(conv3(), tok, SIMPLE, Tok.special_tokens_map, False, 20, 20)
    assert truncated and dropped == 2
    assert kept_words(tok, feat) == [
        "<system>",
        "sys",
        "</s>",
        "<user>",
        "q3",
        "e",
        "f",
        "g",
        "h",
        "</s>",
        "<assistant>",
        "r3",
        "x",
        "y",
        "z",
        "</s>",
    ]
    # src_length 8: the last prompt (system + round 3 up to the answer's header, 11 tokens) is cut from the left
    # to 8, the system prompt kept; then the history goes as before
    feat, _, dropped = fit_conversation(conv3(), tok, SIMPLE, Tok.special_tokens_map, False, 20, 8)
    assert dropped == 2 and kept_words(tok, feat) == [
        "<system>",
        "sys",
        "</s>",
        "f",
        "g",
        "h",
        "</s>",
        "<assistant>",
        "r3",
        "x",
        "y",
        "z",
        "</s>",
    ]
    # max_length 8, src_length 5: a 5-token prompt, and the answer keeps its first 3 tokens (its eos is cut)
    feat, _, _ = fit_conversation(conv3(), tok, SIMPLE, Tok.special_tokens_map, False, 8, 5)
    assert kept_words(tok, feat) == ["<system>", "sys", "</s>", "</s>", "<assistant>", "r3", "x", "y"]
    assert [x for x in feat["labels"] if x != -100] == [tok.vocab[w] for w in ("r3", "x", "y")]


def test_sft_history_answers_stay_learned_when_their_round_fits():
    tok = Tok()
    feat, _, dropped = fit_conversation(conv3(), tok, SIMPLE, Tok.special_tokens_map, False, 24, 24)
    assert dropped == 1
    assert words(tok, [x for x in feat["labels"] if x != -100]) == ["r2", "</s>", "r3", "x", "y", "z", "</s>"]


def test_renderer_counts_and_drops_what_cannot_learn():
    tok = Tok()
    r = Renderer(tok, 4, 6, False, {False: SIMPLE}, Tok.special_tokens_map)
    feats, truncated, dropped = r(conv3())
    assert (
        truncated
        and dropped == 2
        and kept_words(tok, feats[0]) == ["<system>", "sys", "</s>", "<assistant>", "r3", "x"]
    )


def test_preference_pair_multi_turn_kept_tokens():
    from paddlenlp_ext.dpo.data import PreferenceExample, tokenize_pair

    tok = Tok()
    ex = PreferenceExample(
        src=["q1 a b", "q2 c", "q3 d e f"], tgt=["r1", "r2"], chosen="good answer here", rejected="bad", origin="p:1"
    )
    # no template: [bos] + q1 a b + r1 </s> + q2 c + r2 </s> + q3 d e f | good answer here </s> | bad </s>
    pair, info = tokenize_pair(ex, tok, 12, 6, False)
    assert words(tok, pair["prompt"]) == ["<s>", "q3", "d", "e", "f"]  # both earlier rounds went, oldest first
    assert words(tok, pair["chosen"]) == ["good", "answer", "here", "</s>"] and words(tok, pair["rejected"]) == [
        "bad",
        "</s>",
    ]
    assert info == {"truncated_prompt": False, "truncated_response": False, "dropped_rounds": 2}
    pair, info = tokenize_pair(ex, tok, 15, 10, False)  # round 2 fits back: the prompt is 9 <= 10, 9 + 6 <= 15
    assert words(tok, pair["prompt"]) == ["<s>", "q2", "c", "r2", "</s>", "q3", "d", "e", "f"]
    assert info["dropped_rounds"] == 1
    pair, info = tokenize_pair(ex, tok, 9, 4, False)  # then the prompt from the left, then the answers' tails
    assert words(tok, pair["prompt"]) == ["<s>", "d", "e", "f"]
    assert words(tok, pair["chosen"]) == ["good", "answer", "here"] and words(tok, pair["rejected"]) == ["bad", "</s>"]
    assert info == {"truncated_prompt": True, "truncated_response": True, "dropped_rounds": 2}


TOOL_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }}{% for c in m.tool_calls or [] %} CALL "
    "{{ c.function.name }}{% endfor %} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


@pytest.mark.parametrize("form", ["sharegpt", "openai"])
def test_tool_call_pairs_render_tool_turns_and_score_only_the_answers(tmp_path, form):
    from paddlenlp_ext.data.reader import DataError
    from paddlenlp_ext.dpo.data import read_preference_files, tokenize_preference_examples

    if form == "sharegpt":
        rec = {
            "conversations": [
                {"from": "human", "value": "weather paris"},
                {"from": "function_call", "value": json.dumps({"name": "w", "arguments": {}})},
                {"from": "observation", "value": "sunny"},
            ],
            "chosen": {"from": "gpt", "value": "it is sunny"},
            "rejected": {"from": "gpt", "value": "no idea"},
            "tools": json.dumps([{"name": "w", "parameters": {}}]),
        }
    else:
        rec = {
            "messages": [
                {"role": "user", "content": "weather paris"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}],
                },
                {"role": "tool", "content": "sunny"},
            ],
            "chosen": {"role": "assistant", "content": "it is sunny"},
            "rejected": "no idea",
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}],
        }
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    (ex,) = read_preference_files([str(path)])
    assert ex.conversation is not None
    tok = Tok()
    jinja = ({False: TOOL_TEMPLATE, True: TOOL_TEMPLATE}, Tok.special_tokens_map)
    (pair,), st = tokenize_preference_examples([ex], tok, 64, 32, False, jinja)
    assert words(tok, pair["prompt"]) == [
        "<user>",
        "weather",
        "paris",
        "</s>",
        "<assistant>",
        "CALL",
        "w",
        "</s>",
        "<tool>",
        "sunny",
        "</s>",
        "<assistant>",
    ]
    assert words(tok, pair["chosen"]) == ["it", "is", "sunny", "</s>"]  # scored: the answers only
    assert words(tok, pair["rejected"]) == ["no", "idea", "</s>"]
    with pytest.raises(
        DataError,
        match=r"p.jsonl:1: tool calls, tool results and tools in a preference pair are "
        r"rendered by a jinja chat template",
    ):
        tokenize_preference_examples([ex], tok, 64, 32, False, ({False: None, True: None}, {}))


def test_grpo_prompt_drops_the_oldest_round_then_keeps_its_end():
    from paddlenlp_ext.grpo.data import fit_prompt, prompt_from_record

    tok = Tok()
    r = Renderer(tok, 1 << 30, 1 << 30, False, {False: SIMPLE}, Tok.special_tokens_map)
    rec = prompt_from_record(
        {
            "messages": [
                {"role": "user", "content": "q1 a b"},
                {"role": "assistant", "content": "r1"},
                {"role": "user", "content": "q2 c d e"},
            ],
            "k": 1,
        },
        "g:1",
    )
    ids, truncated, dropped = fit_prompt(rec, r, 64)  # 5 + 3 + 6 + the header
    assert not truncated and words(tok, ids)[:2] == ["<user>", "q1"] and len(ids) == 15
    ids, truncated, dropped = fit_prompt(rec, r, 8)  # round 1 goes: <user> q2 c d e </s> <assistant> = 7
    assert truncated and dropped == 1 and words(tok, ids) == ["<user>", "q2", "c", "d", "e", "</s>", "<assistant>"]
    ids, truncated, dropped = fit_prompt(rec, r, 4)  # then from the left
    assert words(tok, ids) == ["d", "e", "</s>", "<assistant>"]


def test_long_multi_turn_pair_of_the_e2e_file_keeps_exactly_the_last_question(tiny_tokenizer, tmp_path):
    """One of the 3% long pairs of tests/test_long_pairs_e2e.py with the tiny Llama's tokenizer (no template):
    the three history rounds go, the last question and both answers stay whole."""
    from paddlenlp_ext.dpo.data import read_preference_files, tokenize_preference_examples
    from test_long_pairs_e2e import dpo_records

    path = tmp_path / "train.json"
    path.write_text(json.dumps(dpo_records()[:10]))
    pairs, st = tokenize_preference_examples(read_preference_files([str(path)]), tiny_tokenizer, 256, 128, False)
    enc = lambda t: tiny_tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    bos, eos = tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id
    assert pairs[7]["prompt"] == [bos] + enc("What color is item 7?")
    assert pairs[7]["chosen"] == enc("Item 7 is gray.") + [eos] and pairs[7]["rejected"] == enc("I cannot say.") + [eos]
    assert st["truncated_examples"] == 1 and st["dropped_rounds"] == 3 and st["truncated_prompts"] == 0
    assert pairs[6]["prompt"] == [bos] + enc("What color is item 6?")  # a short pair: untouched
