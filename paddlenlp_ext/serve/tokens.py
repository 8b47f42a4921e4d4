"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` and ``GET /tokenizer_info`` (lm-eval's remote tokenizer).

Shapes as vLLM answers them, which is what lm-eval 0.4.13's ``RemoteTokenizer`` reads:

* ``/tokenize`` ``{"prompt": str, "add_special_tokens": bool = true}`` or ``{"messages": [...],
  "tools": [...]}`` -> ``{"count", "max_model_len", "tokens"}``; ``messages`` (and ``tools``) are
  rendered exactly as a chat request's prompt;
* ``/detokenize`` ``{"tokens": [int]}`` -> ``{"prompt": str}`` (special tokens kept);
* ``/tokenizer_info`` -> ``{"eos_token", "bos_token", "pad_token", "unk_token", "chat_template",
  "model_max_length", "tokenizer_class"}`` (lm-eval's check needs ``eos_token``).

``model`` is optional (default: the base; every served name shares the base's tokenizer).
"""

from __future__ import annotations

from typing import Any, Dict, List

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from .protocol import ApiError, Sampling, bad, parse_chat


def _model(body: Dict[str, Any], models, by_name):
    name = body.get("model")
    if name is None:
        return models[0]
    if name not in by_name:
        raise ApiError(
            404, f"the model {name!r} does not exist here; served: {', '.join(by_name)}", "model", "model_not_found"
        )
    return by_name[name]


def _object(body: Any) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_type")
    return body


def add_token_routes(app: FastAPI, models, by_name) -> None:
    from .app import read_json
    from .models import prompt_ids, vocab_size

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = _object(await read_json(request))
        m = _model(body, models, by_name)
        tok = m.session.tokenizer
        if "messages" in body:
            chat = {"model": m.name, "messages": body["messages"], "max_tokens": 1}
            if body.get("tools"):
                chat["tools"] = body["tools"]
            req = parse_chat(chat, [m.name], Sampling())
            ids = await run_in_threadpool(prompt_ids, req, m)
        else:
            prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
            if not isinstance(prompt, str):
                raise bad("prompt", "prompt must be a string (or send messages)", "invalid_type")
            if not isinstance(special, bool):
                raise bad("add_special_tokens", "add_special_tokens must be true or false", "invalid_type")
            ids = (await run_in_threadpool(tok, prompt, add_special_tokens=special, return_attention_mask=False))[
                "input_ids"
            ]
        ids = [int(t) for t in ids]
        return {"count": len(ids), "max_model_len": m.options.max_length, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = _object(await read_json(request))
        m = _model(body, models, by_name)
        tokens: List[Any] = body.get("tokens")
        v = vocab_size(m.session.tokenizer)
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < v for t in tokens
        ):
            raise bad("tokens", f"tokens must be a list of token ids in [0, {v})", "invalid_type")
        text = m.session.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        m = models[0]
        tok = m.session.tokenizer
        template = m.session.jinja or getattr(tok, "chat_template", None)
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": getattr(tok, "unk_token", None),
            "chat_template": template if isinstance(template, str) else None,
            "model_max_length": m.options.max_length,
        }
