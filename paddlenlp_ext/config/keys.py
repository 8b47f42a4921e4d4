"""The field helpers of the config key dataclasses (``schema.py``, ``alignment_schema.py``); no paddle here.

Field metadata drives validation (``fields.py``, ``parse.py``) and docs/config.md (``docs.py``):

* ``help``: one line for ``docs/config.md`` and ``--help``.
* ``choices``: allowed values.
* ``min`` / ``gt``: inclusive / exclusive lower bound (``None`` always allowed).
* ``unsupported``: the key is accepted for compatibility, but a value other
  than the default stops the run with this reason (never silently ignored).
* ``required``, ``llm_meta``: see ``fields.FieldSpec``.
"""

from dataclasses import field


def key(default, help, **meta):
    """A dataclass field with its metadata.

    >>> key(8, "LoRA rank r.", gt=0).metadata["gt"]
    0
    """
    meta["help"] = help
    return field(default=default, metadata=meta)


def unsupported_key(default, help, reason="not supported yet"):
    """A key accepted for PaddleNLP configs: a value other than ``default`` stops the run with ``reason``."""
    return key(default, help, unsupported=reason)
