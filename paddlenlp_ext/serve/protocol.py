"""OpenAI request bodies -> checked requests, and OpenAI-style errors (no paddle, no tokenizer).

Every check names the parameter and what to send instead; the HTTP layer turns an
:class:`ApiError` into ``{"error": {"message", "type", "param", "code"}}`` with its status.

Sampling follows OpenAI's meaning where a request says something and the server's
predictor flags where it does not:

* ``temperature`` 0 -> greedy; ``temperature`` > 0 or ``top_p`` < 1 -> sampling over the whole
  vocabulary (top_k 0) with that temperature / top_p (the missing one at 1.0);
* neither given -> the server's ``--decode_strategy/--top_k/--top_p/--temperature`` (PaddleNLP's
  defaults: greedy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

MAX_STOP = 4  # OpenAI's limit on stop sequences
ROLES = ("system", "developer", "user", "assistant")
#: parameters that change nothing about the answer, accepted and not used
HARMLESS = {"user", "metadata", "store", "stream_options", "service_tier", "parallel_tool_calls"}
#: OpenAI parameters this server does not implement, with the value that means "off" (accepted as such)
UNSUPPORTED = {
    "functions": None,
    "function_call": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "suffix": None,
    "modalities": None,
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
}
#: "off" values besides None that mean the same (OpenAI's own defaults, which its clients may send)
ALSO_OFF = {"logit_bias": ({},), "modalities": (["text"],), "suffix": ("",)}
MAX_N = 16  # choices per request (each is a row of the batch)
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API (vLLM's default limit too)
COMMON = (
    {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "n", "logprobs", "response_format"}
    | HARMLESS
    | set(UNSUPPORTED)
)
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
COMPLETION_KEYS = COMMON | {"prompt", "echo", "best_of"}


class ApiError(Exception):
    """A request the server refuses: HTTP status + OpenAI's error object."""

    TYPES = {
        400: "invalid_request_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "server_error",
    }

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> Dict[str, Any]:
        """OpenAI's error object.

        >>> ApiError(400, "bad", "top_p", "invalid_value").body()["error"]["type"]
        'invalid_request_error'
        """
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: Optional[str], message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens (per row: requests with different sampling share a batch, serve.decode)."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 1
    seed: Optional[int] = None


@dataclass
class Conversation:
    """A chat as the predictor's prompt record: ``src`` user turns (the last is answered), earlier answers."""

    src: List[str]
    history: List[str]
    system: Optional[str] = None


@dataclass
class GenRequest:
    kind: str  # "chat" | "completion"
    model: str
    stream: bool
    include_usage: bool
    max_tokens: Optional[int]  # None: the rest of the context
    stop: List[str]
    sampling: Sampling
    conversation: Optional[Conversation] = None  # chat
    prompt: Optional[List[Any]] = None  # completion: prompts, each a string or a list of token ids
    n: int = 1  # choices per prompt
    logprobs: Optional[int] = None  # None: no logprobs; k: the chosen token's and the k most likely
    echo: bool = False  # completion: the prompt (text and logprobs) before the answer
    response_format: Optional[Dict[str, Any]] = None  # json_object / json_schema: constrained decoding
    messages: Optional[List[Dict[str, Any]]] = None  # chat with tools / tool turns: the template's messages
    tools: Optional[List[Dict[str, Any]]] = None  # offered functions ({"type": "function", "function": {...}})
    tool_choice: Any = "none"  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_keys(body: Dict[str, Any], allowed: set, endpoint: str) -> None:
    for key in body:
        if key not in allowed:
            raise bad(key, f"unknown parameter {key!r} for {endpoint}", "unknown_parameter")
    for key, off in UNSUPPORTED.items():
        if key in body and body[key] is not None and body[key] != off and body[key] not in ALSO_OFF.get(key, ()):
            raise bad(
                key,
                f"{key}={body[key]!r} is not supported by this server (leave it out"
                + ("" if off is None else f" or send {off!r}")
                + ")",
                "unsupported_parameter",
            )


def text_content(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts joined.

    >>> text_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "messages[0].content")
    'ab'
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for i, p in enumerate(content):
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise bad(
                    f"{where}[{i}]",
                    f'{where}[{i}] must be {{"type": "text", "text": "..."}} (this server reads text only)',
                )
            parts.append(p["text"])
        return "".join(parts)
    raise bad(where, f"{where} must be a string or a non-empty list of text parts, got {type(content).__name__}")


def parse_messages(messages: Any) -> Conversation:
    """OpenAI messages -> the predictor's turns: an optional system message first, then user and
    assistant alternating, ending with the user turn to answer.

    >>> c = parse_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
    ...                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}])
    >>> c.src, c.history, c.system
    (['Hi', 'Bye'], ['Hello!'], 'Be brief.')
    """
    if not isinstance(messages, list) or not messages:
        raise bad(
            "messages",
            'messages must be a non-empty list of {"role", "content"} objects',
            "missing_required_parameter" if messages is None else "invalid_type",
        )
    system, src, history = None, [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with 'role' and 'content'", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(
                f"{where}.role",
                f"{where}.role {role!r} is not supported: use one of {', '.join(ROLES)} "
                "(tool and function messages are not supported)",
            )
        if "content" not in m or m["content"] is None:
            raise bad(f"{where}.content", f"{where} has no content", "missing_required_parameter")
        text = text_content(m["content"], f"{where}.content")
        if role in ("system", "developer"):
            if i != 0:
                raise bad(
                    f"{where}.role",
                    f"{where}: a {role} message is only accepted first (one system prompt "
                    "per conversation, as in training)",
                )
            system = text
        elif role == "user":
            if len(src) != len(history):
                raise bad(
                    f"{where}.role",
                    f"{where}: two user messages in a row; user and assistant turns must "
                    "alternate (join the two user messages into one)",
                )
            src.append(text)
        else:
            if len(src) != len(history) + 1:
                raise bad(f"{where}.role", f"{where}: an assistant message must follow a user message")
            history.append(text)
    if not src or len(src) != len(history) + 1:
        raise bad("messages", "the last message must be the user's turn to answer", "invalid_value")
    return Conversation(src=src, history=history, system=system)


def _optional_number(body, key, lo, hi, lo_open=False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if not _is_number(v):
        raise bad(key, f"{key} must be a number, got {type(v).__name__}", "invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(key, f"{key} {v} is out of range: must be in {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def parse_sampling(body: Dict[str, Any], default: Sampling) -> Sampling:
    """The request's sampling (module doc).

    >>> parse_sampling({"temperature": 0}, Sampling(greedy=False, top_k=0)).greedy
    True
    >>> s = parse_sampling({"top_p": 0.9}, Sampling())
    >>> (s.greedy, s.temperature, s.top_p, s.top_k)
    (False, 1.0, 0.9, 0)
    """
    temperature = _optional_number(body, "temperature", 0.0, 2.0)
    top_p = _optional_number(body, "top_p", 0.0, 1.0, lo_open=True)
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise bad("seed", f"seed must be an integer, got {type(seed).__name__}", "invalid_type")
    if seed is not None and not 0 <= seed < 2**63:
        raise bad("seed", f"seed {seed} is out of range: must be in [0, 2**63)")
    if temperature is None and top_p is None:
        return Sampling(default.greedy, default.temperature, default.top_p, default.top_k, seed)
    if temperature == 0.0:
        return Sampling(greedy=True, seed=seed)
    t, p = temperature if temperature is not None else 1.0, top_p if top_p is not None else 1.0
    return Sampling(greedy=False, temperature=t, top_p=p, top_k=0, seed=seed)


def parse_stop(value: Any) -> List[str]:
    """The stop sequences as a list.

    >>> parse_stop("\\n"), parse_stop(None), parse_stop(["a", "b"])
    (['\\n'], [], ['a', 'b'])
    """
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings", "invalid_type")
    if len(stops) > MAX_STOP:
        raise bad("stop", f"stop has {len(stops)} sequences; at most {MAX_STOP} are accepted")
    return list(stops)


def _max_tokens(body: Dict[str, Any]) -> Optional[int]:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v):
        raise bad(key, f"{key} must be an integer, got {type(v).__name__}", "invalid_type")
    if v < 1:
        raise bad(key, f"{key} {v}: must be at least 1")
    return v


def common_fields(body: Any, endpoint: str, allowed: set, models: List[str]) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_type")
    _check_keys(body, allowed, endpoint)
    model = body.get("model")
    if model is None:
        raise bad(
            "model", f"model is required: one of {', '.join(models)} (GET /v1/models)", "missing_required_parameter"
        )
    if not isinstance(model, str):
        raise bad("model", f"model must be a string, got {type(model).__name__}", "invalid_type")
    if model not in models:
        raise ApiError(
            404, f"the model {model!r} does not exist here; served: {', '.join(models)}", "model", "model_not_found"
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"stream must be true or false, got {stream!r}", "invalid_type")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
        raise bad("stream_options", 'stream_options must be {"include_usage": true|false}', "invalid_type")
    return {
        "model": model,
        "stream": stream,
        "include_usage": bool(stream and opts and opts.get("include_usage")),
        "max_tokens": _max_tokens(body),
        "stop": parse_stop(body.get("stop")),
        "n": bounded_int(body, "n", 1, MAX_N, 1),
        "response_format": parse_response_format(body.get("response_format")),
    }


def bounded_int(body: Dict[str, Any], key: str, lo: int, hi: int, default: Optional[int]) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return default
    if not is_int(v):
        raise bad(key, f"{key} must be an integer, got {type(v).__name__}", "invalid_type")
    if not lo <= v <= hi:
        raise bad(key, f"{key} {v} is out of range: must be in [{lo}, {hi}]")
    return v


def parse_response_format(value: Any) -> Optional[Dict[str, Any]]:
    """None for free text (absent, or OpenAI's default ``{"type": "text"}``); the object for JSON output.

    >>> parse_response_format({"type": "text"}) is None, parse_response_format({"type": "json_object"})
    (True, {'type': 'json_object'})
    """
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad(
            "response_format",
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            "invalid_type",
        )
    if value["type"] == "text":
        return None
    if value["type"] == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad(
                "response_format.json_schema",
                'response_format.json_schema must be an object with a "schema" object (a JSON Schema)',
                "invalid_type",
            )
    return value


def parse_chat(body: Any, models: List[str], default: Sampling) -> GenRequest:
    """A ``/v1/chat/completions`` body -> GenRequest, or ApiError naming the parameter."""
    common = common_fields(body, "/v1/chat/completions", CHAT_KEYS, models)
    if "messages" not in body:
        raise bad(
            "messages", 'messages is required: [{"role": "user", "content": "..."}]', "missing_required_parameter"
        )
    tools, choice = parse_tools(body)
    raw = body["messages"]
    with_tools = tools is not None or (
        isinstance(raw, list)
        and any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in raw)
    )
    conversation, messages = (None, tool_messages(raw)) if with_tools else (parse_messages(raw), None)
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise bad("logprobs", f"logprobs must be true or false on chat completions, got {want!r}", "invalid_type")
    top = bounded_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
    if top is not None and not want:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    return GenRequest(
        kind="chat",
        sampling=parse_sampling(body, default),
        conversation=conversation,
        logprobs=(top or 0) if want else None,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        **common,
    )


def parse_tools(body: Dict[str, Any]) -> Tuple[Optional[List[Dict[str, Any]]], Any]:
    """(tools or None, tool_choice) with OpenAI's defaults: "auto" with tools, "none" without.

    >>> parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}]})[1]
    'auto'
    """
    tools = body.get("tools") or None
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict)
            and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            and t["function"]["name"]
            and isinstance(t["function"].get("parameters", {}), dict)
            for t in tools
        ):
            raise bad(
                "tools",
                'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {JSON Schema}}}',
                "invalid_type",
            )
        tools = [{"type": "function", "function": t["function"]} for t in tools]
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools or []]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise bad("tool_choice", f"tool_choice names the function {name!r}, which is not in tools ({names})")
    elif choice not in ("none", "auto", "required"):
        raise bad(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "invalid_type",
        )
    if choice != "none" and not tools:
        raise bad("tool_choice", f"tool_choice {choice!r} needs tools", "invalid_value")
    return tools, choice


def tool_messages(messages: Any) -> List[Dict[str, Any]]:
    """OpenAI messages with tool calls and tool results -> the chat template's message dicts, read by
    training's own parser (``data.formats.messages.to_message``: arguments JSON parsed, as templates expect).

    >>> tool_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
    ...     {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ...     {"role": "tool", "tool_call_id": "c1", "content": "42"}])[2]
    {'role': 'tool', 'content': '42'}
    """
    from ..data.formats.messages import to_message

    if not isinstance(messages, list) or not messages:
        raise bad("messages", 'messages must be a non-empty list of {"role", "content"} objects', "invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with 'role' and 'content'", "invalid_type")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES + ("tool",):
            raise bad(
                f"{where}.role", f"{where}.role {role!r} is not supported: use one of {', '.join(ROLES + ('tool',))}"
            )
        if role == "tool":
            prev = next((p for p in reversed(out) if p["role"] != "tool"), None)
            if prev is None or not prev.get("tool_calls"):
                raise bad(f"{where}.role", f"{where} is a tool result that follows no assistant tool_calls")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            raise bad(f"{where}.content", f"{where} has no content", "missing_required_parameter")
        try:
            msg = to_message(
                dict(
                    m,
                    role=role,
                    content=text_content(m["content"], f"{where}.content") if m.get("content") is not None else None,
                ),
                where,
            ).as_template_dict()
        except ValueError as e:
            raise bad(where, str(e)) from e
        out.append(msg)
    if out[-1]["role"] not in ("user", "tool"):
        raise bad("messages", "the last message must be the user's turn or a tool result to answer", "invalid_value")
    return out
