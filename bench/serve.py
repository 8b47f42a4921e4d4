"""Benchmark: llm/predict/server.py under 32 concurrent clients vs the same requests one at a time.

    .venv/bin/python -m bench.serve [--model build/tiny-llama] [--clients 32] [--rounds 2] [--max_tokens 32]
                                    [--deadline 300]
    .venv/bin/python -m bench.serve --compare_batching   # --batching static vs continuous, mixed lengths
    .venv/bin/python -m bench.serve --decode   # decode tokens/s on a ~0.5B model vs bandwidth and transformers

1. Starts the server in its own process through the benchmarks' harness (``harness.Server``: ready at
   its ``[serve] ready on URL`` line, peak RSS read the harness's way) on a free loopback port
   (``--port 0``) with the model (the tiny demo model by default, built if absent).
2. Sends ``clients x rounds`` greedy chat requests (distinct prompts, ``max_tokens`` each) ONE AT
   A TIME, then the same requests from ``clients`` concurrent clients (each client sends its
   ``rounds`` requests back to back).  Each request has a timeout and the whole run a deadline,
   so it always stops by itself.
3. Reports errors (any non-200 or a concurrent answer that differs from the sequential one --
   greedy decoding must not depend on the batch), throughput (requests/s, tokens/s) of both
   ways, the speed-up, p50/p95 latency, and the server's batch count.
4. Sends the malformed requests of ``serve.process.malformed_requests`` (bad JSON, unknown
   model, negative max_tokens, a 1 MB prompt, ...): each must get a 4xx OpenAI-style JSON error,
   and the server must still answer afterwards.
5. Stops the server with SIGTERM (it must exit 0) and prints its peak RSS.  Exit code 0 only if every
   check passed.
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import sys
import time
import urllib.request

if __package__ in (None, ""):  # run as a file, not with -m: make the repository root (the package's parent) importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import harness as h  # noqa: E402
from paddlenlp_ext.serve.process import READY, malformed_requests, post  # noqa: E402

ROOT = h.ROOT

WORDS = ["dress", "shirt", "skirt", "coat", "jeans", "boots", "scarf", "hat"]
COLORS = ["blue", "red", "black", "white"]


def server(args, name="server"):
    """``llm/predict/server.py`` on a free loopback port with ``args``, through the harness (a
    :class:`bench.harness.Server`: ``.ready.group(1)`` is its URL, ``.stop()`` its Run with the peak RSS)."""
    env = h.clean_env(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    return h.Server(h.cli("llm/predict/server.py", "--port", "0", *args), ready=READY, name=name, env=env)


def stopped(srv) -> int:
    """SIGTERM the server, wait for its drain, print its peak RSS; its exit code."""
    r = srv.stop()
    print(f"SIGTERM: exit code {r.returncode}; server peak RSS {r.peak_rss_bytes / h.MiB:.0f} MiB")
    return r.returncode


def prompts(n):
    return [f"type#{WORDS[i % len(WORDS)]}*color#{COLORS[(i // len(WORDS)) % len(COLORS)]}*n#{i}" for i in range(n)]


def percentile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100.0 * len(s) + 0.5)) - 1))]


def one(url, model, text, max_tokens, timeout):
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}
    t0 = time.time()
    try:
        status, r = post(url + "/v1/chat/completions", body, timeout=timeout)
    except OSError as e:  # timeout, reset: counted as an error
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.time() - t0}
    if status != 200:
        return {"ok": False, "error": f"{status}: {r}", "seconds": time.time() - t0}
    return {
        "ok": True,
        "text": r["choices"][0]["message"]["content"],
        "tokens": r["usage"]["completion_tokens"],
        "seconds": time.time() - t0,
    }


def run_sequential(url, model, texts, a, deadline):
    out = []
    for t in texts:
        if time.time() > deadline:
            out.append({"ok": False, "error": "deadline", "seconds": 0.0})
            continue
        out.append(one(url, model, t, a.max_tokens, a.timeout))
    return out


def run_concurrent(url, model, texts, a, deadline):
    per_client = [texts[c :: a.clients] for c in range(a.clients)]

    def client(mine):
        return [
            one(url, model, t, a.max_tokens, a.timeout)
            if time.time() < deadline
            else {"ok": False, "error": "deadline", "seconds": 0.0}
            for t in mine
        ]

    with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
        results = list(pool.map(client, per_client))
    out = [None] * len(texts)
    for c, rs in enumerate(results):
        for k, r in enumerate(rs):
            out[c + k * a.clients] = r
    return out


def summary(name, results, seconds):
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    lat = [r["seconds"] for r in ok] or [0.0]
    row = {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "seconds": round(seconds, 2),
        "req_per_s": round(len(ok) / seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "p50_s": round(percentile(lat, 50), 3),
        "p95_s": round(percentile(lat, 95), 3),
    }
    print(
        f"{name:<12} {row['requests']:>8} {row['errors']:>6} {row['seconds']:>8.2f} {row['req_per_s']:>8.2f} "
        f"{row['tokens_per_s']:>9.1f} {row['p50_s']:>7.3f} {row['p95_s']:>7.3f}"
    )
    return row


def check_refusals(url, model):
    bad = []
    for what, path, body in malformed_requests(model):
        try:
            status, err = post(url + path, body, timeout=60)
        except OSError as e:
            bad.append(f"{what}: {type(e).__name__}: {e}")
            continue
        fine = (
            400 <= status < 500
            and isinstance(err, dict)
            and set(err.get("error", {})) >= {"message", "type", "param", "code"}
        )
        print(f"  {status}  {what:<32} {err.get('error', {}).get('code') if isinstance(err, dict) else err}")
        if not fine:
            bad.append(f"{what}: {status} {err}")
    return bad


def mixed_workload(n):
    """(prompt, max_tokens) pairs of mixed prompt and answer lengths (1-12 words, 8-128 tokens)."""
    budgets = [8, 128, 16, 64, 32, 96, 8, 48]
    return [
        (" ".join([WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 12)]) + f"*n#{i}", budgets[i % len(budgets)])
        for i in range(n)
    ]


def server_args(a) -> list:
    """The server's arguments of every run: the model served as "bench", max_length 256, a batch of
    ``a.clients`` and a queue of 4 x ``a.clients``."""
    return h.flags(
        model_name_or_path=a.model,
        served_model_name="bench",
        max_length=256,
        max_batch_size=a.clients,
        max_queue=4 * a.clients,
    )


def compare_batching(a):
    """The same mixed workload from ``a.clients`` concurrent clients against a --batching static and a
    --batching continuous server (both started once), in interleaved rounds (static, continuous, static, ...;
    ``a.repeats`` each) so the shared machine's other load spreads over both: throughput of each round, the
    median ratio, the load average at each round; every answer must be the same in every round."""
    work = mixed_workload(a.clients * a.rounds)
    rows, texts = {"static": [], "continuous": []}, {}
    servers = {}
    with contextlib.ExitStack() as stack:
        for mode in rows:
            servers[mode] = stack.enter_context(server(server_args(a) + ["--batching", mode], name=f"{mode} server"))
            one(servers[mode].ready.group(1), "bench", "warm-up", 4, a.timeout)
        per_client = [work[c :: a.clients] for c in range(a.clients)]
        for r in range(a.repeats):
            for mode in rows:
                url = servers[mode].ready.group(1)

                def client(mine, url=url):
                    return [one(url, "bench", t, m, a.timeout) for t, m in mine]

                load = os.getloadavg()[0]
                t0 = time.time()
                with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
                    results = [x for rs in pool.map(client, per_client) for x in rs]
                row = summary(f"{mode} #{r + 1}", results, time.time() - t0)
                print(f"{'':<12} load average (1 min) before the round: {load:.1f}")
                rows[mode].append(row)
                texts.setdefault(mode, [x.get("text") for x in results])
                if [x.get("text") for x in results] != texts[mode]:
                    rows[mode][-1]["errors"] += 1  # greedy answers must not depend on the round
        for mode in rows:
            stopped(servers[mode])
    ratios = [c["tokens_per_s"] / max(s["tokens_per_s"], 1e-9) for s, c in zip(rows["static"], rows["continuous"])]
    differ = sum(x != y for x, y in zip(texts["static"], texts["continuous"]))
    med = h.median(ratios)
    print(
        f"continuous / static throughput per round: {', '.join(f'{x:.2f}x' for x in ratios)}; median {med:.2f}x "
        f"(target >= 1.5x: {h.verdict(med, 1.5, at_least=True)}); answers differing: {differ}"
    )
    errors = sum(x["errors"] for rs in rows.values() for x in rs)
    return 0 if differ == 0 and not errors else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "build", "tiny-llama"))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="requests per client")
    p.add_argument("--max_tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds for the whole benchmark")
    p.add_argument("--repeats", type=int, default=2, help="--compare_batching: interleaved rounds of each mode")
    p.add_argument(
        "--compare_batching",
        action="store_true",
        help="only: --batching static vs continuous on a "
        "mixed workload (prompts of 1-12 words, max_tokens 8-128) from --clients concurrent clients",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="only: decode tokens/s at batch 1 and 32 on a ~0.5B random "
        "Llama, as a fraction of the memory-bandwidth limit and against transformers' generate "
        "(bench/serve_decode.py; --repeats interleaved rounds)",
    )
    a = p.parse_args()
    if a.decode:
        from bench import serve_decode

        return serve_decode.main(["--repeats", str(a.repeats)])
    if a.model == os.path.join(ROOT, "build", "tiny-llama"):
        from paddlenlp_ext.models.tiny import ensure_tiny_model

        ensure_tiny_model(a.model, os.path.join(ROOT, "llm", "data", "advertise"))
    if a.compare_batching:
        print(
            f"{'':<12} {'requests':>8} {'errors':>6} {'seconds':>8} {'req/s':>8} {'tokens/s':>9} {'p50 s':>7} "
            f"{'p95 s':>7}"
        )
        return compare_batching(a)
    deadline = time.time() + a.deadline
    texts = prompts(a.clients * a.rounds)
    problems = []
    with server(server_args(a)) as srv:
        url = srv.ready.group(1)
        print(f"server: {url}  model: {a.model}  requests: {len(texts)} (greedy, max_tokens {a.max_tokens})")
        one(url, "bench", "warm-up", 4, a.timeout)
        print(
            f"{'':<12} {'requests':>8} {'errors':>6} {'seconds':>8} {'req/s':>8} {'tokens/s':>9} {'p50 s':>7} "
            f"{'p95 s':>7}"
        )
        t0 = time.time()
        seq = run_sequential(url, "bench", texts, a, deadline)
        s_row = summary("one-by-one", seq, time.time() - t0)
        before = json.load(urllib.request.urlopen(url + "/health"))
        t0 = time.time()
        con = run_concurrent(url, "bench", texts, a, deadline)
        c_row = summary(f"{a.clients} clients", con, time.time() - t0)
        after = json.load(urllib.request.urlopen(url + "/health"))
        differ = sum(1 for x, y in zip(seq, con) if x["ok"] and y["ok"] and x["text"] != y["text"])
        speedup = c_row["req_per_s"] / max(s_row["req_per_s"], 1e-9)
        print(
            f"speed-up: {speedup:.2f}x; concurrent requests ran in {after['batches'] - before['batches']} "
            f"batch(es) (largest {after['largest_batch']}); answers differing from one-by-one: {differ}"
        )
        errors = s_row["errors"] + c_row["errors"]
        if errors:
            problems.append(
                f"{errors} request(s) failed: " + "; ".join(r["error"] for r in seq + con if not r["ok"])[:500]
            )
        if differ:
            problems.append(f"{differ} concurrent answer(s) differ from the same request alone")
        if speedup < 2.0:
            problems.append(f"concurrent throughput is only {speedup:.2f}x one-by-one (want >= 2x)")
        print("malformed requests:")
        problems += check_refusals(url, "bench")
        alive = one(url, "bench", texts[0], a.max_tokens, a.timeout)
        print(f"after them the server answers: {alive['ok'] and alive['text'] == seq[0].get('text')}")
        if not (alive["ok"] and alive["text"] == seq[0].get("text")):
            problems.append("the server does not answer (or answers differently) after the malformed requests")
        code = stopped(srv)
        if code != 0:
            problems.append(f"the server exited {code} on SIGTERM")
    print("result: " + ("OK" if not problems else "FAILED\n  " + "\n  ".join(problems)))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
