"""``GET /metrics``: the server's counters in Prometheus' text format (prometheus-client).

Names follow vLLM's where one exists (``vllm:`` prefix replaced by ``paddlenlp_ext_serve_``):
requests by endpoint and status, prompt and generated tokens, waiting and running rows, batch
sizes, and latency histograms (end to end, time to first token).  Each app has its own registry,
so several servers in one process (tests) never share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "paddlenlp_ext_serve_"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "prompt tokens of finished requests", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "generated tokens of finished requests", ["model"], registry=r
        )
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "requests waiting for a batch", registry=r)
        self.running = Gauge(PREFIX + "num_rows_running", "rows (choices) generating now", registry=r)
        self.batch_rows = Histogram(
            PREFIX + "batch_size_rows", "rows per generation batch", buckets=BATCH_BUCKETS, registry=r
        )
        self.latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "request latency, arrival to last token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "arrival to the first streamed text",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def render(self, waiting: int, running: int) -> bytes:
        self.waiting.set(waiting)
        self.running.set(running)
        return generate_latest(self.registry)
