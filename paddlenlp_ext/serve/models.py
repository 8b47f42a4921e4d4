"""The served models: one base and its adapters, each under its own name, loaded by the predictor's code.

``--lora_path NAME=DIR`` (repeatable) serves the base + that adapter as model ``NAME``; the base
is served as ``--served_model_name`` (default: its directory's name).  Each name gets a
``predict.session.Session`` from ``predict.session.load_session`` -- the loader of
``llm/predict/predictor.py``, so the server takes every model and adapter the predictor takes
(LoRA family, VeRA, LoKr, QLoRA, PaddleNLP's LoRA, prefix tuning).  An adapter is merged into
its own copy of the base in memory, as the predictor merges it -- except plain LoRA adapters, which
are applied per row on the one base (``serve.multilora``): their requests share batches with the
base's and each other's, and memory is base + the adapters' matrices.

Prompts are built by ``predict.prompts.build_prompt`` (the predictor's and training's layout,
the chat template when the model has one), except that a conversation that does not fit is
refused (400) instead of truncated.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..predict.inputs import PredictInputError, PromptRecord
from ..predict.options import PredictOptions, check_options
from .protocol import ApiError, GenRequest, Sampling

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass
class ServedModel:
    name: str
    options: PredictOptions  # the predictor's options for this name (its --lora_path)
    parent: Optional[str] = None  # the base's served name, for an adapter
    session: Any = None  # predict.session.Session, once loaded
    table: Any = None  # serve.multilora.RowAdapters of the base when adapters are applied per row
    slot: Optional[int] = None  # this adapter's slot in ``table`` (per row); None = base or merged copy

    @property
    def group(self) -> str:
        """Requests of one group share a batch: a per-row adapter batches with its base."""
        return self.parent if self.slot is not None else self.name


def split_lora_arg(value: str) -> Tuple[str, str]:
    """``NAME=DIR`` -> (NAME, DIR); a bare ``DIR`` is named after its last folder.

    >>> split_lora_arg("sql=out/lora"), split_lora_arg("out/my-lora/")
    (('sql', 'out/lora'), ('my-lora', 'out/my-lora/'))
    """
    name, sep, path = value.partition("=")
    if sep and name and not os.path.exists(value):
        return name, path
    return os.path.basename(os.path.normpath(value)), value


def plan_models(
    base: PredictOptions, served_name: Optional[str], lora_args: List[str]
) -> Tuple[List[ServedModel], List[str]]:
    """(models, problems): every name and directory checked with the predictor's checks, before anything loads."""
    problems: List[str] = []
    name = served_name or os.path.basename(os.path.normpath(base.model_name_or_path))
    # the server answers one conversation per request: the predictor's chat mode
    opts, base_problems, _ = check_options(dataclasses.replace(base, chat=True, lora_path=None))
    problems += base_problems
    models = [ServedModel(name=name, options=opts)]
    for arg in lora_args:
        adapter_name, path = split_lora_arg(arg)
        o, p, _ = check_options(dataclasses.replace(base, chat=True, lora_path=path))
        problems += [f"--lora_path {arg}: {x}" if not x.startswith("--lora_path") else x for x in p]
        models.append(ServedModel(name=adapter_name, options=o, parent=name))
    seen = set()
    for m in models:
        if not NAME_RE.match(m.name):
            problems.append(f"model name {m.name!r}: use letters, digits and . _ : / - (at most 128 characters)")
        if m.name in seen:
            problems.append(f"model name {m.name!r} is served twice; name each adapter: --lora_path NAME=DIR")
        seen.add(m.name)
    return models, problems


def load_models(models: List[ServedModel], per_row: bool = True) -> None:
    """Load the tokenizer once and a session per name (the predictor's loaders); PredictInputError on bad input.

    With ``per_row``, plain LoRA adapters are applied per row on the one base (``serve.multilora``);
    other adapters get a merged copy of the base."""
    from ..predict.session import load_session, load_tokenizer

    tokenizer, use_template = load_tokenizer(models[0].options)
    base = models[0]
    base.session = load_session(base.options, tokenizer, use_template)
    for m in models[1:]:
        if per_row and not hasattr(base.session.model, "prefix_config"):
            from ..predict.lora_rows import per_row_refusal

            if per_row_refusal(m.options.lora_path) is None:
                add_row_adapter(base, m)
                continue
        m.session = load_session(m.options, tokenizer, use_template)


def add_row_adapter(base: ServedModel, m: ServedModel) -> None:
    """Apply ``m``'s LoRA per row on ``base``'s model (one copy of the base); PredictInputError when it does not fit."""
    from .multilora import RowAdapters

    if base.table is None:
        base.table = RowAdapters(base.session.model)
    path = m.options.lora_path
    cfg = base.table.add(m.name, path, base.options.model_name_or_path)
    m.parent, m.table, m.slot = base.name, base.table, base.table.slots[m.name]
    kind = cfg.method + ("+rslora" if cfg.rslora else "")
    m.session = dataclasses.replace(
        base.session,
        description=base.session.description.replace(
            "+ no adapter", f"+ {kind} adapter {path} (r={cfg.r}, applied per row on the shared base)"
        ),
    )


def default_sampling(o: PredictOptions) -> Sampling:
    """The server's decoding flags as the sampling of a request that gives neither temperature nor top_p."""
    return Sampling(greedy=o.greedy, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k)


def prompt_ids(req: GenRequest, model: ServedModel):
    """The request's prompt as token ids (chat: one list; completion: a list per prompt); ApiError 400 when
    one does not fit the context with room to answer, or names a token id the vocabulary does not have."""
    if req.kind == "completion":
        out = [_completion_ids(p, i, req, model) for i, p in enumerate(req.prompt)]
        for ids in out:
            _check_room(ids, req, model, "prompt")
        return out
    if req.messages is not None:
        ids = _tool_prompt_ids(req, model)
        _check_room(ids, req, model, "messages")
        return ids
    from ..predict.prompts import build_prompt, full_prompt_ids

    s, limit = model.session, model.options.max_length
    c = req.conversation
    rec = PromptRecord(src=c.src, history=c.history, system=c.system, origin="messages")
    try:
        # src_length = limit: nothing is cut unless the prompt alone fills the context (`truncated`);
        # max_length unbounded so build_prompt leaves the refusal to the checks below
        p = build_prompt(rec, s.tokenizer, limit, 2**62, s.use_template, s.jinja)
    except PredictInputError as e:  # the chat template refused the conversation
        raise ApiError(400, str(e), "messages", "invalid_value") from e
    ids = p.ids
    if c.system is not None and s.use_template and not s.jinja and not p.truncated:
        _refuse_dropped_system(rec, ids, s, limit)
    if p.truncated:
        ids = full_prompt_ids(rec, s.tokenizer, s.use_template, s.jinja)
    _check_room(ids, req, model, "messages")
    return ids


def _tool_prompt_ids(req: GenRequest, model: ServedModel) -> List[int]:
    """A conversation with tools / tool turns rendered by the model's jinja template with ``tools`` (as
    transformers' ``apply_chat_template(tools=..., add_generation_prompt=True)``, training's renderer)."""
    from ..data.chat_template import TemplateRenderError, render, special_tokens_of
    from ..data.tokenize import _encode
    from .tools import tool_style

    s = model.session
    if not s.jinja:
        raise ApiError(
            400,
            "tools, tool calls and tool results are rendered by the model's jinja chat template, and "
            "this model has none: start the server with --chat_template FILE.jinja (or add chat_template "
            "to the model's tokenizer_config.json)",
            "tools",
            "chat_template_required",
        )
    if req.tool_choice != "none" and tool_style(s.jinja) is None:
        raise ApiError(
            400,
            "this model's chat template writes no tool-call format the server can parse (Hermes/Qwen "
            '<tool_call> blocks or Llama 3 JSON); send tool_choice "none" or use such a template',
            "tools",
            "tool_format_unknown",
        )
    try:
        text = render(
            s.jinja,
            req.messages,
            req.tools if req.tool_choice != "none" else None,
            True,
            special_tokens_of(s.tokenizer),
        )
    except TemplateRenderError as e:
        raise ApiError(400, str(e), "messages", "invalid_value") from e
    return _encode(s.tokenizer, text)


def vocab_size(tokenizer) -> int:
    return len(tokenizer)


def _completion_ids(p, i: int, req: GenRequest, model: ServedModel) -> List[int]:
    tok = model.session.tokenizer
    if isinstance(p, str):
        return list(tok(p, return_attention_mask=False)["input_ids"])
    v = vocab_size(tok)
    bad_ids = [t for t in p if not 0 <= t < v]
    if bad_ids:
        where = "prompt" if len(req.prompt) == 1 else f"prompt[{i}]"
        raise ApiError(
            400,
            f"{where} has token id(s) {bad_ids[:5]} outside this model's vocabulary [0, {v})",
            where,
            "invalid_value",
        )
    return list(p)


def _check_room(ids: List[int], req: GenRequest, model: ServedModel, param: str) -> None:
    limit = model.options.max_length
    if len(ids) >= limit + (1 if req.max_tokens == 0 else 0):
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens (prompt + answer); the "
            f"{'messages are' if param == 'messages' else 'prompt is'} {len(ids)} tokens. Shorten it.",
            param,
            "context_length_exceeded",
        )
    room = limit - len(ids)
    if req.max_tokens is not None and req.max_tokens > room:
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens; you requested "
            f"{len(ids) + req.max_tokens} ({len(ids)} in the prompt, {req.max_tokens} for the answer). "
            f"Use max_tokens {room} or less.",
            "max_tokens",
            "context_length_exceeded",
        )


def _refuse_dropped_system(rec: PromptRecord, ids: List[int], session, limit: int) -> None:
    """400 when the prompt is the same without the system message: PaddleNLP's ``chat_template.json``
    has no system slot, so the message would be dropped and answering as if it had not been would be
    wrong.  (A jinja template renders the system message as transformers does: never refused.)"""
    from ..predict.prompts import build_prompt

    bare = build_prompt(dataclasses.replace(rec, system=None), session.tokenizer, limit, 2**62, True)
    if bare.ids == ids:
        raise ApiError(
            400,
            "this model's chat template (PaddleNLP's chat_template.json) has no system slot, so "
            "the system message would be dropped; leave it out, or put its text in the first user "
            "message",
            "messages[0]",
            "system_message_unsupported",
        )


def model_cards(models: List[ServedModel], created: int) -> Dict[str, Any]:
    """``GET /v1/models``: OpenAI's list, plus what each name is (base directory, adapter)."""
    return {
        "object": "list",
        "data": [
            {
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": "paddlenlp_ext",
                "root": m.options.lora_path or m.options.model_name_or_path,
                "parent": m.parent,
                "adapter": m.options.lora_path,
                "per_row": m.slot is not None,
                "max_model_len": m.options.max_length,
            }
            for m in models
        ],
    }
