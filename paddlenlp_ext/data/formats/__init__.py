"""Dataset formats: every record shape a user brings -> one conversation representation.

``files``      records from ``.json`` (an array or JSON lines), ``.jsonl``, ``.txt`` and ``.parquet``,
               each with its line (JSON lines, arrays: the line where the record starts; parquet: row number)
``convo``      the internal representation: :class:`Conversation` of :class:`Message` + tools + system, and
               :class:`TextDoc` for raw text; the columns / role tags (LLaMA-Factory's ``columns`` / ``tags``)
``paddlenlp``  ``{"src", "tgt"}`` (kept as :class:`~paddlenlp_ext.data.reader.Example`, rendered as before)
``alpaca``     ``instruction`` / ``input`` / ``output`` (+ ``system``, ``history``)
``sharegpt``   ``conversations`` of ``{"from", "value"}`` (+ ``system``, ``tools``)
``messages``   OpenAI ``messages`` (``role`` / ``content``, ``tool_calls``, ``reasoning_content``) + ``tools``
``text``       ``{"text": ...}`` records and ``.txt`` lines (``autoregressive: true``)
``detect``     which format a record is, and the per-file reader that applies it
"""

from .convo import Conversation, Message, TextDoc  # noqa: F401
from .detect import FORMATS, detect_format, parse_record, read_items  # noqa: F401
