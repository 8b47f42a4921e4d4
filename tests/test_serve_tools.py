"""Tool calling and structured output through the official ``openai`` client against the server process.

The tiny Llama served with a Qwen2.5-style tool template (tests/test_chat_template.py's): the prompt
with ``tools`` equals transformers' ``apply_chat_template(tools=...)`` ids; ``tool_choice`` required /
named force a call through llguidance, parsed into ``message.tool_calls`` (streamed and not) whose
arguments validate against the function's schema; a second turn with the tool result is answered;
``response_format`` json_schema output parses and validates with ``jsonschema`` on 20 random prompts.
"""

import json

import numpy as np
import pytest
from test_chat_template import TEMPLATE

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from paddlenlp_ext.serve.process import ServerProcess

    path = tmp_path_factory.mktemp("tool_template") / "qwen_tools.jinja"
    path.write_text(TEMPLATE)
    with ServerProcess(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--served_model_name",
            "base",
            "--max_length",
            "1024",
            "--chat_template",
            str(path),
        ]
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_prompt_with_tools_equals_transformers(server, tiny_model_dir, tmp_path):
    import os
    import shutil

    from transformers import AutoTokenizer

    from paddlenlp_ext.serve.process import post

    d = str(tmp_path / "tok")
    shutil.copytree(tiny_model_dir, d)  # transformers' slow Llama tokenizer reads the model as tokenizer.model
    shutil.copy(os.path.join(d, "sentencepiece.bpe.model"), os.path.join(d, "tokenizer.model"))
    hf = AutoTokenizer.from_pretrained(d, use_fast=False, legacy=True)
    theirs = hf.apply_chat_template(ASK, tools=TOOLS, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True)
    status, ours = post(server.url + "/tokenize", {"messages": ASK, "tools": TOOLS})
    assert status == 200, ours
    assert ours["tokens"] == list(theirs)


def check_call(call, name=None):
    import jsonschema

    fn = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.type == "function" and call.id and call.function.name in fn
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), fn[call.function.name])


def test_required_and_named_tool_choice_give_parsed_calls(client):
    r = client.chat.completions.create(
        model="base", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    check_call(c.message.tool_calls[0])
    r = client.chat.completions.create(
        model="base",
        messages=ASK,
        tools=TOOLS,
        max_tokens=120,
        temperature=0.8,
        seed=5,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    check_call(r.choices[0].message.tool_calls[0], "get_time")
    # streamed as OpenAI streams calls: delta.tool_calls with index, id, name and arguments, then tool_calls
    chunks = list(
        client.chat.completions.create(
            model="base", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0, stream=True
        )
    )
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].index == 0 and calls[0].function.name == c.message.tool_calls[0].function.name
    assert "".join(tc.function.arguments or "" for tc in calls) == c.message.tool_calls[0].function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_second_turn_with_the_tool_result(client):
    r = client.chat.completions.create(
        model="base", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 20})},
    ]
    r2 = client.chat.completions.create(
        model="base", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.tool_calls is None
    # auto: whatever the random model writes comes back as content or as parsed calls, never an error
    r3 = client.chat.completions.create(model="base", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r3.choices[0].message.content or r3.choices[0].message.tool_calls


def test_json_schema_output_always_validates(client):
    import jsonschema

    rng = np.random.default_rng(0)
    words = ["dress", "blue", "city", "weather", "red", "skirt", "long", "cotton"]
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
    for i in range(20):
        prompt = " ".join(rng.choice(words, size=int(rng.integers(1, 8))))
        r = client.chat.completions.create(
            model="base",
            messages=[{"role": "user", "content": prompt}],
            response_format=fmt,
            max_tokens=100,
            temperature=1.0,
            seed=i,
        )
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(
        model="base", messages=ASK, response_format={"type": "json_object"}, max_tokens=200, temperature=0
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_bad_schema_and_tool_requests_are_400(server):
    from paddlenlp_ext.serve.process import post

    for body, param in (
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ):
        status, err = post(server.url + "/v1/chat/completions", dict(model="base", messages=ASK, **body))
        assert status == 400 and err["error"]["param"] == param, err
