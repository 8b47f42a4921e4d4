"""The one internal representation every format converts to (pure data, no tokenizer).

A :class:`Conversation` is what a chat template renders: ``messages`` in the OpenAI / transformers
shape (roles ``system``, ``user``, ``assistant``, ``tool``), the ``tools`` (JSON schemas) offered,
and where it came from (``origin`` = ``file:line``, ``format``).  ``Message.loss`` is ``None`` (the
default rule: assistant turns are supervised, nothing else), ``True`` or ``False`` (a record's
``loss_weight`` 1 or 0).  A tool call is ``{"type": "function", "function": {"name": str,
"arguments": dict}}`` with its arguments already parsed from JSON (templates ``tojson`` them).

Column and role-tag names follow LLaMA-Factory's ``dataset_info.json`` (``columns`` / ``tags``):
:data:`DEFAULT_COLUMNS` and :data:`DEFAULT_TAGS`, overridden by the ``dataset_columns`` key.
"""

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

ROLES = ("system", "user", "assistant", "tool")

# LLaMA-Factory's column names -> the default field name in a record.
DEFAULT_COLUMNS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "history": "history",  # alpaca
    "messages": "conversations",
    "system": "system",
    "tools": "tools",  # sharegpt (messages: its own default)
    "text": "text",
}
DEFAULT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}


@dataclass
class Message:
    role: str
    content: str
    tool_calls: Optional[List[Dict[str, Any]]] = None
    reasoning: Optional[str] = None
    loss: Optional[bool] = None  # None: the default rule (assistant turns only)

    def as_template_dict(self) -> Dict[str, Any]:
        """What a jinja chat template sees: ``Message("assistant", "hi")`` ->
        ``{"role": "assistant", "content": "hi"}``; tool calls and ``reasoning_content`` only when set."""
        d: Dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        if self.reasoning is not None:
            d["reasoning_content"] = self.reasoning
        return d


@dataclass
class Conversation:
    messages: List[Message]
    tools: Optional[List[Dict[str, Any]]] = None
    origin: str = ""
    format: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)  # e.g. DPO's chosen / rejected messages


@dataclass
class TextDoc:
    """One document of raw text for ``autoregressive: true``: every token supervised."""

    text: str
    origin: str = ""
    format: str = "text"


def parse_arguments(args: Any, where: str) -> Dict[str, Any]:
    """A tool call's arguments -> a dict.  ``'{"x": 1}'`` -> ``{"x": 1}``; a dict stays;
    ``'{x: 1}'`` -> ValueError naming ``where`` and that the arguments must be a JSON object."""
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            val = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where}: tool call arguments are not valid JSON ({e.msg} at column {e.colno}): "
                f'{args[:80]!r}; write them as a JSON object such as {{"city": "Paris"}}'
            ) from None
        if isinstance(val, dict):
            return val
    raise ValueError(f"{where}: tool call arguments must be a JSON object (or its JSON text), got {args!r:.80}")


def json_text(text: str, where: str, what: str, hint: str) -> Any:
    """``json.loads(text)``; invalid JSON -> ValueError ``"{where}: {what} is not valid JSON (...); {hint}"``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: {what} is not valid JSON ({e.msg} at column {e.colno}); {hint}") from None


def parse_tools(tools: Any, where: str) -> Optional[List[Dict[str, Any]]]:
    """``tools`` given as a list of JSON schemas or as its JSON text -> the list (None if absent/empty).

    ``'[{"name": "f", "parameters": {}}]'`` -> ``[{"type": "function", "function": {"name": "f",
    "parameters": {}}}]`` (bare function schemas are wrapped in OpenAI's ``{"type": "function"}`` form,
    which is what tool-calling templates read)."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        tools = json_text(tools, where, "'tools'", "give a JSON list of function schemas")
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"{where}: 'tools' must be a list of function schemas (objects)")
    return [
        t if "function" in t and t.get("type", "function") == "function" else {"type": "function", "function": t}
        for t in tools
    ] or None


def tool_call(name: Any, arguments: Any, where: str) -> Dict[str, Any]:
    """``tool_call("f", '{"a": 1}', "x:1")`` -> ``{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tool call needs a 'name' (string)")
    return {"type": "function", "function": {"name": name, "arguments": parse_arguments(arguments, where)}}


def loss_flag(value: Any, where: str) -> Optional[bool]:
    """A record's per-message ``loss_weight``: absent -> None (default rule), 1 -> True, 0 -> False.
    Other values -> ValueError (only 0 and 1 are meaningful: a token is learned or not)."""
    if value is None:
        return None
    if value in (0, 1) and not isinstance(value, str):
        return bool(value)
    raise ValueError(f"{where}: loss_weight must be 0 (not learned) or 1 (learned), got {value!r}")


def check_turns(messages: List[Message], where: str) -> None:
    """The shape every chat template can render: optional system first, then turns that end with a
    non-empty assistant answer; tool results only after an assistant turn (its tool call, or a call written in its text).  Raises ValueError
    naming the message and what to change (``where`` is ``file:line``)."""
    if not any(m.role == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message: there is nothing to learn; add the answer")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ValueError(f"{where}: message {i + 1} has role {m.role!r}; use one of {', '.join(ROLES)}")
        if m.role == "system" and i != 0:
            raise ValueError(
                f"{where}: message {i + 1} is a system message after the first; a system prompt must come first"
            )
        if m.role == "assistant" and not m.content.strip() and not m.tool_calls:
            raise ValueError(
                f"{where}: message {i + 1} is an empty assistant turn; write the answer or remove the turn"
            )
        if m.role == "tool":  # after any assistant turn (LLaMA-Factory: the call may be in the answer's text)
            prev = next((p for p in reversed(messages[:i]) if p.role != "tool"), None)
            if prev is None or prev.role != "assistant":
                raise ValueError(
                    f"{where}: message {i + 1} is a tool result that follows no assistant turn; put "
                    "the assistant's call (gpt/function_call) before it"
                )
        if m.role == "user":
            prev = messages[i - 1].role if i else "system"
            if prev == "user":
                raise ValueError(
                    f"{where}: messages {i} and {i + 1} are both user turns; merge them or add the "
                    "assistant answer between them"
                )
    first = next(i for i, m in enumerate(messages) if m.role != "system")
    if messages[first].role != "user":
        raise ValueError(
            f"{where}: the conversation starts with {messages[first].role!r}; it must start with a "
            "user turn (after an optional system prompt)"
        )
    if messages[-1].role != "assistant":
        raise ValueError(
            f"{where}: the last message is {messages[-1].role!r}; a training conversation ends with "
            "the assistant's answer (drop the trailing turn or add the answer)"
        )
