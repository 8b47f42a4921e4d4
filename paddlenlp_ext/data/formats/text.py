"""Raw text records -> :class:`TextDoc` (``autoregressive: true``).

``{"text": "Anarchism is ..."}`` (from a JSON file, or one line of a ``.txt`` file) ->
``TextDoc("Anarchism is ...", origin="f.txt:1")``.  The column can be renamed (``dataset_columns``: ``text``).
"""

from .convo import DEFAULT_COLUMNS, TextDoc


def matches(record, columns=None) -> bool:
    c = {**DEFAULT_COLUMNS, **(columns or {})}
    return isinstance(record, dict) and isinstance(record.get(c["text"]), str)


def convert(record, origin: str, columns=None, tags=None) -> TextDoc:
    c = {**DEFAULT_COLUMNS, **(columns or {})}
    text = record.get(c["text"])
    if not isinstance(text, str):
        raise ValueError(f"{origin}: missing text: expected a string under {c['text']!r}")
    if not text.strip():
        raise ValueError(f"{origin}: empty text document; remove the record")
    return TextDoc(text, origin=origin)
