"""Agents end to end (issue 37's "done when"): fine-tune the tiny model on a made-up tool-call set, serve it,
and drive it with the official ``openai`` client.

1. ``llm/run_finetune.py`` (LoRA, high learning rate) on 8 conversations in OpenAI messages form with
   ``tools``, rendered by a Qwen2.5-style jinja template that writes ``<tool_call>`` blocks
   (tests/test_chat_template.py's); each conversation is: user asks -> assistant calls a tool -> the
   tool answers -> assistant answers in words.  A random tiny model memorises 8 of these in a few
   dozen steps.
2. ``llm/predict/server.py`` serves base + the adapter, with the same template.
3. ``tools=[...]``, ``tool_choice="auto"``: the model chooses to call, and the answer comes back as
   ``tool_calls`` with JSON arguments (``finish_reason: "tool_calls"``), streamed and not.
4. The second turn with the ``tool`` result is accepted and answered in words (the trained answer).
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from test_chat_template import TEMPLATE

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
]
CITIES = ["Paris", "Tokyo", "Rome", "Oslo"]
ASKS = {"get_weather": "Weather in {}?", "get_time": "Time in {}?"}
RESULTS = {"get_weather": ({"temp_c": 20}, "It is 20 C in {}."), "get_time": ({"time": "10:00"}, "It is 10:00 in {}.")}


def conversation(fn, city):
    """One training record: ask -> call -> tool result -> answer (OpenAI messages, arguments as a JSON string)."""
    result, answer = RESULTS[fn]
    return {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": ASKS[fn].format(city)},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": fn, "arguments": json.dumps({"city": city})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result)},
            {"role": "assistant", "content": answer.format(city)},
        ],
    }


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("agent")
    data = d / "tools.jsonl"
    data.write_text("\n".join(json.dumps(conversation(fn, c)) for fn in ASKS for c in CITIES) + "\n")
    (d / "tools.jinja").write_text(TEMPLATE)
    out = str(d / "lora")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "llm/run_finetune.py"),
        os.path.join(ROOT, "llm/config/tiny/lora_argument.json"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name_or_path",
        str(data),
        "--chat_template",
        str(d / "tools.jinja"),
        "--output_dir",
        out,
        "--do_eval",
        "false",
        "--eval_before_train",
        "false",
        "--max_steps",
        "60",
        "--warmup_steps",
        "5",
        "--learning_rate",
        "0.01",
        "--lora_rank",
        "16",
        "--per_device_train_batch_size",
        "8",
        "--logging_steps",
        "10",
        "--src_length",
        "768",
        "--max_length",
        "1024",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out, str(d / "tools.jinja")


@pytest.fixture(scope="module")
def client(tiny_model_dir, adapter):
    import openai

    from paddlenlp_ext.serve.process import ServerProcess

    out, template = adapter
    with ServerProcess(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--served_model_name",
            "base",
            "--lora_path",
            f"agent={out}",
            "--max_length",
            "1024",
            "--chat_template",
            template,
        ]
    ) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("fn,city", [("get_weather", "Paris"), ("get_time", "Oslo")])
def test_auto_tool_choice_calls_the_trained_tool_then_answers_the_result(client, fn, city):
    ask = [{"role": "user", "content": ASKS[fn].format(city)}]
    r = client.chat.completions.create(
        model="agent", messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=150, temperature=0
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == fn
    assert json.loads(call.function.arguments) == {"city": city}

    # streamed: the same call, as delta.tool_calls (index, id, name, arguments), then finish_reason tool_calls
    chunks = list(
        client.chat.completions.create(
            model="agent", messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=150, temperature=0, stream=True
        )
    )
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == fn
    assert json.loads("".join(tc.function.arguments or "" for tc in deltas)) == {"city": city}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"

    # second turn: the assistant message as the client got it + the tool's result; answered in words
    result, answer = RESULTS[fn]
    history = ask + [
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    r2 = client.chat.completions.create(
        model="agent", messages=history, tools=TOOLS, tool_choice="auto", max_tokens=80, temperature=0
    )
    c2 = r2.choices[0]
    assert c2.finish_reason == "stop" and not c2.message.tool_calls, c2
    assert c2.message.content.strip() == answer.format(city)


def test_the_base_model_does_not_call(client):
    """The call comes from the fine-tuning: the untrained base, same request, writes no call."""
    ask = [{"role": "user", "content": ASKS["get_weather"].format("Paris")}]
    r = client.chat.completions.create(
        model="base", messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=30, temperature=0
    )
    assert r.choices[0].finish_reason != "tool_calls" and not r.choices[0].message.tool_calls
