"""Jinja chat templates rendered the way transformers' ``apply_chat_template`` renders them.

Where the template comes from (first found):

1. the ``chat_template`` key, when it names a jinja file (not PaddleNLP's ``chat_template.json``);
2. ``chat_template`` in the tokenizer directory's ``tokenizer_config.json``: a jinja string, or a
   list of named templates ``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``
   (``tool_use`` for conversations with tools when present, else ``default``: transformers' rule);
3. ``chat_template.jinja`` in the tokenizer directory (where newer transformers save it).

The environment is transformers' (``utils/chat_template_utils.py``): jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that does not HTML-escape (``ensure_ascii=False``), and the globals
``raise_exception`` and ``strftime_now``.  A template is called with ``messages``, ``tools``,
``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).
Example: the template ``{% for m in messages %}{{ m.role }}: {{ m.content }}\\n{% endfor %}`` renders
``[{"role": "user", "content": "hi"}]`` as ``"user: hi\\n"``.
"""

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Dict, List, Optional

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .reader import DataError, read_utf8_text


class TemplateRenderError(ValueError):
    """The template refused or failed on a conversation (its ``raise_exception`` or a jinja error)."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes; transformers replaces it with plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' environment (cached by source text)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render(
    source: str,
    messages: List[Dict[str, Any]],
    tools: Optional[List[Dict]],
    add_generation_prompt: bool,
    special_tokens: Dict[str, Any],
) -> str:
    """Render ``messages`` (template dicts) with ``tools``; the special tokens are template variables as in
    transformers (``{**tokenizer.special_tokens_map, ...}``).  A template error -> :class:`TemplateRenderError`."""
    try:
        return compile_template(source).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except jinja2.exceptions.TemplateError as e:
        raise TemplateRenderError(f"the chat template cannot render this conversation: {e}") from e


def special_tokens_of(tokenizer) -> Dict[str, Any]:
    """``tokenizer.special_tokens_map`` as plain strings: ``{"bos_token": "<s>", "eos_token": "</s>", ...}``."""
    out = {}
    for key, val in dict(getattr(tokenizer, "special_tokens_map", {}) or {}).items():
        out[key] = [str(v) for v in val] if isinstance(val, (list, tuple)) else str(val)
    return out


def pick_named(templates: Any, has_tools: bool, where: str) -> Optional[str]:
    """A ``chat_template`` value -> one jinja source.  A string stays; a list of ``{"name", "template"}``
    gives ``tool_use`` (when the data has tools and it exists) or ``default``:

    >>> pick_named([{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}], True, "x")
    'B'
    """
    if templates is None or isinstance(templates, str):
        return templates
    if isinstance(templates, list) and all(isinstance(t, dict) and "name" in t and "template" in t for t in templates):
        named = {t["name"]: t["template"] for t in templates}
        if has_tools and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise DataError([f"{where}: chat_template lists templates {sorted(named)} but none is named 'default'"])
    raise DataError([f'{where}: chat_template must be a jinja string or a list of {{"name", "template"}}'])


def find_template(
    tokenizer_dir: Optional[str], chat_template_key: Optional[str], has_tools: bool = False
) -> Optional[str]:
    """The jinja source to render conversations with (see the module docstring), or None."""
    if chat_template_key and not chat_template_key.endswith(".json"):
        return read_utf8_text(chat_template_key)
    if chat_template_key:  # PaddleNLP's chat_template.json: not jinja, rendered by PaddleNLP (src/tgt turns)
        return None
    if not tokenizer_dir:
        return None
    cfg_path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        try:
            cfg = json.loads(read_utf8_text(cfg_path))
        except json.JSONDecodeError as e:
            raise DataError([f"{cfg_path}:{e.lineno}: invalid JSON ({e.msg})"]) from None
        source = pick_named(cfg.get("chat_template"), has_tools, cfg_path) if isinstance(cfg, dict) else None
        if source:
            return source
    jinja_path = os.path.join(tokenizer_dir, "chat_template.jinja")
    return read_utf8_text(jinja_path) if os.path.isfile(jinja_path) else None
