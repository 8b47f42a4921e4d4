"""``llm/tools/eval.py``: lm-evaluation-harness against our server, in one command (docs/eval.md).

    start llm/predict/server.py on a free loopback port (a fresh random --api_key, so nothing else on
    the machine can use it) -> run ``python -m lm_eval run --model local-completions`` (or
    ``local-chat-completions``) with the server's URL, the remote tokenizer (our /tokenize) and token-id
    requests -> copy lm-eval's results JSON to ``OUTPUT_DIR/results.json`` -> stop the server (SIGTERM).

lm-eval runs in its own process with ``HF_DATASETS_OFFLINE`` left as the caller set it; local task
files go through ``--include_path``.  Exit codes: lm-eval's (0 ok), 2 bad flags (before anything
starts), 1 the server did not start.  No paddle is imported here.
"""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import shutil
import subprocess
import sys
from typing import List, Optional

from .process import ServerProcess

MODELS = {"local-completions": "/v1/completions", "local-chat-completions": "/v1/chat/completions"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Run lm-eval tasks against llm/predict/server.py serving a base "
        "model or base + adapter. See docs/eval.md.",
        allow_abbrev=False,
    )
    p.add_argument("--model_name_or_path", required=True, help="the base model directory")
    p.add_argument("--lora_path", default=None, help="evaluate base + this adapter (any the predictor takes)")
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    p.add_argument("--output_dir", required=True, help="lm-eval's output; results.json is copied to its top")
    p.add_argument("--include_path", default=None, help="a directory of your own lm-eval task YAML files")
    p.add_argument(
        "--model",
        default="local-completions",
        choices=sorted(MODELS),
        help="lm-eval's API model: local-completions (log-likelihood and generate-until) or "
        "local-chat-completions (generate-until through the chat template)",
    )
    p.add_argument("--batch_size", type=int, default=8, help="prompts per request (local-completions)")
    p.add_argument("--max_length", type=int, default=2048, help="the server's context (prompt + answer)")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="examples per task (a count, or a fraction < 1)")
    p.add_argument(
        "--apply_chat_template",
        action="store_true",
        help="lm-eval renders chat messages "
        "(needed by local-chat-completions; the server applies the model's template)",
    )
    p.add_argument("--log_samples", action="store_true", help="lm-eval also writes every request and response")
    p.add_argument("--gen_kwargs", default=None, help="lm-eval's --gen_kwargs, e.g. max_gen_toks=64")
    p.add_argument(
        "--server_arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for llm/predict/server.py (repeat), e.g. --server_arg=--dtype=float32",
    )
    return p


def problems(a: argparse.Namespace) -> List[str]:
    out = []
    if not os.path.isdir(a.model_name_or_path):
        out.append(f"--model_name_or_path {a.model_name_or_path}: no such directory")
    if a.lora_path is not None and not os.path.isdir(a.lora_path):
        out.append(f"--lora_path {a.lora_path}: no such directory")
    if a.include_path is not None and not os.path.isdir(a.include_path):
        out.append(f"--include_path {a.include_path}: no such directory (give the folder of your task YAML files)")
    if a.batch_size < 1:
        out.append(f"--batch_size {a.batch_size}: must be at least 1")
    if a.model == "local-chat-completions" and not a.apply_chat_template:
        out.append("--model local-chat-completions sends chat messages: add --apply_chat_template")
    return out


def lm_eval_command(a: argparse.Namespace, url: str, served: str, key: str) -> List[str]:
    """The ``python -m lm_eval run`` command line for a server at ``url`` serving ``served``."""
    margs = [
        f"model={served}",
        f"base_url={url}{MODELS[a.model]}",
        "num_concurrent=1",
        "max_retries=1",
        f"max_length={a.max_length}",
        f"auth_token={key}",
        "timeout=600",
    ]
    if a.model == "local-completions":
        margs += ["tokenizer_backend=remote", "tokenized_requests=True"]
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        a.model,
        "--model_args",
        ",".join(margs),
        "--tasks",
        a.tasks,
        "--output_path",
        a.output_dir,
        "--batch_size",
        str(a.batch_size if a.model == "local-completions" else 1),
    ]
    for flag, value in (
        ("--include_path", a.include_path),
        ("--num_fewshot", a.num_fewshot),
        ("--limit", a.limit),
        ("--gen_kwargs", a.gen_kwargs),
    ):
        if value is not None:
            cmd += [flag, str(int(value) if flag == "--limit" and value >= 1 else value)]
    if a.apply_chat_template:
        cmd.append("--apply_chat_template")
    if a.log_samples:
        cmd.append("--log_samples")
    return cmd


def newest_results(output_dir: str) -> Optional[str]:
    found = glob.glob(os.path.join(output_dir, "**", "results_*.json"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    bad = problems(a)
    if bad:
        print(
            parser.format_usage() + "error: " + "\n  ".join(["bad arguments (see docs/eval.md):"] + bad),
            file=sys.stderr,
        )
        return 2
    os.makedirs(a.output_dir, exist_ok=True)
    key = secrets.token_hex(16)
    served = "adapter" if a.lora_path else "base"
    args = [
        "--host",
        "127.0.0.1",
        "--model_name_or_path",
        a.model_name_or_path,
        "--served_model_name",
        "base",
        "--max_length",
        str(a.max_length),
        "--api_key",
        key,
        "--max_batch_size",
        str(max(a.batch_size, 1)),
    ]
    if a.lora_path:
        args += ["--lora_path", f"adapter={a.lora_path}"]
    try:
        server = ServerProcess(args + list(a.server_arg)).start()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        print(
            f"[eval] server on {server.url} ({served}); running lm-eval {a.model} on {a.tasks}",
            file=sys.stderr,
            flush=True,
        )
        env = dict(os.environ, OPENAI_API_KEY=key, TOKENIZERS_PARALLELISM="false")
        rc = subprocess.call(lm_eval_command(a, server.url, served, key), env=env)
    finally:
        server.terminate()
    results = newest_results(a.output_dir)
    if rc == 0 and results:
        shutil.copyfile(results, os.path.join(a.output_dir, "results.json"))
        print(f"[eval] results: {os.path.join(a.output_dir, 'results.json')} (lm-eval's {results})", file=sys.stderr)
    return rc
