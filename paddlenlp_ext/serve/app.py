"""The HTTP side: FastAPI routes in OpenAI's shapes, server-sent events, errors, the chat page.

Every failure a client can cause is an :class:`~.protocol.ApiError` rendered as
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status -- bad JSON, a body over
``MAX_BODY_BYTES``, unknown routes and methods included; nothing a request sends reaches the
worker thread unchecked.  Streams are ``text/event-stream`` chunks ending ``data: [DONE]``; a
client that disconnects (the chat page's stop button aborts its fetch) cancels its row.

With ``api_key`` every ``/v1/...`` route and the tokenizer routes need ``Authorization: Bearer KEY``
(401 otherwise, as vLLM); ``/``, ``/static``, ``/health`` and ``/metrics`` stay open.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
from typing import Any, AsyncIterator, Dict, List

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

from .engine import Job, Scheduler
from .logprobs import chat_logprobs, completion_logprobs, merge_completion
from .constrain import request_constraint
from .metrics import Metrics
from .models import ServedModel, model_cards, prompt_ids
from .completions import parse_completion
from .protocol import ApiError, GenRequest, Sampling, parse_chat
from .tokens import add_token_routes
from .tools import parse_tool_calls, tool_style

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
MAX_BODY_BYTES = 4 * 1024 * 1024  # a bigger body is refused (413) before it is parsed
DRAIN_BYTES = 64 * 1024 * 1024  # beyond this an oversized body is not even read: the connection is dropped
DISCONNECT_POLL = 0.2  # seconds between checks that a non-streaming client is still there


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def read_json(request: Request) -> Any:
    """The body as JSON; ApiError 413 over MAX_BODY_BYTES, 400 for bad UTF-8 / JSON.  An oversized body
    is still read (and dropped) up to DRAIN_BYTES so the client gets the 413 instead of a reset connection."""
    raw, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            raw += chunk
        elif size > DRAIN_BYTES:
            break
    if size > MAX_BODY_BYTES:
        raise ApiError(
            413,
            f"the request body is over {MAX_BODY_BYTES} bytes ({size} read); send less "
            "(the prompt is limited by the model's context length anyway)",
            None,
            "request_too_large",
        )
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ApiError(
            400, f"the request body is not UTF-8 ({e.reason} at byte {e.start})", None, "invalid_json"
        ) from e
    except json.JSONDecodeError as e:
        raise ApiError(
            400,
            f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
            None,
            "invalid_json",
        ) from e


OPEN_PATHS = ("/", "/health", "/metrics")  # no key needed (the chat page asks for it itself)


def _token_text(model: ServedModel):
    tok = model.session.tokenizer
    return lambda t: tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _logprobs(req: GenRequest, model: ServedModel, tokens, infos, prompt=None):
    """OpenAI's logprobs object for ``tokens`` (after the echoed prompt's, when ``prompt`` = (ids, infos))."""
    if req.logprobs is None:
        return None
    text = _token_text(model)
    if req.kind == "chat":
        return chat_logprobs(tokens, infos, text)
    out = completion_logprobs(tokens, infos, text)
    return merge_completion(completion_logprobs(prompt[0], prompt[1], text), out) if prompt else out


def _chunk(
    req: GenRequest, rid: str, created: int, index: int = 0, delta: Dict[str, Any] = None, finish=None, logprobs=None
) -> Dict[str, Any]:
    if req.kind == "chat":
        choice = {"index": index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": [choice],
        }
    choice = {"index": index, "text": (delta or {}).get("content", ""), "logprobs": logprobs, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": [choice]}


def _usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(job: Job, rid: str, created: int, observe) -> AsyncIterator[str]:
    req = job.req
    n_new, first = 0, True
    try:
        if req.kind == "chat":
            for c in job.choices:
                yield _sse(_chunk(req, rid, created, c.index, {"role": "assistant", "content": ""}))
        left = len(job.choices)
        style = _tool_style(job)
        while left:
            event = await job.queue.get()
            if event[0] == "delta" and style:  # a tool call is parsed from the whole answer: sent at its end
                continue
            if event[0] == "delta":
                if first:
                    observe("first", None)
                    first = False
                lp = _logprobs(req, job.model, [i["token"] for i in event[3] if i], event[3]) if event[3] else None
                yield _sse(_chunk(req, rid, created, event[2], {"content": event[1]}, logprobs=lp))
            elif event[0] == "error":
                yield _sse(event[1].body())
                break
            else:
                finish = event[1]
                if style:
                    content, calls = parse_tool_calls(event[4], style)
                    if calls:
                        finish = "tool_calls"
                        yield _sse(
                            _chunk(
                                req,
                                rid,
                                created,
                                event[5],
                                {"tool_calls": [dict(c, index=k) for k, c in enumerate(calls)]},
                            )
                        )
                    if content:
                        yield _sse(_chunk(req, rid, created, event[5], {"content": content}))
                yield _sse(_chunk(req, rid, created, event[5], {}, finish))
                n_new += event[3]
                left -= 1
        else:
            if req.include_usage:
                yield _sse(
                    {
                        "id": rid,
                        "object": _chunk(req, rid, created)["object"],
                        "created": created,
                        "model": req.model,
                        "choices": [],
                        "usage": _usage(job.prompt_tokens, n_new),
                    }
                )
            observe("done", n_new)
        yield "data: [DONE]\n\n"
    finally:
        # normal end, or the client went away (the response task is cancelled): stop generating for it
        if not job.finished:
            job.cancel()


async def _wait_done(job: Job, request: Request):
    """Every choice's final event (or an error); cancels the job if its client disconnects first."""
    getter = asyncio.ensure_future(_final_events(job))
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL)
            if done:
                return getter.result()
            if await request.is_disconnected():
                job.cancel()
                return None
    finally:
        getter.cancel()


async def _final_events(job: Job):
    out = []
    while len(out) < len(job.choices):
        event = await job.queue.get()
        if event[0] == "error":
            return [event]
        if event[0] == "done":
            out.append(event)
    return sorted(out, key=lambda e: e[5])


def _tool_style(job: Job):
    """The template's tool-call format when this chat request lets the model call tools, else None."""
    req = job.req
    if req.kind != "chat" or not req.tools or req.tool_choice == "none":
        return None
    return tool_style(job.model.session.jinja)


def _whole(job: Job, rid: str, created: int, events) -> Dict[str, Any]:
    req, choices = job.req, []
    style = _tool_style(job)
    for _, finish, _, n_new, text, index, extra in events:
        if req.kind == "chat":
            message = {"role": "assistant", "content": text}
            calls = None
            if style:
                message["content"], calls = parse_tool_calls(text, style)
            if calls:
                message["tool_calls"], finish = calls, "tool_calls"
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": _logprobs(req, job.model, extra["tokens"], extra["infos"]),
                    "finish_reason": finish,
                }
            )
            continue
        prompt = None
        if req.echo:
            text = (
                job.model.session.tokenizer.decode(
                    extra["prompt_ids"], skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
                + text
            )
            prompt = (extra["prompt_ids"], extra["prompt_infos"] or [None] * len(extra["prompt_ids"]))
        choices.append(
            {
                "index": index,
                "text": text,
                "finish_reason": finish,
                "logprobs": _logprobs(req, job.model, extra["tokens"], extra["infos"], prompt),
            }
        )
    return {
        "id": rid,
        "object": "chat.completion" if req.kind == "chat" else "text_completion",
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": _usage(job.prompt_tokens, sum(e[3] for e in events)),
    }


class Guard:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects from the routes):
    401 without the API key on protected paths, and the request counter by path and status."""

    def __init__(self, app, api_key: str = None, metrics: Metrics = None):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    def _authorized(self, scope) -> bool:
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        return hmac.compare_digest(given, f"Bearer {self.api_key}".encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        counted = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
        if self.api_key and not (path in OPEN_PATHS or path.startswith("/static/")) and not self._authorized(scope):
            self.metrics.requests.labels(path, "401").inc()
            response = error_response(
                ApiError(
                    401,
                    "invalid or missing API key: send the header 'Authorization: "
                    "Bearer KEY' with the server's --api_key",
                    None,
                    "invalid_api_key",
                )
            )
            return await response(scope, receive, send)

        async def send_counted(message):
            if counted and message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, send_counted)


def build_app(
    models: List[ServedModel], scheduler: Scheduler, default: Sampling, api_key: str = None, lora_updating: bool = False
) -> FastAPI:
    app = FastAPI(title="paddlenlp_ext OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    by_name = {m.name: m for m in models}
    names = [m.name for m in models]
    started = int(time.time())
    metrics = Metrics()

    app.add_middleware(Guard, api_key=api_key, metrics=metrics)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = {
            404: f"no route {request.url.path}; endpoints: GET /v1/models, POST /v1/chat/completions, "
            "POST /v1/completions, POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /metrics, "
            "GET /",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(e.status_code, str(e.detail))
        return error_response(ApiError(e.status_code, what, None, "not_found" if e.status_code == 404 else None))

    @app.exception_handler(500)
    async def _internal(request: Request, e: Exception):
        # a bug, not the client's fault: still an OpenAI-style body (uvicorn logs the traceback)
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal"))

    @app.get("/v1/models")
    async def list_models():
        return model_cards(models, started)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        for card in model_cards(models, started)["data"]:
            if card["id"] == model_id:
                return card
        raise ApiError(
            404, f"the model {model_id!r} does not exist here; served: {', '.join(names)}", "model", "model_not_found"
        )

    @app.get("/health")
    async def health():
        return {"status": "ok", "queue": len(scheduler.waiting), **scheduler.stats}

    @app.get("/metrics")
    async def prometheus():
        return Response(
            metrics.render(len(scheduler.waiting), scheduler.stats["running"]), media_type=metrics.content_type
        )

    scheduler.on_rows = metrics.batch_rows.observe
    add_token_routes(app, models, by_name)
    if lora_updating:
        from .lora_admin import add_lora_routes

        add_lora_routes(app, models, by_name, names, scheduler, read_json)

    async def generate(request: Request, parse, endpoint: str):
        t0 = time.time()
        body = await read_json(request)
        req = parse(body, names, default)
        model = by_name[req.model]
        ids = await run_in_threadpool(prompt_ids, req, model)  # tokenizing a long prompt does not block the loop
        limit = model.options.max_length
        if req.kind == "chat":
            budget = req.max_tokens if req.max_tokens is not None else limit - len(ids)
        else:
            budget = [req.max_tokens if req.max_tokens is not None else limit - len(p) for p in ids]
        factory = await run_in_threadpool(request_constraint, req, model.session)
        job = Job(req, model, ids, budget, asyncio.get_running_loop(), constraint_factory=factory)
        scheduler.submit(job)
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + f"{started:x}{job.id:06d}"
        created = int(time.time())

        def observe(what, n_new):
            if what == "first":
                metrics.first_token.labels(endpoint).observe(time.time() - t0)
                return
            metrics.latency.labels(endpoint).observe(time.time() - t0)
            metrics.prompt_tokens.labels(req.model).inc(job.prompt_tokens)
            metrics.generation_tokens.labels(req.model).inc(n_new)

        if req.stream:
            return StreamingResponse(
                _stream(job, rid, created, observe),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        events = await _wait_done(job, request)
        if events is None:  # the client is gone; nobody reads this
            return JSONResponse({}, status_code=499)
        if events[0][0] == "error":
            return error_response(events[0][1])
        observe("done", sum(e[3] for e in events))
        return await run_in_threadpool(_whole, job, rid, created, events)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, parse_chat, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_completion, "/v1/completions")

    @app.get("/")
    async def chat_page():
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
