"""The scheduler: a bounded queue of requests, batched per model, generated on one thread.

One worker thread owns Paddle: it loads the models, then repeatedly takes the oldest waiting
request, waits ``batch_wait`` seconds for company, and runs every waiting request for the same
model -- up to ``max_batch_size`` rows (a request has one row per prompt and choice, ``n``) --
as ONE left-padded ``serve.decode.decode`` call with the KV cache.  Sampling, seeds, logprobs
and token masks are per row, so requests with different settings share a batch; so do the base
and its per-row LoRA adapters (``serve.multilora``, at most ``max_loras`` adapters per batch), while
an adapter served as a merged copy batches only with its own requests.

Each generated token goes to its row's :class:`RowState`: the row's text is re-decoded, a
:class:`~.textstream.TextAssembler` decides what can be sent, and the delta (with the logprobs
of its tokens) is handed to the request's asyncio queue on the event loop.  A row ends at EOS,
at its ``max_tokens``, at a stop sequence, or when its client went away (``Job.cancel``); the
batch ends when every row has.

With ``continuous=True`` (``--batching continuous``) the worker runs ``serve.continuous.ContinuousLoop``
instead: waiting requests of the running batch group (the base and its per-row adapters) join the
running batch at the next decode step (``admit``) and rows leave it when they end.

Waiting requests beyond ``max_queue`` are refused with 429; after ``close()`` new requests get
503 while everything already accepted is still generated (SIGTERM drains).
"""

from __future__ import annotations

import asyncio
import contextlib
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


@dataclasses.dataclass
class Choice:
    """One answer of a request: its prompt (a request may have several prompts, and ``n`` choices each)."""

    index: int
    prompt_ids: List[int]
    max_new_tokens: int  # 0: no generation (echo of the prompt's logprobs only)
    constraint: Any = None  # serve.constrain matcher for structured output / forced tool calls


class Job:
    """One request on its way through the scheduler; events go to ``queue`` on the event loop:
    ``("delta", text, choice_index, token_infos)``, then per choice
    ``("done", finish_reason, prompt_tokens, completion_tokens, full_text, choice_index, extra)``,
    or ``("error", ApiError)``.  ``extra``: ``{"tokens", "infos", "prompt_ids", "prompt_infos"}``."""

    def __init__(
        self,
        req: GenRequest,
        model,
        prompt_ids,
        max_new_tokens,
        loop: asyncio.AbstractEventLoop,
        constraint_factory: Optional[Callable[[], Any]] = None,
    ):
        self.id = next(_ids)
        prompts = [prompt_ids] if prompt_ids and isinstance(prompt_ids[0], int) else list(prompt_ids)
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        n = getattr(req, "n", 1)
        self.choices = [
            Choice(p * n + j, prompts[p], budgets[p], constraint_factory() if constraint_factory else None)
            for p in range(len(prompts))
            for j in range(n)
        ]
        self.req, self.model = req, model
        self.prompt_ids, self.max_new_tokens = prompts[0], budgets[0]  # the first prompt's (logs, tests)
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.loop, self.queue = loop, asyncio.Queue()
        # every row of a model shares a batch (sampling is per row, serve.decode); per-row LoRA adapters share
        # their base's batches (serve.multilora)
        self.key = (model.group,)
        self.cancelled = threading.Event()
        self.remaining = len(self.choices)
        self.finished = False
        self.submitted = time.time()

    def emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        """The client went away: stop generating for it (its rows are dropped at the next token)."""
        self.cancelled.set()


class RowState:
    """One row's text as its tokens arrive: deltas (held back at stop prefixes), logprobs, its end."""

    def __init__(self, job: Job, choice: Choice, decode_text, row=None):
        self.job, self.choice, self.decode_text, self.row = job, choice, decode_text, row
        self.dec = IncrementalDecoder(decode_text)
        self.text = TextAssembler(job.req.stop)
        self.infos: List[Any] = []  # per generated token: decode.token_info (or None)
        self.sent = 0  # infos already sent with a delta
        self.reason: Optional[str] = None

    @property
    def ids(self) -> List[int]:
        return self.dec.ids

    def add(self, token: int, info, eos_ids) -> bool:
        """The row's next token; True when the row has ended."""
        if self.reason is not None:
            return True
        if self.job.cancelled.is_set():
            self.reason = "cancelled"
            return True
        if token in eos_ids:
            self.finish("stop")
            return True
        self.infos.append(info)
        if self.dec.add(token):
            delta, stopped = self.text.update(self.dec.text)
            if delta:
                self._emit_delta(delta)
            if stopped:
                self.finish("stop")
                return True
        if len(self.dec.ids) >= self.choice.max_new_tokens:
            self.finish("length")
            return True
        return False

    def _emit_delta(self, delta: str) -> None:
        infos = self.infos[self.sent :]
        self.sent = len(self.infos)
        self.job.emit("delta", delta, self.choice.index, infos)

    def finish(self, reason: str) -> None:
        """End the row: the answer is the decoding of all its tokens (the predictor's), cut at a stop sequence."""
        full = self.decode_text(self.dec.ids)
        cut = first_stop(full, self.job.req.stop)
        answer = full if cut is None else full[:cut]
        delta, _ = self.text.update(full, final=True)
        if delta or self.sent < len(self.infos):
            self._emit_delta(delta)
        self.reason = "stop" if cut is not None else reason
        self.job.remaining -= 1
        self.job.finished = self.job.remaining <= 0
        extra = {
            "tokens": list(self.dec.ids),
            "infos": self.infos,
            "prompt_ids": self.choice.prompt_ids,
            "prompt_infos": getattr(self.row, "prompt_logprobs", None),
        }
        self.job.emit(
            "done", self.reason, len(self.choice.prompt_ids), len(self.dec.ids), answer, self.choice.index, extra
        )


class Scheduler:
    def __init__(
        self,
        models,
        max_batch_size: int = 16,
        max_queue: int = 64,
        batch_wait: float = 0.01,
        on_batch: Optional[Callable[[dict], None]] = None,
        continuous: bool = False,
        max_loras: int = 4,
    ):
        self.max_loras = max_loras  # distinct per-row adapters in one batch at most (vLLM's --max_loras)
        self.continuous = continuous  # serve.continuous: rows join and leave the running batch every step
        self.models = {m.name: m for m in models}
        self.max_batch_size, self.max_queue, self.batch_wait = max_batch_size, max_queue, batch_wait
        self.on_batch = on_batch or (lambda info: None)
        self.on_rows: Callable[[int], None] = lambda rows: None  # rows per batch (the /metrics histogram)
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
                raise ApiError(
                    429, f"too many requests waiting ({self.max_queue}, --max_queue); retry shortly", None, "queue_full"
                )
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
        if self.continuous:
            from .continuous import ContinuousLoop

            loop = ContinuousLoop(self)
            while True:
                try:
                    if not loop.step():
                        return
                except Exception as e:  # the rows running now get a 500 (logged); the server goes on
                    loop.fail(e)
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
            jobs, rows, loras = [], 0, set()
            for j in list(self.waiting):
                if j.key != key:
                    continue
                if jobs and rows + len(j.choices) > self.max_batch_size:
                    break
                if j.model.slot is not None and j.model.slot not in loras:
                    if len(loras) >= self.max_loras:
                        continue  # waits for a later batch (its order among its adapter's requests is kept)
                    loras.add(j.model.slot)
                jobs.append(j)
                rows += len(j.choices)
                self.waiting.remove(j)
        return [j for j in jobs if not j.cancelled.is_set()] or []

    def admit(self, running) -> Optional[List[Job]]:
        """Continuous batching: the waiting jobs that join ``running`` now (rows up to ``max_batch_size``);
        blocks while nothing runs and nothing waits; None once closing with nothing left.  Jobs of one batch
        group join (the base and its per-row LoRA adapters, ``ServedModel.group``), with at most ``max_loras``
        distinct adapters among the running rows.  While the oldest waiting job cannot join (another group, or
        a further adapter) nothing joins, so the running rows drain and it goes next (no request starves)."""
        busy = running is not None and len(running) > 0
        with self.cond:
            while not self.waiting and not busy:
                if self.closing:
                    return None
                self.cond.wait()
        if not busy and self.batch_wait > 0:
            time.sleep(self.batch_wait)  # let concurrent requests join the first step
        with self.cond:
            if not self.waiting:
                return []
            group = running.served if busy else self.waiting[0].model.group
            room = self.max_batch_size - (len(running) if busy else 0)
            loras = {int(s) for s in running.slots if s >= 0} if busy else set()
            jobs = []
            for k, j in enumerate(list(self.waiting)):
                if j.model.group != group:
                    if k == 0:
                        break  # the oldest waits for another group: the running rows drain first
                    continue
                if len(j.choices) > room and (jobs or busy):
                    break
                slot = j.model.slot
                if slot is not None and slot not in loras:
                    if len(loras) >= self.max_loras:
                        if k == 0:
                            break  # the oldest needs a further adapter: wait until one has left
                        continue  # waits (its order among its adapter's requests is kept)
                    loras.add(slot)
                jobs.append(j)
                room -= len(j.choices)
                self.waiting.remove(j)
        return [j for j in jobs if not j.cancelled.is_set()]

    def fail(self, jobs: List[Job], e: Exception) -> None:
        _log.error("generation failed: %s: %s", type(e).__name__, e, exc_info=e)
        for j in jobs:
            if not j.finished:
                j.finished = True
                j.emit("error", ApiError(500, f"generation failed: {type(e).__name__}: {e}", None, "internal"))

    def _rows(self, jobs: List[Job]):
        """(decode.Row per choice, RowState per choice) for a batch."""
        from .decode import Row

        model = jobs[0].model
        s = model.session

        def text(ids):  # as the predictor decodes an answer: special tokens out, spaces as the tokenizer made them
            return s.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

        rows, states = [], []
        for j in jobs:
            sp, req = j.req.sampling, j.req
            for c in j.choices:
                rng = np.random.default_rng([sp.seed, c.index]) if sp.seed is not None else np.random.default_rng()
                rows.append(
                    Row(
                        prompt=c.prompt_ids,
                        greedy=sp.greedy,
                        temperature=sp.temperature,
                        top_p=sp.top_p,
                        top_k=sp.top_k,
                        repetition_penalty=float(model.options.repetition_penalty),
                        rng=rng,
                        logprobs=getattr(req, "logprobs", None),
                        echo=getattr(req, "echo", False),
                        constraint=c.constraint,
                        generate=c.max_new_tokens > 0,
                    )
                )
                states.append(RowState(j, c, text, rows[-1]))
        return rows, states

    def _run(self, jobs: List[Job]) -> None:
        table = jobs[0].model.table if jobs else None
        # no adapter is loaded or unloaded between the check below and the last token (serve.multilora)
        with table.lock if table is not None else contextlib.nullcontext():
            gone = [j for j in jobs if j.model.slot is not None and j.model.slot not in j.model.table.slots.values()]
            for j in gone:  # its adapter was unloaded after the request was checked: never answered by the base
                j.finished = True
                j.emit("error", ApiError(404, f"the model {j.model.name!r} was unloaded", "model", "model_not_found"))
            jobs = [j for j in jobs if j not in gone]
            if not jobs:
                return
            from .decode import decode

            model, s = jobs[0].model, jobs[0].model.session
            rows, states = self._rows(jobs)
            eos = set(s.eos_ids)
            t0 = time.time()
            self.stats["running"] = len(rows)
            self.on_rows(len(rows))
            try:
                if table is not None:  # each row's adapter slot, -1 for the base (serve.multilora)
                    table.set_rows([-1 if st.job.model.slot is None else st.job.model.slot for st in states])
                decode(
                    s.model,
                    rows,
                    s.eos_ids,
                    s.pad_id,
                    max(c.max_new_tokens for j in jobs for c in j.choices),
                    lambda i, t, info: states[i].add(t, info, eos),
                )
            except Exception as e:  # reported to each request of this batch as a 500; the server goes on
                _log.exception("generation failed")
                for j in jobs:
                    if not j.finished:
                        j.finished = True
                        j.emit("error", ApiError(500, f"generation failed: {type(e).__name__}: {e}", None, "internal"))
                return
            finally:
                self.stats["running"] = 0
                if table is not None:
                    table.rows = None
            for st in states:  # rows that never got a token (echo only)
                if st.reason is None and not st.job.cancelled.is_set():
                    st.finish("length")
            self.stats["batches"] += 1
            self.stats["rows"] += len(jobs)
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(rows))
            self.on_batch(
                {
                    "model": model.name,
                    "rows": len(jobs),
                    "choices": len(rows),
                    "seconds": time.time() - t0,
                    "new_tokens": sum(len(x.ids) for x in states),
                    "cancelled": sum(x.reason == "cancelled" for x in states),
                }
            )
