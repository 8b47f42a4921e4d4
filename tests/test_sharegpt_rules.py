"""ShareGPT as LLaMA-Factory reads it: the alternation rule, observations after any assistant turn (rendered as the
template's tool message, never learned), a leading system turn, custom tags, and the file:line report of a record
that breaks the rule.  Fast: a word-level tokenizer and small jinja templates."""

import json
import os

import pytest

from paddlenlp_ext.data.conversation import Renderer
from paddlenlp_ext.data.formats import read_items, sharegpt
from paddlenlp_ext.data.reader import DataError
from test_formats import Tok, labelled_words

DEMO_DIR = next(
    (
        d
        for d in (
            os.path.join(
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared", "data"
            ),
            "/work/shared/data",
        )
        if os.path.isdir(d)
    ),
    None,
)

# tool results render as a user-side <tool> message, as chat templates do
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }}{% for c in m.tool_calls or [] %} CALL "
    "{{ c.function.name }}{% endfor %} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def write(tmp_path, records, name="train.json"):
    p = tmp_path / name
    p.write_text(json.dumps(records, indent=1))
    return str(p)


def test_observation_after_a_plain_gpt_turn_is_a_tool_message_never_learned(tmp_path):
    rec = {
        "conversations": [
            {"from": "human", "value": "weather paris"},
            {"from": "gpt", "value": "calling get_weather city=paris"},  # the call written in the answer's text
            {"from": "observation", "value": "sunny twenty"},
            {"from": "gpt", "value": "it is sunny"},
        ]
    }
    (conv,), fmts = read_items([write(tmp_path, [rec])])
    assert [(m.role, m.content) for m in conv.messages] == [
        ("user", "weather paris"),
        ("assistant", "calling get_weather city=paris"),
        ("tool", "sunny twenty"),
        ("assistant", "it is sunny"),
    ]
    tok = Tok()
    r = Renderer(tok, 64, 64, False, {False: TEMPLATE, True: TEMPLATE}, Tok.special_tokens_map)
    (feat,), _, _ = r(conv)
    assert labelled_words(tok, feat) == ["calling", "get_weather", "city=paris", "</s>", "it", "is", "sunny", "</s>"]
    r.train_on_prompt = True  # even then the tool result is not learned
    (feat,), _, _ = r(conv)
    words = labelled_words(tok, feat)
    assert "sunny" in words and "twenty" not in words and "<tool>" not in words and "weather" in words


def test_leading_system_turn_is_the_system_prompt_and_wins_over_the_column(tmp_path):
    rec = {
        "system": "from the column",
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "yo"},
        ],
    }
    (conv,), _ = read_items([write(tmp_path, [rec])])
    assert [(m.role, m.content) for m in conv.messages] == [("system", "be brief"), ("user", "hi"), ("assistant", "yo")]
    del rec["conversations"][0]
    (conv,), _ = read_items([write(tmp_path, [rec])])
    assert conv.messages[0].content == "from the column"


def test_custom_tags_and_columns(tmp_path):
    cols = {
        "messages": "dialog",
        "system": "sys",
        "tools": "fns",
        "role_tag": "role",
        "content_tag": "text",
        "user_tag": "user",
        "assistant_tag": "bot",
        "observation_tag": "tool",
        "function_tag": "call",
        "system_tag": "sys_turn",
    }
    rec = {
        "dialog": [
            {"role": "sys_turn", "text": "s"},
            {"role": "user", "text": "q"},
            {"role": "call", "text": json.dumps({"name": "f", "arguments": {"a": 1}})},
            {"role": "tool", "text": "r"},
            {"role": "bot", "text": "done"},
        ],
        "fns": json.dumps([{"name": "f", "parameters": {}}]),
    }
    (conv,), _ = read_items([write(tmp_path, [rec])], "sharegpt", cols)
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv.messages[2].tool_calls[0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert conv.tools[0]["function"]["name"] == "f"


@pytest.mark.parametrize(
    "turns, message",
    [
        (["human", "human", "gpt"], r"conversations\[2\]: 'from' 'human' breaks ShareGPT's alternation"),
        (
            ["human", "gpt", "function_call"],
            r"conversations\[3\]: 'from' 'function_call' breaks ShareGPT's alternation",
        ),
        (["human", "gpt", "gpt", "human"], r"conversations\[3\]: 'from' 'gpt' breaks"),
        (["human", "gpt", "human"], r"has 3 turn\(s\) after the system turn; ShareGPT needs an even number"),
        (["human", "system", "gpt"], r"conversations\[2\]: 'from' 'system' breaks"),
    ],
)
def test_a_record_that_breaks_the_rule_stops_the_run_with_file_line(tmp_path, turns, message):
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    bad = {
        "conversations": [
            {"from": t, "value": '{"name": "f", "arguments": {}}' if t == "function_call" else "x"} for t in turns
        ]
    }
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, bad, good)) + "\n")
    with pytest.raises(DataError) as e:
        read_items([str(path)])
    (problem,) = e.value.problems  # the one bad record, named by its line; the good ones are not reported
    assert problem.startswith(f"{path}:2: ")
    import re

    assert re.search(message, problem), problem


def test_preference_prompt_may_end_with_an_observation():
    rec = {
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "function_call", "value": '{"name": "f", "arguments": {}}'},
            {"from": "observation", "value": "r"},
        ]
    }
    conv = sharegpt.convert(rec, "p:1", ranking=True)
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool"]
    with pytest.raises(ValueError, match="ShareGPT needs an odd number"):
        sharegpt.convert({"conversations": rec["conversations"][:2]}, "p:1", ranking=True)


@pytest.mark.skipif(DEMO_DIR is None, reason="../shared/data (LLaMA-Factory's demo files) is not here")
def test_glaive_demo_reads_whole():
    path = os.path.join(DEMO_DIR, "glaive_toolcall_en_demo.json")
    items, fmts = read_items([path])
    assert len(items) == 300 and fmts[path] == "sharegpt"
    assert sum(any(m.role == "tool" for m in c.messages) for c in items) > 100
