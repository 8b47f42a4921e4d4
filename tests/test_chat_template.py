"""The judge of chat-template rendering: our token ids of a conversation with tools and a tool call equal
transformers' ``apply_chat_template(messages, tools=..., tokenize=True)`` under the same jinja template and
tokenizer directory, and the supervised positions are exactly the assistant tokens plus their end-of-turn.

Our side loads the directory the way training does (``load_config`` -> ``load_tokenizer`` ->
``build_datasets``); transformers loads it with ``AutoTokenizer.from_pretrained`` (the tiny Llama's
sentencepiece model, slow tokenizer).  The Qwen2.5-style tool template below is written for this test.
"""

import json
import os
import shutil

import pytest

from paddlenlp_ext.data import chat_template
from paddlenlp_ext.data.chat_template import pick_named

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{{ eos_token }}\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}{{ eos_token }}\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}{{ eos_token }}\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}{{ m.content }}"
    '{%- for tc in m.tool_calls or [] %}\n<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}{{ eos_token }}\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>{{ eos_token }}\n"
    "{%- elif m.role != 'system' %}{{ raise_exception('unknown role ' + m.role) }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    },
    {"role": "tool", "content": '{"t": 20}'},
    {"role": "assistant", "content": "It is 20 C in Paris.", "reasoning_content": "The tool said 20."},
]
# what each assistant turn is, as the template writes it (+ its end-of-turn token, eos)
ASSISTANT_TEXTS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<think>The tool said 20.</think>\nIt is 20 C in Paris.",
]


def test_docstring_examples():
    import doctest

    assert doctest.testmod(chat_template).failed == 0


@pytest.fixture(scope="module")
def template_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model directory with the template in tokenizer_config.json (and the sentencepiece model also
    under transformers' name tokenizer.model)."""
    d = str(tmp_path_factory.mktemp("tpl") / "model")
    shutil.copytree(tiny_model_dir, d)
    shutil.copy(os.path.join(d, "sentencepiece.bpe.model"), os.path.join(d, "tokenizer.model"))
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def our_features(template_dir, tmp_path, records, **keys):
    from paddlenlp_ext.config.parse import load_config
    from paddlenlp_ext.data.build import build_datasets
    from paddlenlp_ext.training.run import load_tokenizer

    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(
        json.dumps(
            {
                "model_name_or_path": template_dir,
                "dataset_name_or_path": str(data),
                "output_dir": str(tmp_path / "out"),
                "do_train": True,
                "max_steps": 1,
                "max_length": 1024,
                **keys,
            }
        )
    )
    cfg = load_config(str(cfg_path))
    tok = load_tokenizer(cfg)
    return build_datasets(cfg, tok, do_train=True, do_eval=False, seed=1), tok


def test_ids_equal_transformers_apply_chat_template(template_dir, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(template_dir, use_fast=False, legacy=True)
    hf_msgs = json.loads(json.dumps(MESSAGES))
    hf_msgs[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}  # HF templates take a dict
    want = hf.apply_chat_template(hf_msgs, tools=TOOLS, tokenize=True)
    data, tok = our_features(template_dir, tmp_path, [{"messages": MESSAGES, "tools": TOOLS}])
    (feat,) = data.train
    ids = feat["input_ids"] + [feat["labels"][-1]]  # unshift: the last label is the last token
    assert ids == want
    assert data.reports["train"]["template"] == "jinja" and data.reports["train"]["sources"]

    # supervised positions: exactly the assistant turns' tokens plus their eos, found independently with
    # transformers' tokenizer: each assistant text + eos is a contiguous run of `want` right after a header
    sup = [i + 1 for i, x in enumerate(feat["labels"]) if x != -100]  # token positions carrying loss
    expected = []
    for text in ASSISTANT_TEXTS:
        body = hf(text + hf.eos_token, add_special_tokens=False)["input_ids"]
        header = hf("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        starts = [
            i
            for i in range(len(want))
            if want[i : i + len(body)] == body and want[i - len(header[-2:]) : i] == header[-2:]
        ]
        assert len(starts) == 1, text
        expected += list(range(starts[0], starts[0] + len(body)))
    assert sup == expected
    assert [want[i] for i in sup].count(hf.eos_token_id) == 2  # each turn's end-of-turn token is learned


def test_train_on_prompt_never_supervises_tool_results(template_dir, tmp_path):
    data, tok = our_features(template_dir, tmp_path, [{"messages": MESSAGES, "tools": TOOLS}], train_on_prompt=True)
    (feat,) = data.train
    tokens = feat["input_ids"] + [feat["labels"][-1]]
    learned = [t for t, l in zip(tokens[1:], feat["labels"]) if l != -100]
    unlearned = tok.decode([t for t, l in zip(tokens[1:], feat["labels"]) if l == -100])
    assert "20" in unlearned and "tool_response" in unlearned and len(learned) > len(tokens) // 2


def test_role_order_the_template_refuses_names_the_line(template_dir, tmp_path):
    from paddlenlp_ext.data.reader import DataError

    bad = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
    }
    tpl = TEMPLATE.replace(
        "{%- if m.role == 'user' %}",
        "{%- if m.role == 'user' and loop.index > 2 %}"
        "{{ raise_exception('only one user turn') }}{%- elif m.role == 'user' %}",
    )
    (tmp_path / "t.jinja").write_text(tpl)
    with pytest.raises(
        DataError,
        match=r"chat.jsonl:2: could not tokenize: the chat template cannot render this "
        r"conversation: only one user turn",
    ):
        our_features(
            template_dir,
            tmp_path,
            [{"messages": MESSAGES, "tools": TOOLS}, bad],
            chat_template=str(tmp_path / "t.jinja"),
        )


def test_named_templates_pick_tool_use():
    assert pick_named([{"name": "default", "template": "A"}], True, "x") == "A"
    assert pick_named("S", False, "x") == "S"
