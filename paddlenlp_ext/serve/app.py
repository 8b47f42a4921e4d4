"""The HTTP side: FastAPI routes in OpenAI's shapes, server-sent events, errors, the chat page.

Every failure a client can cause is an :class:`~.protocol.ApiError` rendered as
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status -- bad JSON, a body over
``MAX_BODY_BYTES``, unknown routes and methods included; nothing a request sends reaches the
worker thread unchecked.  Streams are ``text/event-stream`` chunks ending ``data: [DONE]``; a
client that disconnects (the chat page's stop button aborts its fetch) cancels its row.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, AsyncIterator, Dict, List

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

from .engine import Job, Scheduler
from .models import ServedModel, model_cards, prompt_ids
from .protocol import ApiError, GenRequest, Sampling, parse_chat, parse_completion

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
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes ({size} read); send less "
                       "(the prompt is limited by the model's context length anyway)", None, "request_too_large")
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 ({e.reason} at byte {e.start})", None,
                       "invalid_json") from e
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                       None, "invalid_json") from e


def _chunk(req: GenRequest, rid: str, created: int, delta: Dict[str, Any] = None, finish=None) -> Dict[str, Any]:
    if req.kind == "chat":
        choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": [choice]}
    choice = {"index": 0, "text": (delta or {}).get("content", ""), "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": [choice]}


def _usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(job: Job, rid: str, created: int) -> AsyncIterator[str]:
    req = job.req
    try:
        if req.kind == "chat":
            yield _sse(_chunk(req, rid, created, {"role": "assistant", "content": ""}))
        while True:
            event = await job.queue.get()
            if event[0] == "delta":
                yield _sse(_chunk(req, rid, created, {"content": event[1]}))
            elif event[0] == "error":
                yield _sse(event[1].body())
                break
            else:
                _, finish, n_prompt, n_new, _ = event
                yield _sse(_chunk(req, rid, created, {}, finish))
                if req.include_usage:
                    yield _sse({"id": rid, "object": _chunk(req, rid, created)["object"], "created": created,
                                "model": req.model, "choices": [], "usage": _usage(n_prompt, n_new)})
                break
        yield "data: [DONE]\n\n"
    finally:
        # normal end, or the client went away (the response task is cancelled): stop generating for it
        if not job.finished:
            job.cancel()


async def _wait_done(job: Job, request: Request):
    """The final event of a non-streaming request; cancels the job if its client disconnects first."""
    getter = asyncio.ensure_future(_final_event(job))
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


async def _final_event(job: Job):
    while True:
        event = await job.queue.get()
        if event[0] != "delta":
            return event


def _whole(job: Job, rid: str, created: int, event) -> Dict[str, Any]:
    _, finish, n_prompt, n_new, text = event
    req = job.req
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
            "usage": _usage(n_prompt, n_new)}


def build_app(models: List[ServedModel], scheduler: Scheduler, default: Sampling) -> FastAPI:
    app = FastAPI(title="paddlenlp_ext OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None)
    by_name = {m.name: m for m in models}
    names = [m.name for m in models]
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = {404: f"no route {request.url.path}; endpoints: GET /v1/models, POST /v1/chat/completions, "
                     "POST /v1/completions, GET /",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(ApiError(e.status_code, what, None, "not_found" if e.status_code == 404 else None))

    @app.exception_handler(500)
    async def _internal(request: Request, e: Exception):
        # a bug, not the client's fault: still an OpenAI-style body (uvicorn logs the traceback)
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal"))

    @app.get("/v1/models")
    async def list_models():
        return model_cards(models, started)

    @app.get("/health")
    async def health():
        return {"status": "ok", "queue": len(scheduler.waiting), **scheduler.stats}

    async def generate(request: Request, parse):
        body = await read_json(request)
        req = parse(body, names, default)
        model = by_name[req.model]
        ids = await run_in_threadpool(prompt_ids, req, model)  # tokenizing a long prompt does not block the loop
        max_new = req.max_tokens if req.max_tokens is not None else model.options.max_length - len(ids)
        job = Job(req, model, ids, max_new, asyncio.get_running_loop())
        scheduler.submit(job)
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + f"{started:x}{job.id:06d}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_stream(job, rid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        event = await _wait_done(job, request)
        if event is None:  # the client is gone; nobody reads this
            return JSONResponse({}, status_code=499)
        if event[0] == "error":
            return error_response(event[1])
        return _whole(job, rid, created, event)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_completion)

    @app.get("/")
    async def chat_page():
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
