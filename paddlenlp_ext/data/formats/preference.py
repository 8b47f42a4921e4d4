"""Preference pairs in the conversation formats -> (prompt conversation, chosen message, rejected message).

LLaMA-Factory's form (``dpo_en_demo.json``, a ``ranking`` entry of ``dataset_info.json``): ``conversations``
(ShareGPT turns by its alternation rule, an odd number: the prompt ends with a ``human`` or ``observation``
turn) plus ``chosen`` / ``rejected`` turns (``gpt`` or ``function_call``); the OpenAI form: ``messages`` (or
``prompt``) plus ``chosen`` / ``rejected`` as a message, a list holding one assistant message, or a string.
Both may carry tool calls, tool results and ``tools``: such pairs are rendered with a jinja chat template
(tool turns are never scored).  Worked example::

    {"conversations": [{"from": "human", "value": "Name a color."}],
     "chosen": {"from": "gpt", "value": "Blue."}, "rejected": {"from": "gpt", "value": "No."}}
    -> (Conversation([user "Name a color."]), assistant "Blue.", assistant "No.")

:func:`plain_turns` gives the src/tgt form of a pair without tools (PaddleNLP's rendering):
``(None, ["Name a color."], [], "Blue.", "No.")`` for the record above.
"""

from typing import Dict, List, Optional, Tuple

from . import messages as openai
from . import sharegpt
from .convo import DEFAULT_COLUMNS, Conversation, Message, check_turns, parse_tools

#: the preference columns of LLaMA-Factory's dataset_info.json (``kto_tag``: KTO's boolean label)
PREFERENCE_COLUMNS = {"chosen": "chosen", "rejected": "rejected", "kto_tag": "label"}


def _cols(columns: Optional[Dict[str, str]]) -> Dict[str, str]:
    return {**DEFAULT_COLUMNS, **PREFERENCE_COLUMNS, **(columns or {})}


def matches(record, columns=None) -> bool:
    c = _cols(columns)
    return isinstance(record, dict) and c["chosen"] in record and c["rejected"] in record


def _answer(value, key: str, origin: str, columns) -> Message:
    where = f"{origin}: {key!r}"
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    t = sharegpt.tag_names(columns)
    if isinstance(value, str):
        msg = Message("assistant", value)
    elif isinstance(value, dict) and t["role_tag"] in value:  # a ShareGPT turn: gpt or function_call
        msg = sharegpt.turn_message(value, t, where, (t["assistant_tag"], t["function_tag"]))
    elif isinstance(value, dict) and ("content" in value or "tool_calls" in value):
        msg = openai.to_message({"role": "assistant", **value}, where)
        if msg.role != "assistant":
            raise ValueError(f"{where}: the answer's role is {msg.role!r}; it must be the assistant's")
    else:
        raise ValueError(
            f'{where} must be an assistant turn ({{"from": "gpt", "value": ...}} or '
            '{"role": "assistant", "content": ...}) or a string'
        )
    if not msg.content.strip() and not msg.tool_calls:
        raise ValueError(f"{where} is empty: both answers need text (or a tool call)")
    return msg


def convert_pair(record, origin: str, columns=None) -> Tuple[Conversation, Message, Message]:
    """The record -> (prompt conversation, chosen, rejected); ValueError naming ``origin`` and the fix."""
    c = _cols(columns)
    tools = parse_tools(record.get(c["tools"]), origin)
    turns = record.get(c["messages"])
    role_tag = sharegpt.tag_names(columns)["role_tag"]
    if isinstance(turns, list) and not (
        turns and isinstance(turns[0], dict) and role_tag not in turns[0] and "role" in turns[0]
    ):  # ShareGPT turns (OpenAI ones have "role")
        conv = sharegpt.convert(record, origin, columns, ranking=True)
    elif isinstance(turns, list) or isinstance(record.get("messages"), list) or isinstance(record.get("prompt"), list):
        msgs = turns if isinstance(turns, list) else record.get("messages") or record["prompt"]
        conv = openai.convert({"messages": msgs, "tools": tools}, origin)
    elif isinstance(record.get("prompt"), str):
        conv = openai.convert({"messages": [{"role": "user", "content": record["prompt"]}]}, origin)
    else:
        raise ValueError(
            f"{origin}: a preference record needs the prompt turns under {c['messages']!r} (ShareGPT), "
            "'messages' or 'prompt'"
        )
    chosen, rejected = (
        _answer(record[c["chosen"]], "chosen", origin, columns),
        _answer(record[c["rejected"]], "rejected", origin, columns),
    )
    if conv.messages and conv.messages[-1].role == "assistant":
        raise ValueError(
            f"{origin}: the prompt turns end with the assistant; they must end with the user's turn "
            "(or a tool result) that both answers reply to"
        )
    check_turns(conv.messages + [chosen], origin)  # the shape a template renders: user first, tools after calls
    return conv, chosen, rejected


def plain_turns(
    conv: Conversation, chosen: Message, rejected: Message
) -> Optional[Tuple[Optional[str], List[str], List[str], str, str]]:
    """``(system, src, tgt, chosen, rejected)`` when the pair is plain alternating user / assistant text
    (PaddleNLP's src/tgt rendering applies), else None (tool calls, tool results, tools or reasoning: a
    jinja chat template renders it)."""
    msgs = conv.messages
    system = msgs[0].content if msgs and msgs[0].role == "system" else None
    rest = msgs[1:] if system is not None else msgs
    roles = [m.role for m in rest]
    fancy = conv.tools or any(
        m.tool_calls or m.reasoning is not None or m.loss is not None for m in rest + [chosen, rejected]
    )
    if fancy or roles != ["user", "assistant"] * (len(rest) // 2) + ["user"]:
        return None
    return system, [m.content for m in rest[0::2]], [m.content for m in rest[1::2]], chosen.content, rejected.content


def convert(record, origin: str, columns=None) -> Tuple[Optional[str], List[str], List[str], str, str]:
    """A plain pair as ``(system, src, tgt, chosen, rejected)`` (see :func:`plain_turns`); a pair with tool
    calls -> ValueError (KTO and the src/tgt readers take plain turns only)."""
    out = plain_turns(*convert_pair(record, origin, columns))
    if out is None:
        raise ValueError(
            f"{origin}: the turns must alternate user / assistant as plain text here (tool calls, tool "
            "results and reasoning are supported in DPO and reward-model pairs, with a jinja template)"
        )
    return out
