"""The multi-turn GRPO toy (docs/alignment.md "Multi-turn tool rollouts"): a calculator tool and its reward.

``add`` is the tool (``tools: ["paddlenlp_ext.examples.calculator:add"]``); ``uses_tool_result`` is the
reward (``reward_funcs: ["paddlenlp_ext.examples.calculator:uses_tool_result"]``): 1 when the completion
called a tool that answered and its final answer contains that answer.  :func:`write_toy_data` writes the
toy's files: a Qwen2.5-style chat template with ``<tool_call>`` blocks, SFT conversations (the question once
answered through the tool, three times answered without it) and GRPO prompts.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

#: Qwen2.5-style: tools in the system turn, <tool_call> JSON blocks, tool results as <tool_response>
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>"
    "{{ eos_token }}\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}{{ eos_token }}\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    '{%- for tc in m.tool_calls or [] %}<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}{{ eos_token }}\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>{{ eos_token }}\n"
    "{%- elif m.role == 'system' %}<|im_start|>system\n{{ m.content }}{{ eos_token }}\n"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return int(a) + int(b)


def uses_tool_result(prompts: List[str], completions: List[str], messages: List[List[Dict]], **_columns) -> List[float]:
    """1.0 when a tool answered (a ``tool`` message that is not an error) and the final answer (``completions``,
    the last assistant turn) contains the last tool result, else 0.0.

    >>> conv = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "", "tool_calls": []},
    ...         {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "It is 5."}]
    >>> uses_tool_result(["q", "q"], ["It is 5.", "It is 6."], [conv, conv[:1] + [conv[-1]]])
    [1.0, 0.0]
    """
    out = []
    for answer, conv in zip(completions, messages):
        results = [m["content"] for m in conv if m["role"] == "tool"]
        ok = bool(results) and not results[-1].startswith('{"error"') and conv[-1]["role"] == "assistant"
        out.append(1.0 if ok and results[-1].strip() in answer else 0.0)
    return out


def sft_conversation(a: int, b: int, call: bool) -> Dict:
    """One SFT record: the question, then either the call -> result -> answer, or an answer without the tool."""
    ask = {"role": "user", "content": f"What is {a} + {b}?"}
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "description": "The first number."},
                        "b": {"type": "integer", "description": "The second number."},
                    },
                    "required": ["a", "b"],
                },
                "return": {"type": "integer"},
            },
        }
    ]
    if not call:
        return {"tools": tools, "messages": [ask, {"role": "assistant", "content": "I cannot say."}]}
    return {
        "tools": tools,
        "messages": [
            ask,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
                ],
            },
            {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": f"The answer is {a + b}."},
        ],
    }


#: the toy's question(s) "What is a + b?".  One: the tiny model (2 layers, hidden 64) memorises what it sees
#: rather than learning to copy numbers, and with several questions it mixes their arguments and answers up
PAIRS = ((2, 3),)


def write_toy_data(directory: str) -> Dict[str, str]:
    """Write ``template.jinja``, ``sft.json`` (each question of :data:`PAIRS` once answered through the tool,
    three times without it: the SFT model calls the tool in a minority of its answers) and ``prompts.json`` (each question 4 times) into ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    pairs = PAIRS
    paths = {name: os.path.join(directory, name) for name in ("template.jinja", "sft.json", "prompts.json")}
    with open(paths["template.jinja"], "w", encoding="utf-8") as f:
        f.write(TEMPLATE)
    with open(paths["sft.json"], "w", encoding="utf-8") as f:
        for a, b in pairs:
            for call in (True, False, False, False):
                f.write(json.dumps(sft_conversation(a, b, call)) + "\n")
    with open(paths["prompts.json"], "w", encoding="utf-8") as f:
        for a, b in pairs:
            for _ in range(4):
                f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"}]}) + "\n")
    return paths


if __name__ == "__main__":
    import sys

    print(json.dumps(write_toy_data(sys.argv[1] if len(sys.argv) > 1 else "output/calculator_data"), indent=1))
