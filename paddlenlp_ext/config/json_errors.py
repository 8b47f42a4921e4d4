"""Readable messages for JSON syntax errors in config files (no paddle).

Python's ``json`` reports where parsing stopped, which for the two commonest
hand-editing mistakes is not where the mistake is:

- a trailing comma (``"a": 1,`` before ``}``) is reported at the *next* line's
  brace ("Expecting property name enclosed in double quotes");
- a ``//`` or ``#`` comment (JSON has none) is reported as "Expecting value".

:func:`describe_json_error` names the line of the real mistake and what to do.
"""

import json
import re
from typing import Tuple

_COMMENT = re.compile(r"\s*(//|/\*|#)")


def _line_col(text: str, pos: int) -> Tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def describe_json_error(path: str, text: str, err: json.JSONDecodeError) -> str:
    """One message for a JSON syntax error, naming the line of the mistake.

    >>> t = '{\\n  "a": 1,\\n}\\n'
    >>> describe_json_error("c.json", t, _err(t))
    'c.json:2:9: invalid JSON: trailing comma before "}" (JSON allows no comma after the last item; remove it)'
    >>> t = '{\\n  // my run\\n  "a": 1\\n}\\n'
    >>> describe_json_error("c.json", t, _err(t))
    'c.json:2:3: invalid JSON: JSON has no comments; remove "// my run"'
    """
    pos = err.pos
    comment = _COMMENT.match(text, pos)
    if comment:
        at = comment.start(1)
        line, col = _line_col(text, at)
        snippet = text[at : text.find("\n", at) if "\n" in text[at:] else len(text)].strip()
        return f'{path}:{line}:{col}: invalid JSON: JSON has no comments; remove "{snippet[:40]}"'
    stripped = text[:pos].rstrip()
    closer = text[pos : pos + 1]
    if stripped.endswith(",") and closer in "}]" and closer:
        line, col = _line_col(text, len(stripped) - 1)
        return (
            f'{path}:{line}:{col}: invalid JSON: trailing comma before "{closer}" '
            "(JSON allows no comma after the last item; remove it)"
        )
    return f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}"


def _err(text: str) -> json.JSONDecodeError:
    """The error ``json.loads(text)`` raises (for the doctests)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return e
    raise ValueError("valid JSON")
