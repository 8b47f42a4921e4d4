"""GRPO prompts: records of any data format -> prompt token ids, prompt text and reward columns.

Every format the SFT readers know is accepted (``data.formats``: messages, sharegpt, alpaca,
paddlenlp src/tgt); a trailing assistant answer (``output``, a last ``tgt``, a last assistant
message) is dropped, so SFT data can serve as prompts.  The prompt is rendered exactly as training
renders the turns before an answer (the run's ``Renderer``: jinja template, PaddleNLP template or
none) and fitted by the one truncation policy (:func:`fit_prompt`: oldest rounds first, then its LAST
``max_prompt_len`` tokens).  Every other field of a record is a reward
column, passed to the reward functions; all records must have the same columns.  Bad records are
reported together with ``file:line`` (DataError, exit 2); none is skipped.

Worked example (no chat template, bos 1, "hi" -> [5])::

    {"messages": [{"role": "user", "content": "hi"}], "keyword": "gym"}
    -> ids [1, 5], text "hi", columns {"keyword": "gym"}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..data.formats.convo import DEFAULT_COLUMNS, Conversation, Message
from ..data.formats.detect import detect_format, parse_record
from ..data.formats.files import parse_records
from ..data.reader import DataError, Example
from ..data.tokenize import IGNORE_INDEX

__all__ = [
    "PromptRecord",
    "prompt_from_record",
    "read_prompts",
    "fit_prompt",
    "render_prompt",
    "PromptDataset",
    "prompt_collator",
    "offer_tools",
    "prompt_messages",
]

#: stands in for the answer while the prompt is rendered; its tokens are dropped
PLACEHOLDER_ANSWER = "answer"
#: record keys that hold the conversation in some format (never reward columns)
CONVERSATION_KEYS = set(DEFAULT_COLUMNS.values()) | {"messages", "src", "tgt", "context"}


@dataclass
class PromptRecord:
    item: Any  # Example or Conversation ending with the user's turn
    text: str  # the last user turn: what the reward functions see as the prompt
    columns: Dict[str, Any] = field(default_factory=dict)
    origin: str = ""


def prompt_from_record(
    record: Any, origin: str, fmt: str = "auto", columns: Optional[Dict[str, str]] = None
) -> PromptRecord:
    """One record -> its prompt (answer dropped) and reward columns.

    >>> r = prompt_from_record({"instruction": "Name a colour", "output": "red", "keyword": "red"}, "f:1")
    >>> [(m.role, m.content) for m in r.item.messages], r.text, r.columns
    ([('user', 'Name a colour')], 'Name a colour', {'keyword': 'red'})
    >>> r = prompt_from_record({"src": ["a", "b"], "tgt": ["x"], "n": 1}, "f:2")
    >>> r.item.src, r.item.tgt, r.text, r.columns
    (['a', 'b'], ['x'], 'b', {'n': 1})
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    rec = dict(record)
    names = {**DEFAULT_COLUMNS, **(columns or {})}
    if names["prompt"] in rec and names["response"] not in rec:  # alpaca prompts may come without an answer
        rec[names["response"]] = ""
    if "src" in rec:  # a prompt may come without its last answer: a placeholder, dropped below as any last answer
        src, tgt = rec["src"], rec.get("tgt", [])
        if isinstance(src, list) and isinstance(tgt, list) and len(tgt) == len(src) - 1:
            rec["tgt"] = tgt + [PLACEHOLDER_ANSWER]
        elif isinstance(src, str) and "tgt" not in rec:
            rec["tgt"] = PLACEHOLDER_ANSWER
    if detect_format(rec, columns) == "text":
        raise ValueError("a raw text record has no prompt; give messages, alpaca, sharegpt or src/tgt records")
    item = parse_record(rec, fmt, origin, columns, check=False)
    if isinstance(item, Example):
        src = item.src if isinstance(item.src, list) else [item.src]
        tgt = item.tgt if isinstance(item.tgt, list) else [item.tgt]
        tgt = [t for t in tgt][: len(src) - 1]  # a last tgt answers the last src: dropped
        item = Example(src=list(src), tgt=tgt, system=item.system, origin=origin)
        text = src[-1]
    elif isinstance(item, Conversation):
        msgs = list(item.messages)
        while msgs and msgs[-1].role == "assistant":
            msgs.pop()
        if not msgs or msgs[-1].role != "user":
            raise ValueError("the conversation must end with a user turn (after dropping a trailing answer)")
        item = Conversation(msgs, tools=item.tools, origin=origin, format=item.format)
        text = msgs[-1].content
    else:
        raise ValueError("not a prompt record")
    used = CONVERSATION_KEYS | set((columns or {}).values())
    extra = {k: v for k, v in record.items() if k not in used}
    return PromptRecord(item=item, text=text, columns=extra, origin=origin)


def read_prompts(files: List[str], fmt: str = "auto", columns: Optional[Dict[str, str]] = None) -> List[PromptRecord]:
    """Every record of ``files`` as a :class:`PromptRecord`; all problems raised together (DataError)."""
    out = parse_records(files, lambda record, origin: prompt_from_record(record, origin, fmt, columns))
    if not out:
        raise DataError([f"{', '.join(files)}: no prompts (the file is empty)"])
    keys = set(out[0].columns)
    problems = [
        f"{p.origin}: fields {sorted(p.columns)} differ from the first record's {sorted(keys)}; every "
        "prompt needs the same reward columns"
        for p in out
        if set(p.columns) != keys
    ]
    if problems:
        raise DataError(problems[:20], max(len(problems) - 20, 0))
    return out


def _render(item, renderer) -> List[int]:
    """The prompt's token ids as training renders the turns before an answer (no length limit)."""
    if isinstance(item, Example):
        item = Example(
            src=list(item.src), tgt=list(item.tgt) + [PLACEHOLDER_ANSWER], system=item.system, origin=item.origin
        )
    else:
        item = Conversation(
            list(item.messages) + [Message("assistant", PLACEHOLDER_ANSWER)],
            tools=item.tools,
            origin=item.origin,
            format=item.format,
        )
    feats, _, _ = renderer(item)
    labels = feats[0]["labels"]  # shifted: labels[k] is the token after input_ids[k]
    # the placeholder is the LAST run of learned tokens (earlier answers of a multi-turn prompt are learned too)
    end = max(k for k, t in enumerate(labels) if t != IGNORE_INDEX)
    first = end
    while first > 0 and labels[first - 1] != IGNORE_INDEX:
        first -= 1
    return list(feats[0]["input_ids"][: first + 1])


def _without_oldest_round(item):
    """The item without its first user turn and what answers it (None when only the last round is left)."""
    if isinstance(item, Example):
        return (
            Example(src=item.src[1:], tgt=item.tgt[1:], system=item.system, origin=item.origin)
            if len(item.src) > 1
            else None
        )
    users = [i for i, m in enumerate(item.messages) if m.role == "user"]
    if len(users) < 2:
        return None
    msgs = item.messages[: users[0]] + item.messages[users[1] :]
    return Conversation(msgs, tools=item.tools, origin=item.origin, format=item.format)


def fit_prompt(rec: PromptRecord, renderer, max_prompt_len: int) -> Tuple[List[int], bool, int]:
    """``(ids, truncated, dropped_rounds)``: the prompt by the one truncation policy (docs/data.md) -- the oldest
    rounds go first while it is longer than ``max_prompt_len``, then it keeps its LAST ``max_prompt_len``
    tokens (cut from the left).  The renderer has no length limit (``src_length`` / ``max_length`` huge)."""
    item, dropped = rec.item, 0
    ids = _render(item, renderer)
    while len(ids) > max_prompt_len:
        shorter = _without_oldest_round(item)
        if shorter is None:
            break
        item, dropped = shorter, dropped + 1
        ids = _render(item, renderer)
    return ids[-max_prompt_len:], dropped > 0 or len(ids) > max_prompt_len, dropped


def render_prompt(rec: PromptRecord, renderer, max_prompt_len: int) -> List[int]:
    """The prompt's token ids as training renders the turns before an answer, fitted to ``max_prompt_len`` by
    :func:`fit_prompt` (oldest rounds first, then the last ``max_prompt_len`` tokens kept).

    A placeholder answer is appended and rendered with ``renderer`` (data.conversation.Renderer, with
    no length limit); the prompt is everything before its first supervised token."""
    return fit_prompt(rec, renderer, max_prompt_len)[0]


def as_conversation(item) -> Conversation:
    """A prompt item as a Conversation (an Example's src/tgt turns become user/assistant messages).

    >>> [(m.role, m.content) for m in as_conversation(Example(src=["a", "b"], tgt=["x"], system="s")).messages]
    [('system', 's'), ('user', 'a'), ('assistant', 'x'), ('user', 'b')]
    """
    if isinstance(item, Conversation):
        return item
    msgs = [Message("system", item.system)] if item.system else []
    for k, user in enumerate(item.src):
        msgs.append(Message("user", user))
        if k < len(item.tgt):
            msgs.append(Message("assistant", item.tgt[k]))
    return Conversation(msgs, origin=item.origin, format="src/tgt")


def offer_tools(rec: PromptRecord, schemas: List[Dict]) -> PromptRecord:
    """The prompt with the configured tools offered (the chat template's ``tools``); a record that lists its
    own tools is refused (ValueError naming it): the model could call a tool that does not run."""
    conv = as_conversation(rec.item)
    if conv.tools:
        raise ValueError(
            f"{rec.origin}: the record lists its own 'tools', and the tools key gives the tools that "
            "run; remove 'tools' from the records (every prompt is offered the configured tools)"
        )
    item = Conversation(list(conv.messages), tools=list(schemas), origin=conv.origin, format=conv.format)
    return PromptRecord(item=item, text=rec.text, columns=rec.columns, origin=rec.origin)


def prompt_messages(rec: PromptRecord) -> List[Dict]:
    """The prompt's messages as the reward functions see them (OpenAI / template dicts)."""
    return [m.as_template_dict() for m in as_conversation(rec.item).messages]


class PromptDataset:
    """Map-style: item ``i`` is ``{"prompt_index": i}``; the trainer looks up ``ids``, ``texts``, ``columns``."""

    def __init__(self, records: List[PromptRecord], ids: List[List[int]]):
        self.records, self.ids = records, ids
        self.texts = [r.text for r in records]
        self.messages = [prompt_messages(r) for r in records]  # multi-turn rewards: the whole conversation
        self.origins = [r.origin for r in records]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Dict:
        return {"prompt_index": int(i)}

    def columns(self, indices) -> Dict[str, list]:
        """{column: [value of each prompt in ``indices``]}."""
        keys = list(self.records[0].columns) if self.records else []
        return {k: [self.records[int(i)].columns[k] for i in indices] for k in keys}

    def stats(self) -> Dict:
        lengths = np.asarray([len(x) for x in self.ids], dtype=np.int64)
        return {
            "prompts": len(self.ids),
            "prompt_tokens": int(lengths.sum()),
            "prompt_tokens_max": int(lengths.max()) if len(lengths) else 0,
            "reward_columns": sorted(self.records[0].columns) if self.records else [],
        }


def prompt_collator(items) -> Dict:
    """[{"prompt_index": i}, ...] -> {"prompt_index": int64 [b]}."""
    return {"prompt_index": np.asarray([int(x["prompt_index"]) for x in items], dtype=np.int64)}
