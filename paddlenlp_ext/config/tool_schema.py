"""Tool functions -> the JSON schemas a chat template renders (GRPO's ``tools`` key), without importing paddle.

A tool is ``"package.module:function"``; its schema is what transformers' ``get_json_schema`` makes of the same
function (what ``apply_chat_template(tools=[function])`` renders): the docstring's first paragraphs are the
description, its Google-style ``Args:`` section describes each argument, the type hints give the types,
arguments without a default are required.  Worked example::

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: The first number.
            b: The second number.
        \"\"\"

    -> {"type": "function", "function": {"name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first
        number."}, "b": {"type": "integer", "description": "The second number."}}, "required": ["a", "b"]}}}

The config checks (``config/grpo.py``) build them; the rollouts run the tools (``grpo/tools.py``).
"""

from __future__ import annotations

import inspect
import re
import typing
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["function_schema"]

_BASIC = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "array",
    dict: "object",
    type(None): "null",
}
_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _type_schema(hint, where: str) -> Dict[str, Any]:
    """A type hint -> its JSON schema (transformers' mapping for the common types)."""
    if hint in _BASIC:
        return {"type": _BASIC[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        out = (
            _type_schema(inner[0], where)
            if len(inner) == 1
            else {"type": sorted(_type_schema(a, where)["type"] for a in inner)}
        )
        if len(inner) < len(args):
            out["nullable"] = True
        return out
    if origin in (list, List):
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if origin in (dict, Dict):
        return {"type": "object", **({"additionalProperties": _type_schema(args[1], where)} if args else {})}
    raise ValueError(
        f"{where}: type hint {hint!r} has no JSON schema here; use int, float, str, bool, list, dict, "
        "Optional[...] or List[...]"
    )


def _docstring(doc: str) -> Tuple[str, Dict[str, str], Optional[str]]:
    """(description, {argument: description}, returns) of a Google-style docstring."""
    lines = inspect.cleandoc(doc).splitlines()
    head: List[str] = []
    args: Dict[str, str] = {}
    returns: List[str] = []
    section, current, indent0 = None, None, None
    for line in lines:
        stripped = line.strip()
        if re.match(r"^(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?)\s*:\s*$", stripped):
            section, current = stripped.split(":")[0], None
            continue
        if section is None:
            head.append(line)
        elif section in ("Args", "Arguments", "Parameters"):
            m, indent = _ARG_LINE.match(line), len(line) - len(line.lstrip())
            if m and (indent0 is None or indent <= indent0):  # "name: text" at the arguments' indent
                indent0 = indent if indent0 is None else indent0
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current and stripped:  # a continuation line
                args[current] = (args[current] + " " + stripped).strip()
        elif section in ("Returns", "Return"):
            returns.append(line)
    return "\n".join(head).strip(), args, ("\n".join(returns).strip() or None)


def function_schema(func, where: str = "tool") -> Dict[str, Any]:
    """The OpenAI function schema of ``func`` (the module docstring); ValueError naming ``where`` when a
    description or type hint is missing (as transformers' get_json_schema refuses)."""
    name = getattr(func, "__name__", None)
    doc = inspect.getdoc(func)
    if not doc:
        raise ValueError(f"{where}: {name} has no docstring; its first line is the description the model reads")
    description, arg_docs, return_doc = _docstring(doc)
    try:
        hints = typing.get_type_hints(func)
        params = inspect.signature(func).parameters
    except (TypeError, ValueError, NameError) as e:
        raise ValueError(f"{where}: cannot read the signature of {name}: {e}") from None
    properties: Dict[str, Any] = {}
    required: List[str] = []
    for arg, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"{where}: {name} takes *{arg}; a tool's arguments must be named")
        if arg not in hints or arg == "return":
            raise ValueError(f"{where}: argument {arg!r} of {name} has no type hint (the schema needs its type)")
        if arg not in arg_docs:
            raise ValueError(
                f"{where}: the docstring of {name} does not describe argument {arg!r}; add it under "
                "'Args:' as '    " + arg + ": what it is'"
            )
        properties[arg] = {**_type_schema(hints[arg], where), "description": arg_docs[arg]}
        if p.default is p.empty:
            required.append(arg)
    parameters: Dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out: Dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:  # as transformers: most templates ignore it, but tojson renders it
        out["return"] = {**_type_schema(hints["return"], where), **({"description": return_doc} if return_doc else {})}
    return {"type": "function", "function": out}
