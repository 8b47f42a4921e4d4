"""OpenAI ``messages`` records -> a conversation.

``{"messages": [...], "tools": [...]}``; each message has ``role`` (system / user / assistant / tool)
and ``content`` (a string, or a list of typed parts of which ``{"type": "text", "text": ...}`` are
joined; other part types are refused), optionally ``tool_calls`` (OpenAI's ``{"type": "function",
"function": {"name", "arguments"}}`` with arguments as JSON text or an object), ``reasoning_content``
and ``loss_weight`` (0 or 1).  Worked example::

    {"messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
                  {"role": "assistant", "content": "4", "reasoning_content": "add", "loss_weight": 1}]}
    -> [user "2+2?", assistant "4" (reasoning "add", loss True)]
"""

from .convo import Conversation, Message, loss_flag, parse_tools, tool_call


def matches(record, columns=None) -> bool:
    key = (columns or {}).get("messages", "messages")
    return isinstance(record, dict) and isinstance(record.get(key), list)


def content_text(content, where) -> str:
    """``"hi"`` -> ``"hi"``; ``[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]`` -> ``"ab"``;
    None (an assistant turn with only tool calls) -> ``""``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"{where}: content part of type {kind!r} is not supported (text parts only: "
                    '{"type": "text", "text": ...})'
                )
            out.append(part["text"])
        return "".join(out)
    raise ValueError(f"{where}: 'content' must be a string or a list of text parts")


def _tool_calls(calls, where):
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise ValueError(f"{where}: 'tool_calls' must be a list")
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise ValueError(f"{where}: each tool call must be an object")
        fn = call.get("function", call)  # OpenAI nests name/arguments under "function"
        if not isinstance(fn, dict):
            raise ValueError(f"{where}: 'function' of a tool call must be an object with 'name' and 'arguments'")
        out.append(tool_call(fn.get("name"), fn.get("arguments", {}), where))
    return out or None


def to_message(m, where) -> Message:
    """One OpenAI message object -> :class:`Message` (see the module docstring)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"{where}: each message must be an object with 'role' and 'content'")
    reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}: 'reasoning_content' must be a string")
    return Message(
        m["role"],
        content_text(m.get("content"), where),
        tool_calls=_tool_calls(m.get("tool_calls"), where),
        reasoning=reasoning,
        loss=loss_flag(m.get("loss_weight"), where),
    )


def convert(record, origin: str, columns=None, tags=None) -> Conversation:
    key = (columns or {}).get("messages", "messages")
    msgs = [to_message(m, f"{origin}: {key}[{i}]") for i, m in enumerate(record[key], 1)]
    return Conversation(msgs, tools=parse_tools(record.get("tools"), origin), origin=origin, format="messages")
