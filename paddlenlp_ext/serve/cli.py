"""``llm/predict/server.py``: flags, checks before anything loads (exit 2), then uvicorn until SIGTERM.

Order: flags and every model/adapter directory checked (the predictor's checks, no paddle) ->
the port bound (a taken port fails before minutes of loading) -> the models loaded on the
generation thread -> ``[serve] ready on http://HOST:PORT`` -> requests.  SIGTERM / SIGINT:
uvicorn stops accepting connections and waits for the requests in flight (queued ones
included) up to ``--drain_timeout`` seconds; then the generation thread finishes and the
process exits 0.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from typing import List, Optional

from ..predict.inputs import PredictInputError
from ..predict.options import PredictOptions, add_generation_flags

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="OpenAI-compatible server + chat page over a (fine-tuned) model. "
        "The decoding flags apply to requests that give neither temperature "
        "nor top_p. See docs/serve.md."
    )
    p.add_argument("--model_name_or_path", required=True, help="local base model directory (as for the predictor)")
    p.add_argument("--served_model_name", default=None, help="the base's model name (default: its directory name)")
    p.add_argument(
        "--lora_path",
        "--prefix_path",
        dest="lora_path",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve base + this adapter (any --lora_path of the predictor) as model NAME; repeat for several adapters",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on the ready line)")
    p.add_argument("--max_batch_size", type=int, default=16, help="requests generated together at most")
    p.add_argument("--max_queue", type=int, default=64, help="requests waiting beyond this get 429")
    p.add_argument(
        "--batch_wait_ms",
        type=float,
        default=10.0,
        help="how long the first waiting request waits for others to join its batch",
    )
    p.add_argument(
        "--drain_timeout",
        type=float,
        default=300.0,
        help="on SIGTERM, seconds to wait for requests in flight before exiting",
    )
    p.add_argument(
        "--batching",
        choices=["static", "continuous"],
        default="static",
        help="static: a batch runs to its longest row; continuous: requests join the running batch at "
        "the next decode step and finished rows leave at once (docs/serve.md)",
    )
    p.add_argument(
        "--api_key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and the tokenizer "
        "routes (401 without it; as vLLM's --api_key); the chat page asks for it once",
    )
    p.add_argument(
        "--max_loras",
        type=int,
        default=4,
        help="distinct LoRA adapters in one batch at most (as "
        "vLLM's --max_loras); plain LoRA adapters are applied per row on the one base (docs/serve.md)",
    )
    p.add_argument(
        "--allow_runtime_lora_updating",
        action="store_true",
        help="enable POST /v1/load_lora_adapter "
        "and /v1/unload_lora_adapter (vLLM's shapes; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    add_generation_flags(p)  # the predictor's: --max_length, decoding, --dtype, --device, --chat_template
    return p


def _problems(a: argparse.Namespace) -> List[str]:
    out = []
    for name, ok, rule in (
        ("port", 0 <= a.port <= 65535, "in [0, 65535]"),
        ("max_batch_size", a.max_batch_size >= 1, "at least 1"),
        ("max_queue", a.max_queue >= 1, "at least 1"),
        ("batch_wait_ms", 0 <= a.batch_wait_ms <= 10000, "in [0, 10000]"),
        ("drain_timeout", a.drain_timeout > 0, "greater than 0"),
        ("max_loras", a.max_loras >= 1, "at least 1"),
        (
            "api_key",
            a.api_key is None or (a.api_key.strip() and a.api_key.isprintable()),
            "a non-empty printable string",
        ),
    ):
        if not ok:
            out.append(f"--{name} {getattr(a, name)}: must be {rule}")
    if a.allow_runtime_lora_updating and a.batching == "continuous":
        out.append("--allow_runtime_lora_updating works with --batching static only (the default); drop one of them")
    return out


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: Optional[List[str]] = None) -> int:
    from .models import default_sampling, load_models, plan_models

    parser = build_parser()
    a = parser.parse_args(argv)
    base = PredictOptions(
        model_name_or_path=a.model_name_or_path,
        max_length=a.max_length,
        decode_strategy=a.decode_strategy,
        top_k=a.top_k,
        top_p=a.top_p,
        temperature=a.temperature,
        repetition_penalty=a.repetition_penalty,
        dtype=a.dtype,
        device=a.device,
        chat_template=a.chat_template,
    )
    models, problems = plan_models(base, a.served_model_name, a.lora_path)
    problems = list(dict.fromkeys(_problems(a) + problems))
    if problems:
        print(parser.format_usage(), end="", file=sys.stderr)
        return fail("\n  ".join(["bad arguments (see --help and docs/serve.md):"] + problems))
    try:
        sock = bind(a.host, a.port)
    except OSError as e:
        return fail(
            f"--host {a.host} --port {a.port}: cannot listen there ({e.strerror}); pick another --port "
            "(0 = any free port)"
        )
    from ..predict.session import library_warnings_off

    with library_warnings_off():
        return _serve(a, models, sock, default_sampling(models[0].options), load_models)


def _serve(a, models, sock, default, load_models) -> int:
    import uvicorn

    from .app import build_app
    from .engine import Scheduler

    def log_batch(info):
        print(
            f"[serve] batch: {info['rows']} request(s) for {info['model']}, {info['new_tokens']} new tokens in "
            f"{info['seconds']:.2f}s" + (f", {info['cancelled']} cancelled" if info["cancelled"] else ""),
            file=sys.stderr,
            flush=True,
        )

    scheduler = Scheduler(
        models,
        a.max_batch_size,
        a.max_queue,
        a.batch_wait_ms / 1000.0,
        on_batch=log_batch,
        continuous=a.batching == "continuous",
        max_loras=a.max_loras,
    )
    scheduler.start(lambda: load_models(models))
    scheduler.ready.wait()
    if scheduler.load_error is not None:
        sock.close()
        if isinstance(scheduler.load_error, PredictInputError):
            return fail(str(scheduler.load_error))
        raise scheduler.load_error
    for m in models:
        print(f"[serve] model {m.name}: {m.session.description}", file=sys.stderr)
    app = build_app(models, scheduler, default, api_key=a.api_key, lora_updating=a.allow_runtime_lora_updating)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=a.drain_timeout, access_log=False)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"[serve] ready on http://{shown}:{port} (models: {', '.join(m.name for m in models)}; chat page: "
        f"http://{shown}:{port}/)",
        file=sys.stderr,
        flush=True,
    )
    stop_signals = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        # uvicorn drains, then re-raises the signal it caught to the handler found before it started: this one
        signal.signal(sig, lambda signum, frame: stop_signals.append(signum))
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.close(timeout=a.drain_timeout)
    why = f" on {signal.Signals(stop_signals[0]).name}" if stop_signals else ""
    print(
        f"[serve] stopped{why} after {scheduler.stats['rows']} request(s) in {scheduler.stats['batches']} batch(es)",
        file=sys.stderr,
        flush=True,
    )
    return 0
