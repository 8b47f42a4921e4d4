"""Continuous batching (``--batching continuous``): rows join the running batch at the next decode step and
leave it as soon as they end.

The running set holds, per row, its KV cache (PaddleNLP's per-layer ``(key, value)`` tensors
[B, T, kv_heads, head_dim]), its attention-mask row [T] (0 on padding) and its next position.  New
requests for the running model are prefilled together (left-padded, :func:`predict.generate.left_padded`),
their first token chosen from the prefill logits, and their caches joined to the running ones: the
shorter side is padded on the LEFT with zero keys/values under mask 0, which attention never sees,
so a row computes what it computes alone (tested: greedy texts equal each row served alone).  Each
step feeds every row's last token [B, 1] with its own position; rows that ended are gathered out, and
columns that are padding in every row are cut from the front.  Rows are chosen per row as in
:mod:`.decode` (sampling, seed, logprobs, token masks).  Prefix-tuning models (their cache is the
prefix) run through the static batches of ``engine.Scheduler``.

One running batch holds the rows of one batch group (``ServedModel.group``): the base and every LoRA
adapter applied per row on it (``serve.multilora``).  Each row keeps its adapter slot (-1 = the base);
before every forward -- the prefill of joining rows and each decode step -- the slots of exactly the
rows in that forward go to ``RowAdapters.rows``, so base and adapter rows share every step.
"""

from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from .decode import choose, log_softmax, penalize, prompt_logprobs, token_info


class RunningBatch:
    """The rows generating now for one model (module doc)."""

    def __init__(self, model, eos_ids, pad_id: int, table=None):
        self.model, self.eos, self.pad_id = model, set(eos_ids), pad_id
        self.table = table  # serve.multilora.RowAdapters of the base, or None
        self.slots = np.zeros(0, "int64")  # [B] each row's adapter slot, -1 = the base
        self.rows: list = []  # decode.Row
        self.states: list = []  # engine.RowState
        self.seen: List[list] = []
        self.cache = None  # [(k, v)] per layer, [B, T, H, D]
        self.mask: Optional[np.ndarray] = None  # [B, T] int64
        self.pos: Optional[np.ndarray] = None  # [B] next position
        self.nxt: Optional[np.ndarray] = None  # [B] last chosen token
        self.tokens = 0
        self.cancelled = 0
        self.served = ""  # the batch group these rows are for (the base's name with per-row adapters)

    def __len__(self) -> int:
        return len(self.rows)

    def _pick(self, i: int, logits: np.ndarray) -> bool:
        """Choose row i's next token from its float32 logits [V]; True when the row has ended."""
        r = self.rows[i]
        x = penalize(logits, self.seen[i], r.repetition_penalty)
        allowed = r.constraint.mask(x.shape[0]) if r.constraint is not None else None
        t = choose(x, r, allowed)
        if r.constraint is not None:
            r.constraint.consume(t)
        self.seen[i].append(t)
        self.nxt[i] = t
        self.tokens += 1
        info = token_info(log_softmax(logits), t, r.logprobs) if r.logprobs is not None else None
        return self.states[i].add(t, info, self.eos) or t in self.eos

    def _forward(self, ids, mask, pos, cache, slots: np.ndarray):
        """The model on ``ids`` [b, q]; ``slots`` [b] the adapter slot of each of these rows (-1 = base)."""
        import paddle

        def run():
            out = self.model(
                input_ids=paddle.to_tensor(ids),
                attention_mask=paddle.to_tensor(mask),
                position_ids=paddle.to_tensor(pos),
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            return out.logits, list(out.past_key_values)  # [b, q, V], [(k, v)] per layer

        if self.table is None:
            return run()
        with self.table.lock:  # the slots stay loaded for this forward (serve.multilora)
            self.table.set_rows(slots.tolist())
            try:
                return run()
            finally:
                self.table.rows = None

    def join(self, rows, states, slots=None) -> None:
        """Prefill ``rows`` (``slots``: each one's adapter slot, -1 = base) and add them; rows that end at once
        (echo only, one token) finish here."""
        import paddle

        from ..predict.generate import left_padded

        slots = np.full(len(rows), -1, "int64") if slots is None else np.asarray(slots, dtype="int64")
        ids, mask, pos = left_padded([r.prompt for r in rows])  # [b, L] each
        with paddle.no_grad():
            logits, cache = self._forward(ids, mask, pos, None, slots)
        L = ids.shape[1]
        start = len(self.rows)
        self.slots = np.concatenate([self.slots, slots])
        self.rows += rows
        self.states += states
        self.seen += [list(ids[i]) for i in range(len(rows))]
        self.nxt = (
            np.concatenate([self.nxt, np.zeros(len(rows), "int64")])
            if self.nxt is not None
            else np.zeros(len(rows), "int64")
        )
        last = logits[:, -1, :].astype("float32").numpy()  # [b, V]
        ended = []
        for j, r in enumerate(rows):
            if r.echo:
                r.prompt_logprobs = prompt_logprobs(
                    logits[j, L - len(r.prompt) :].astype("float32").numpy(), r.prompt, r.logprobs or 0
                )
            if not r.generate or self._pick(start + j, last[j]):
                ended.append(start + j)
        self._merge(cache, mask, pos[:, -1] + 1)
        self._drop(ended)

    def _merge(self, cache, mask: np.ndarray, pos: np.ndarray) -> None:
        import paddle

        if self.cache is None:
            self.cache, self.mask, self.pos = cache, mask, pos
            return
        T = max(self.mask.shape[1], mask.shape[1])

        def pad(c, m):
            extra = T - m.shape[1]
            if not extra:
                return c, m
            c = [
                tuple(
                    paddle.concat([paddle.zeros([x.shape[0], extra] + list(x.shape[2:]), dtype=x.dtype), x], axis=1)
                    for x in kv
                )
                for kv in c
            ]  # [b, T, H, D]
            return c, np.concatenate([np.zeros((m.shape[0], extra), "int64"), m], axis=1)

        a, ma = pad(self.cache, self.mask)
        b, mb = pad(cache, mask)
        self.cache = [tuple(paddle.concat([x, y], axis=0) for x, y in zip(ka, kb)) for ka, kb in zip(a, b)]
        self.mask, self.pos = np.concatenate([ma, mb], axis=0), np.concatenate([self.pos, pos])

    def _drop(self, ended: List[int]) -> None:
        """Gather the rows that go on; cut the columns that are padding in every row."""
        import paddle

        if not ended:
            return
        self.cancelled += sum(self.states[i].reason == "cancelled" for i in ended)
        keep = [i for i in range(len(self.rows)) if i not in set(ended)]
        for name in ("rows", "states", "seen"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        if not keep:
            self.cache = self.mask = self.pos = self.nxt = None
            self.slots = np.zeros(0, "int64")
            return
        idx = paddle.to_tensor(np.asarray(keep, dtype="int64"))
        self.mask, self.pos, self.nxt, self.slots = self.mask[keep], self.pos[keep], self.nxt[keep], self.slots[keep]
        cut = int(np.argmax(self.mask.any(axis=0)))  # leading all-padding columns
        self.mask = self.mask[:, cut:]
        self.cache = [tuple(paddle.gather(x, idx, axis=0)[:, cut:] for x in kv) for kv in self.cache]

    def step(self) -> None:
        """One decode step for every row."""
        import paddle

        self.mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), "int64")], axis=1)  # [B, T+1]
        with paddle.no_grad():
            logits, self.cache = self._forward(
                self.nxt.reshape(-1, 1), self.mask, self.pos.reshape(-1, 1), self.cache, self.slots
            )
        self.pos = self.pos + 1
        last = logits[:, -1, :].astype("float32").numpy()  # [B, V]
        ended = [i for i in range(len(self.rows)) if self._pick(i, last[i])]
        self._drop(ended)


class ContinuousLoop:
    """The worker of ``--batching continuous``: ``step()`` admits waiting rows and runs one decode step
    (False once the scheduler is closed and idle); ``engine.Scheduler._main`` calls it in a loop and
    hands a failure to ``fail`` (the rows running now get a 500; the server goes on)."""

    def __init__(self, scheduler):
        self.s = scheduler
        self.running: Optional[RunningBatch] = None
        self.new: list = []
        self.busy_since, self.jobs = 0.0, set()

    def step(self) -> bool:
        s = self.s
        new = self.new = s.admit(self.running)
        if new is None:  # closing and nothing left
            return False
        idle = self.running is None or not len(self.running)
        if not new and idle:
            return True
        if new and idle:
            model = new[0].model
            if hasattr(model.session.model, "prefix_config"):  # the prefix is the cache: a static batch
                s._run(new)  # noqa: SLF001 -- the same worker thread
                return True
            # the base's model, shared by its per-row adapters; each row's slot goes with it (serve.multilora)
            self.running = RunningBatch(model.session.model, model.session.eos_ids, model.session.pad_id, model.table)
            self.running.served = model.group
            self.busy_since, self.jobs = time.time(), set()
        run = self.running
        if new:
            rows, states = s._rows(new)  # noqa: SLF001
            self.jobs.update(j.id for j in new)
            run.join(rows, states, [-1 if st.job.model.slot is None else st.job.model.slot for st in states])
        if len(run):
            s.stats["running"] = len(run)
            s.stats["largest_batch"] = max(s.stats["largest_batch"], len(run))
            s.on_rows(len(run))
            run.step()
        if not len(run):  # the busy period ended: one line, as a static batch logs
            s.stats["running"] = 0
            s.stats["batches"] += 1
            s.stats["rows"] += len(self.jobs)
            s.on_batch(
                {
                    "model": run.served,
                    "rows": len(self.jobs),
                    "seconds": time.time() - self.busy_since,
                    "new_tokens": run.tokens,
                    "cancelled": run.cancelled,
                }
            )
        return True

    def fail(self, e: Exception) -> None:
        jobs = [st.job for st in (self.running.states if self.running is not None else [])] + list(self.new or [])
        self.s.fail(jobs, e)
        self.running = None
        self.s.stats["running"] = 0
