"""Runtime LoRA updating: vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

Only with ``--allow_runtime_lora_updating`` (vLLM: the environment variable
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); without it the routes do not exist (404).  Request shapes are
vLLM's: ``{"lora_name": NAME, "lora_path": DIR}`` and ``{"lora_name": NAME}``; success is 200 with a
plain-text line, as vLLM answers.  An adapter loaded at runtime is applied per row on the shared base
(``serve.multilora``), so only plain LoRA adapters can be loaded this way; others are served by
naming them with ``--lora_path`` at start (a merged copy).
"""

from __future__ import annotations

import dataclasses
from typing import List

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from ..predict.inputs import PredictInputError
from .models import NAME_RE, ServedModel, add_row_adapter
from .protocol import ApiError


def _name(body, key: str) -> str:
    v = body.get(key) if isinstance(body, dict) else None
    if not isinstance(v, str) or not v:
        raise ApiError(400, f"{key} is required (a string)", key, "invalid_value")
    return v


def add_lora_routes(app: FastAPI, models: List[ServedModel], by_name, names: List[str], scheduler, read_json) -> None:
    base = models[0]

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        from ..predict.options import check_options
        from ..predict.lora_rows import per_row_refusal

        body = await read_json(request)
        name, path = _name(body, "lora_name"), _name(body, "lora_path")
        if name in by_name:
            raise ApiError(
                400, f"the model name {name!r} is already served; unload it first", "lora_name", "invalid_value"
            )
        if not NAME_RE.match(name):
            raise ApiError(
                400,
                "lora_name: use letters, digits and . _ : / - (at most 128 characters)",
                "lora_name",
                "invalid_value",
            )
        opts, problems, _ = check_options(dataclasses.replace(base.options, lora_path=path))
        if problems:
            raise ApiError(400, "; ".join(problems), "lora_path", "invalid_value")
        why = await run_in_threadpool(per_row_refusal, path)
        if why is not None or hasattr(base.session.model, "prefix_config"):
            raise ApiError(
                400,
                f"lora_path {path}: only plain LoRA adapters can be loaded at runtime (applied per "
                f"row on the shared base); this is {why or 'on a prefix-tuning base'}. Serve it with "
                "--lora_path NAME=DIR at start",
                "lora_path",
                "invalid_value",
            )
        m = ServedModel(name=name, options=opts, parent=base.name)
        try:
            await run_in_threadpool(add_row_adapter, base, m)
        except PredictInputError as e:
            raise ApiError(400, str(e), "lora_path", "invalid_value") from e
        models.append(m)
        by_name[name] = m
        names.append(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await read_json(request)
        name = _name(body, "lora_name")
        m = by_name.get(name)
        if m is None or m.slot is None:
            raise ApiError(404, f"no per-row LoRA adapter named {name!r} is loaded", "lora_name", "model_not_found")
        with scheduler.cond:
            if any(j.model is m for j in scheduler.waiting):
                raise ApiError(
                    409,
                    f"requests for {name!r} are waiting; unload it when they are answered",
                    "lora_name",
                    "adapter_busy",
                )
            del by_name[name]  # no new request can name it from now on
            names.remove(name)
            models.remove(m)
        await run_in_threadpool(m.table.remove, name)  # waits for a running batch (the table's lock)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
