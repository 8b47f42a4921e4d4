"""Preference pairs in the conversation formats -> (system, prompts, history answers, chosen, rejected).

LLaMA-Factory's form (``dpo_en_demo.json``): ``conversations`` (ShareGPT turns, the last one the user's)
plus ``chosen`` / ``rejected`` turns; the OpenAI form: ``messages`` (or ``prompt``) plus ``chosen`` /
``rejected`` as a message, a list holding one assistant message, or a string.  Worked example::

    {"conversations": [{"from": "human", "value": "Name a color."}],
     "chosen": {"from": "gpt", "value": "Blue."}, "rejected": {"from": "gpt", "value": "No."}}
    -> (None, ["Name a color."], [], "Blue.", "No.")

The prompt must be plain turns (optional system, then user / assistant alternating, ending with the
user): preference pairs are rendered as PaddleNLP's src/tgt pairs (docs/dpo.md).
"""

from typing import List, Optional, Tuple

from . import messages as openai
from . import sharegpt
from .convo import DEFAULT_TAGS


def matches(record) -> bool:
    return isinstance(record, dict) and "chosen" in record and "rejected" in record


def _answer(value, key: str, origin: str) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str):
        text = value
    elif isinstance(value, dict) and "value" in value:
        text = value["value"]
    elif isinstance(value, dict) and "content" in value:
        text = openai.content_text(value["content"], f"{origin}: {key}")
    else:
        raise ValueError(f"{origin}: {key!r} must be an assistant turn ({{\"from\": \"gpt\", \"value\": ...}} or "
                         "{\"role\": \"assistant\", \"content\": ...}) or a string")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{origin}: {key!r} is empty: both answers need text")
    return text


def convert(record, origin: str) -> Tuple[Optional[str], List[str], List[str], str, str]:
    if isinstance(record.get("conversations"), list):
        conv = sharegpt.convert({**record, "tools": None}, origin)
    elif isinstance(record.get("messages"), list) or isinstance(record.get("prompt"), list):
        conv = openai.convert({"messages": record.get("messages") or record["prompt"]}, origin)
    elif isinstance(record.get("prompt"), str):
        conv = openai.convert({"messages": [{"role": "user", "content": record["prompt"]}]}, origin)
    else:
        raise ValueError(f"{origin}: a preference record needs the prompt turns under 'conversations' "
                         f"({DEFAULT_TAGS['role_tag']}/{DEFAULT_TAGS['content_tag']}), 'messages' or 'prompt'")
    msgs = conv.messages
    system = msgs[0].content if msgs and msgs[0].role == "system" else None
    rest = msgs[1:] if system is not None else msgs
    roles = [m.role for m in rest]
    if not rest or roles != ["user", "assistant"] * (len(rest) // 2) + ["user"] or any(m.tool_calls for m in rest):
        raise ValueError(f"{origin}: the prompt turns must alternate user / assistant and end with the user's turn "
                         f"(got {' -> '.join(roles) or 'nothing'}); tool calls are not supported in preference data")
    return (system, [m.content for m in rest[0::2]], [m.content for m in rest[1::2]],
            _answer(record["chosen"], "chosen", origin), _answer(record["rejected"], "rejected", origin))
