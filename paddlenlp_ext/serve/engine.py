"""The scheduler: a bounded queue of requests, batched per model and sampling, generated on one thread.

One worker thread owns Paddle: it loads the models, then repeatedly takes the oldest waiting
request, waits ``batch_wait`` seconds for company, and runs every waiting request with the same
model and the same sampling (``Sampling.batch_key``) -- up to ``max_batch_size`` -- as ONE
left-padded ``predict.generate.generate_batch`` call with the KV cache.  Requests for another
adapter wait for the next batch, so an adapter's weights only ever see its own requests.

Each generated token goes to every row through :class:`BatchStreamer`: the row's text is
re-decoded, a :class:`~.textstream.TextAssembler` decides what can be sent, and the delta is
handed to the request's asyncio queue on the event loop.  A row ends at EOS, at its
``max_tokens``, at a stop sequence, or when its client went away (``Job.cancel``); when every
row of the batch has ended the streamer stops ``generate`` early (:class:`BatchDone`).

Waiting requests beyond ``max_queue`` are refused with 429; after ``close()`` new requests get
503 while everything already accepted is still generated (SIGTERM drains).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional

import numpy as np

from .protocol import ApiError, GenRequest
from .textstream import IncrementalDecoder, TextAssembler, first_stop

_log = logging.getLogger("paddlenlp_ext.serve")
_ids = itertools.count(1)


class Job:
    """One request on its way through the scheduler; events go to ``queue`` on the event loop:
    ``("delta", text)``, then ``("done", finish_reason, prompt_tokens, completion_tokens, full_text)``
    or ``("error", ApiError)``."""

    def __init__(self, req: GenRequest, model, prompt_ids: List[int], max_new_tokens: int,
                 loop: asyncio.AbstractEventLoop):
        self.id = next(_ids)
        self.req, self.model, self.prompt_ids, self.max_new_tokens = req, model, prompt_ids, max_new_tokens
        self.loop, self.queue = loop, asyncio.Queue()
        self.key = (model.name,) + req.sampling.batch_key(self.id)
        self.cancelled = threading.Event()
        self.finished = False

    def emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        """The client went away: stop generating for it (its row is dropped at the next token)."""
        self.cancelled.set()


class BatchDone(Exception):
    """Raised from the streamer to end ``generate`` once every row has ended (EOS, budget, stop, cancel)."""


class BatchStreamer:
    """PaddleNLP's streamer hook over a batch: ``put`` gets the next token of every row [B, 1]."""

    def __init__(self, jobs: List[Job], tokenizer, eos_ids: List[int]):
        self.jobs, self.tokenizer, self.eos_ids = jobs, tokenizer, set(eos_ids)
        self.rows = [IncrementalDecoder(self.decode) for _ in jobs]
        self.text = [TextAssembler(j.req.stop) for j in jobs]
        self.reason: List[Optional[str]] = [None] * len(jobs)

    @property
    def ids(self) -> List[List[int]]:
        return [r.ids for r in self.rows]

    def decode(self, ids: List[int]) -> str:
        # as the predictor decodes an answer: special tokens out, spaces as the tokenizer made them
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def put(self, value) -> None:
        tokens = np.asarray(value.numpy() if hasattr(value, "numpy") else value).reshape(-1)  # [B]
        for i, job in enumerate(self.jobs):
            if self.reason[i] is not None:
                continue
            if job.cancelled.is_set():
                self.reason[i] = "cancelled"
                continue
            t = int(tokens[i])
            if t in self.eos_ids:
                self.finish(i, "stop")
                continue
            if self.rows[i].add(t):
                delta, stopped = self.text[i].update(self.rows[i].text)
                if delta:
                    job.emit("delta", delta)
                if stopped:
                    self.finish(i, "stop")
                    continue
            if len(self.rows[i].ids) >= job.max_new_tokens:
                self.finish(i, "length")
        if all(r is not None for r in self.reason):
            raise BatchDone()

    def end(self) -> None:
        """generate() ran to the longest budget: every row has ended by now; close any that did not."""
        for i in range(len(self.jobs)):
            if self.reason[i] is None:
                self.finish(i, "length")

    def finish(self, i: int, reason: str) -> None:
        """End row i: the answer is the decoding of all its tokens (the predictor's), cut at a stop sequence."""
        full = self.decode(self.rows[i].ids)
        cut = first_stop(full, self.jobs[i].req.stop)
        answer = full if cut is None else full[:cut]
        delta, _ = self.text[i].update(full, final=True)
        if delta:
            self.jobs[i].emit("delta", delta)
        self.reason[i] = "stop" if cut is not None else reason
        self.jobs[i].finished = True
        self.jobs[i].emit("done", self.reason[i], len(self.jobs[i].prompt_ids), len(self.rows[i].ids), answer)


class Scheduler:
    def __init__(self, models, max_batch_size: int = 16, max_queue: int = 64, batch_wait: float = 0.01,
                 on_batch: Optional[Callable[[dict], None]] = None):
        self.models = {m.name: m for m in models}
        self.max_batch_size, self.max_queue, self.batch_wait = max_batch_size, max_queue, batch_wait
        self.on_batch = on_batch or (lambda info: None)
        self.waiting: Deque[Job] = deque()
        self.cond = threading.Condition()
        self.closing = False
        self.ready = threading.Event()
        self.load_error: Optional[BaseException] = None
        self.stats = {"batches": 0, "rows": 0, "largest_batch": 0, "running": 0}  # running: rows generating now
        self.thread = threading.Thread(target=self._main, name="paddle-generation", daemon=True)

    # ---------------------------------------------------------------- event-loop side
    def start(self, load: Callable[[], None]) -> None:
        """Start the worker: it runs ``load`` (the models, on the thread that will use Paddle), then serves."""
        self._load = load
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closing:
                raise ApiError(503, "the server is shutting down; retry on another instance", None, "shutting_down")
            if len(self.waiting) >= self.max_queue:
                raise ApiError(429, f"too many requests waiting ({self.max_queue}, --max_queue); retry shortly",
                               None, "queue_full")
            self.waiting.append(job)
            self.cond.notify()

    def close(self, timeout: Optional[float] = None) -> None:
        """Refuse new requests; the worker exits once everything accepted has been generated."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # ---------------------------------------------------------------- worker side
    def _main(self) -> None:
        try:
            self._load()
        except BaseException as e:  # handed to the main thread: reported (bad input, exit 2) or re-raised
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        while True:
            jobs = self._next_batch()
            if jobs is None:
                return
            self._run(jobs)

    def _next_batch(self) -> Optional[List[Job]]:
        with self.cond:
            while not self.waiting:
                if self.closing:
                    return None
                self.cond.wait()
        if self.batch_wait > 0:
            time.sleep(self.batch_wait)  # let concurrent requests join this batch
        with self.cond:
            key = self.waiting[0].key
            jobs = [j for j in self.waiting if j.key == key][:self.max_batch_size]
            for j in jobs:
                self.waiting.remove(j)
        return [j for j in jobs if not j.cancelled.is_set()] or []

    def _run(self, jobs: List[Job]) -> None:
        if not jobs:
            return
        from ..predict.generate import generate_batch
        from ..predict.prompts import Prompt

        model, s = jobs[0].model, jobs[0].model.session
        sampling = jobs[0].req.sampling
        o = dataclasses.replace(model.options, decode_strategy="greedy_search" if sampling.greedy else "sampling",
                                top_k=sampling.top_k, top_p=sampling.top_p, temperature=sampling.temperature)
        if sampling.seed is not None:
            import paddle

            paddle.seed(sampling.seed)
        streamer = BatchStreamer(jobs, s.tokenizer, s.eos_ids)
        t0 = time.time()
        self.stats["running"] = len(jobs)
        try:
            generate_batch(s.model, [Prompt(ids=j.prompt_ids, max_new_tokens=j.max_new_tokens) for j in jobs], o,
                           s.eos_ids, s.pad_id, streamer=streamer)
        except BatchDone:
            pass
        except Exception as e:  # reported to each request of this batch as a 500; the server goes on
            _log.exception("generation failed")
            for j in jobs:
                if not j.finished:
                    j.emit("error", ApiError(500, f"generation failed: {type(e).__name__}: {e}", None, "internal"))
            return
        finally:
            self.stats["running"] = 0
        streamer.end()
        self.stats["batches"] += 1
        self.stats["rows"] += len(jobs)
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(jobs))
        self.on_batch({"model": model.name, "rows": len(jobs), "seconds": time.time() - t0,
                       "new_tokens": sum(len(x) for x in streamer.ids),
                       "cancelled": sum(r == "cancelled" for r in streamer.reason)})
