"""ShareGPT records (``conversations`` of ``{"from", "value"}``, optional ``system`` and ``tools``) -> a conversation.

Role tags (LLaMA-Factory's defaults; renamed with ``dataset_columns``: ``role_tag``, ``content_tag``,
``user_tag``, ``assistant_tag``, ``observation_tag``, ``function_tag``, ``system_tag``):
``human`` -> user, ``gpt`` -> assistant, ``system`` -> system, ``function_call`` -> an assistant
tool call (its value is the JSON ``{"name": ..., "arguments": ...}`` or a list of them),
``observation`` -> a tool result.  ``tools`` is the JSON text (or list) of the function schemas.
Worked example (glaive_toolcall_en_demo.json's shape)::

    {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                       {"from": "function_call", "value": "{\\"name\\": \\"w\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}"},
                       {"from": "observation", "value": "{\\"t\\": 20}"},
                       {"from": "gpt", "value": "It is 20 C."}],
     "tools": "[{\\"name\\": \\"w\\", \\"parameters\\": {}}]"}
    -> [user "Weather in Paris?",
        assistant "" + tool_calls [{"type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}],
        tool "{\\"t\\": 20}", assistant "It is 20 C."],
       tools [{"type": "function", "function": {"name": "w", "parameters": {}}}]
"""

from .convo import DEFAULT_COLUMNS, DEFAULT_TAGS, Conversation, Message, json_text, loss_flag, parse_tools, tool_call


def matches(record, columns=None) -> bool:
    c = {**DEFAULT_COLUMNS, **(columns or {})}
    return isinstance(record, dict) and isinstance(record.get(c["messages"]), list)


def function_calls(value, where):
    """A ``function_call`` turn's value -> tool calls: ``'{"name": "f", "arguments": {}}'`` ->
    ``[{"type": "function", "function": {"name": "f", "arguments": {}}}]`` (a JSON list gives several)."""
    if isinstance(value, str):
        value = json_text(value, where, "the function call", "write {\"name\": ..., \"arguments\": {...}}")
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(c, dict) for c in calls):
        raise ValueError(f"{where}: a function call must be {{\"name\": ..., \"arguments\": {{...}}}} or a list of them")
    return [tool_call(c.get("name"), c.get("arguments", {}), where) for c in calls]


def convert(record, origin: str, columns=None, tags=None) -> Conversation:
    c = {**DEFAULT_COLUMNS, **(columns or {})}
    t = {**DEFAULT_TAGS, **(columns or {}), **(tags or {})}
    roles = {t["user_tag"]: "user", t["assistant_tag"]: "assistant", t["system_tag"]: "system",
             t["function_tag"]: "function_call", t["observation_tag"]: "tool"}
    msgs = []
    system = record.get(c["system"])
    if system is not None and not isinstance(system, str):
        raise ValueError(f"{origin}: {c['system']!r} must be a string")
    if system:
        msgs.append(Message("system", system))
    for i, turn in enumerate(record[c["messages"]], 1):
        where = f"{origin}: {c['messages']}[{i}]"
        if not isinstance(turn, dict) or t["role_tag"] not in turn or t["content_tag"] not in turn:
            raise ValueError(f"{where}: each turn must be an object with {t['role_tag']!r} and {t['content_tag']!r}")
        tag, value = turn[t["role_tag"]], turn[t["content_tag"]]
        role = roles.get(tag)
        if role is None:
            raise ValueError(f"{where}: unknown {t['role_tag']!r} {tag!r}; expected one of {', '.join(roles)} "
                             "(map other names with dataset_columns' *_tag keys)")
        loss = loss_flag(turn.get("loss_weight"), where)
        if role == "function_call":
            prev = msgs[-1] if msgs else None
            calls = function_calls(value, where)
            if prev is not None and prev.role == "assistant" and not prev.tool_calls:  # gpt text, then its call
                prev.tool_calls = calls
            else:
                msgs.append(Message("assistant", "", tool_calls=calls, loss=loss))
            continue
        if not isinstance(value, str):
            raise ValueError(f"{where}: {t['content_tag']!r} must be a string")
        msgs.append(Message(role, value, loss=loss))
    return Conversation(msgs, tools=parse_tools(record.get(c["tools"]), origin), origin=origin, format="sharegpt")
