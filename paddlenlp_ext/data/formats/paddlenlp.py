"""PaddleNLP's ``{"src", "tgt"}`` records -> :class:`~paddlenlp_ext.data.reader.Example` (unchanged rendering).

``{"src": ["hi", "and?"], "tgt": ["hello", "bye"], "context": {"system": "Be brief."}}`` ->
``Example(src=["hi", "and?"], tgt=["hello", "bye"], system="Be brief.")``.  These keep PaddleNLP's
rendering (``encode_chat_inputs`` with a template, ``bos src tgt eos`` without), token for token.
"""

from ..reader import Example, example_from_obj


def matches(record) -> bool:
    """A record with ``src`` or ``tgt`` is a PaddleNLP record (a missing half is reported by :func:`convert`)."""
    return isinstance(record, dict) and ("src" in record or "tgt" in record)


def convert(record, origin: str, columns=None, tags=None) -> Example:
    """``convert({"src": "a", "tgt": "b"}, "f:1")`` -> ``Example(src=['a'], tgt=['b'], system=None, origin='f:1')``."""
    return example_from_obj(record, origin)
