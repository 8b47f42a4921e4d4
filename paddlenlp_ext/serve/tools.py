"""Tool calling: the template's tool-call format, and the model's output parsed back into OpenAI's ``tool_calls``.

The prompt side is the model's own chat template rendered with ``tools`` (``data.chat_template.render``,
what training and transformers' ``apply_chat_template(tools=...)`` do).  The output side knows the two
formats templates write (pure functions):

* ``hermes`` (Qwen2.5/Qwen3, Hermes, and any template that writes ``<tool_call>``):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, text around
  them is the message content;
* ``llama3`` (templates with ``<|python_tag|>`` / ``ipython``): the whole answer is
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), optionally after ``<|python_tag|>``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Dict, List, Optional, Tuple

HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def tool_style(template: Optional[str]) -> Optional[str]:
    """The tool-call format a jinja chat template writes, or None when it writes none we parse.

    >>> tool_style("{{ '<tool_call>' }}"), tool_style("<|python_tag|>"), tool_style("{{ m.content }}")
    ('hermes', 'llama3', None)
    """
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return None


def _call(obj: Any) -> Optional[Dict[str, Any]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def parse_tool_calls(text: str, style: str) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """(content, tool_calls) of an answer; an answer with no well-formed call is all content.

    >>> content, calls = parse_tool_calls('Sure.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>', "hermes")
    >>> content, calls[0]["function"]
    ('Sure.', {'name': 'f', 'arguments': '{"x": 1}'})
    >>> parse_tool_calls('{"name": "g", "parameters": {}}', "llama3")[1][0]["function"]["name"]
    'g'
    """
    calls: List[Dict[str, Any]] = []
    if style == "hermes":
        for block in HERMES_BLOCK.findall(text):
            try:
                c = _call(json.loads(block))
            except json.JSONDecodeError:
                c = None
            if c is None:
                return (text or None), []
            calls.append(c)
        content = HERMES_BLOCK.sub("", text).strip() if calls else text
        return (content or None), calls
    if style == "llama3":
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :]
        for part in [p for p in body.split(";") if p.strip()] if body.startswith("{") else []:
            try:
                c = _call(json.loads(part))
            except json.JSONDecodeError:
                c = None
            if c is None:
                return (text or None), []
            calls.append(c)
        return (None if calls else (text or None)), calls
    return (text or None), []
