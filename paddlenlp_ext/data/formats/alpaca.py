"""Alpaca records (``instruction`` / ``input`` / ``output``, optional ``system`` and ``history``) -> a conversation.

As LLaMA-Factory: the user turn is ``instruction`` followed by ``"\\n" + input`` when ``input`` is
not empty; ``history`` is a list of ``[query, answer]`` pairs that come before it.  Worked example::

    {"instruction": "Add", "input": "1 2", "output": "3", "system": "Be exact.", "history": [["hi", "hello"]]}
    -> [system "Be exact.", user "hi", assistant "hello", user "Add\\n1 2", assistant "3"]

Column names can be renamed (``dataset_columns``: ``prompt``, ``query``, ``response``, ``system``, ``history``).
"""

from .convo import DEFAULT_COLUMNS, Conversation, Message


def matches(record, columns=None) -> bool:
    c = {**DEFAULT_COLUMNS, **(columns or {})}
    return isinstance(record, dict) and c["prompt"] in record and c["response"] in record


def _text(record, key, where, required=False):
    val = record.get(key)
    if val is None:
        if required:
            raise ValueError(f"{where}: missing key {key!r}")
        return ""
    if not isinstance(val, str):
        raise ValueError(f"{where}: {key!r} must be a string, got {type(val).__name__}")
    return val


def convert(record, origin: str, columns=None, tags=None) -> Conversation:
    c = {**DEFAULT_COLUMNS, **(columns or {})}
    prompt = _text(record, c["prompt"], origin, required=True)
    query = _text(record, c["query"], origin)
    answer = _text(record, c["response"], origin, required=True)
    system = _text(record, c["system"], origin)
    msgs = [Message("system", system)] if system else []
    history = record.get(c["history"]) or []
    if not isinstance(history, list):
        raise ValueError(f"{origin}: {c['history']!r} must be a list of [query, answer] pairs")
    for k, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise ValueError(f"{origin}: {c['history']!r} item {k + 1} must be a [query, answer] pair of strings")
        msgs += [Message("user", pair[0]), Message("assistant", pair[1])]
    msgs += [Message("user", prompt + ("\n" + query if query else "")), Message("assistant", answer)]
    return Conversation(msgs, origin=origin, format="alpaca")
