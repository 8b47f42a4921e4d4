"""ShareGPT records (``conversations`` of ``{"from", "value"}``, optional ``system`` and ``tools``) -> a conversation.

Read exactly as LLaMA-Factory reads them (``SharegptDatasetConverter``):

* role tags (its defaults; renamed with ``dataset_columns`` / a ``dataset_info.json`` entry's ``tags``:
  ``role_tag``, ``content_tag``, ``user_tag``, ``assistant_tag``, ``observation_tag``, ``function_tag``,
  ``system_tag``): ``human`` -> user, ``gpt`` -> assistant, ``function_call`` -> an assistant tool call (its
  value is the JSON ``{"name": ..., "arguments": ...}`` or a list of them), ``observation`` -> a tool result;
* a leading ``system`` turn is the system prompt (it wins over the record's ``system`` column, as there);
* the alternation rule: after that, turns 1, 3, 5, ... are ``human`` or ``observation`` and turns 2, 4, 6, ...
  are ``gpt`` or ``function_call``; a training conversation has an even number of turns (it ends with the
  answer), a preference prompt (``ranking``) an odd number.  So an ``observation`` may follow any assistant
  turn, also a plain ``gpt`` turn that wrote its call in its text; it is rendered as the template's tool
  message and never learned.  A record that breaks the rule is a ``file:line`` problem (docs/data.md).

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

from typing import Optional

from .convo import DEFAULT_COLUMNS, DEFAULT_TAGS, Conversation, Message, json_text, loss_flag, parse_tools, tool_call


def matches(record, columns=None) -> bool:
    c = {**DEFAULT_COLUMNS, **(columns or {})}
    return isinstance(record, dict) and isinstance(record.get(c["messages"]), list)


def tag_names(columns=None, tags=None):
    """The role tags in force: LLaMA-Factory's defaults overridden by ``columns`` / ``tags``."""
    return {**DEFAULT_TAGS, **{k: v for k, v in (columns or {}).items() if k in DEFAULT_TAGS}, **(tags or {})}


def function_calls(value, where):
    """A ``function_call`` turn's value -> tool calls: ``'{"name": "f", "arguments": {}}'`` ->
    ``[{"type": "function", "function": {"name": "f", "arguments": {}}}]`` (a JSON list gives several)."""
    if isinstance(value, str):
        value = json_text(value, where, "the function call", 'write {"name": ..., "arguments": {...}}')
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(c, dict) for c in calls):
        raise ValueError(f'{where}: a function call must be {{"name": ..., "arguments": {{...}}}} or a list of them')
    return [tool_call(c.get("name"), c.get("arguments", {}), where) for c in calls]


def turn_message(turn, t, where, allowed=None) -> Message:
    """One ShareGPT turn -> :class:`Message` (``t``: the tag names; ``allowed``: the tags this position may
    hold, else any).  ``{"from": "gpt", "value": "yo"}`` -> ``Message("assistant", "yo")``."""
    if not isinstance(turn, dict) or t["role_tag"] not in turn or t["content_tag"] not in turn:
        raise ValueError(f"{where}: each turn must be an object with {t['role_tag']!r} and {t['content_tag']!r}")
    tag, value = turn[t["role_tag"]], turn[t["content_tag"]]
    roles = {
        t["user_tag"]: "user",
        t["assistant_tag"]: "assistant",
        t["system_tag"]: "system",
        t["function_tag"]: "function_call",
        t["observation_tag"]: "tool",
    }
    if tag not in roles:
        raise ValueError(
            f"{where}: unknown {t['role_tag']!r} {tag!r}; expected one of {', '.join(roles)} "
            "(map other names with dataset_columns' *_tag keys or dataset_info.json's tags)"
        )
    if allowed is not None and tag not in allowed:
        raise ValueError(
            f"{where}: {t['role_tag']!r} {tag!r} breaks ShareGPT's alternation (LLaMA-Factory's rule): "
            f"turns 1, 3, 5, ... are {t['user_tag']!r} or {t['observation_tag']!r}, turns 2, 4, ... "
            f"{t['assistant_tag']!r} or {t['function_tag']!r} (after an optional leading "
            f"{t['system_tag']!r} turn); fix the order of the turns or drop the record"
        )
    loss = loss_flag(turn.get("loss_weight"), where)
    if roles[tag] == "function_call":
        return Message("assistant", "", tool_calls=function_calls(value, where), loss=loss)
    if not isinstance(value, str):
        raise ValueError(f"{where}: {t['content_tag']!r} must be a string")
    return Message(roles[tag], value, loss=loss)


def convert(record, origin: str, columns=None, tags=None, ranking: Optional[bool] = False) -> Conversation:
    """The record -> :class:`Conversation` by the rules of the module doc (``ranking``: the turns are a
    preference prompt, odd in number, answered by the record's chosen / rejected turns; None: a prompt
    of either count, e.g. GRPO's, which may or may not carry its answer)."""
    c = {**DEFAULT_COLUMNS, **(columns or {})}
    t = tag_names(columns, tags)
    turns = record[c["messages"]]
    system = record.get(c["system"])
    first = 0
    if turns and isinstance(turns[0], dict) and turns[0].get(t["role_tag"]) == t["system_tag"]:
        system, first = turns[0].get(t["content_tag"]), 1  # the leading system turn wins, as in LLaMA-Factory
    if system is not None and not isinstance(system, str):
        raise ValueError(f"{origin}: the system prompt must be a string")
    msgs = [Message("system", system)] if system else []
    accept = ((t["user_tag"], t["observation_tag"]), (t["assistant_tag"], t["function_tag"]))
    for k, turn in enumerate(turns[first:]):
        msgs.append(turn_message(turn, t, f"{origin}: {c['messages']}[{first + k + 1}]", accept[k % 2]))
    n = len(turns) - first
    if n == 0 or (ranking is not None and n % 2 != int(ranking)):
        want = (
            "an odd number (the prompt ends with a human or observation turn)"
            if ranking
            else "an even number (the conversation ends with the answer)"
        )
        raise ValueError(f"{origin}: {c['messages']!r} has {n} turn(s) after the system turn; ShareGPT needs {want}")
    return Conversation(msgs, tools=parse_tools(record.get(c["tools"]), origin), origin=origin, format="sharegpt")
