"""The server's decoding loop: one batch of rows, each with its own sampling, logprobs and token mask.

The loop makes the same model calls as PaddleNLP's ``generate`` (``prepare_inputs_for_generation``
-> forward -> ``update_model_kwargs_for_generation``, left padding, the KV cache, ``predict.generate``'s
position ids), so a greedy row gets the predictor's tokens, but the next token of each row is chosen
here, in float32 numpy, which gives what ``generate`` cannot:

* per-row sampling (greedy, temperature, top_p, top_k, repetition penalty) and a per-row RNG
  (``seed``: the same sample whichever rows share the batch);
* the model's log-softmax (float32, before temperature / penalty, as vLLM reports it) of the chosen
  token and the top-k alternatives, and of the prompt's tokens (``echo``) from the prefill logits;
* a per-row mask of allowed tokens (constrained decoding, ``serve.constrain``).

``on_token(i, token, info)`` gets each row's token and returns True when that row has ended (EOS,
budget, stop sequence, cancel); the loop ends when every row has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

NEG_INF = np.float32(-np.inf)


@dataclass
class Row:
    prompt: List[int]
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    rng: Any = None  # np.random.Generator for sampling rows
    logprobs: Optional[int] = None  # None: no logprobs; k >= 0: the chosen token's and the top k
    echo: bool = False  # the prompt's logprobs too (needs logprobs)
    constraint: Any = None  # .mask(vocab) -> bool [V] of allowed tokens; .consume(token)
    generate: bool = True  # False: prefill only (echo with max_tokens 0)
    prompt_logprobs: Optional[list] = field(default=None)  # filled from the prefill when echo


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-softmax over the last axis.

    >>> np.round(np.exp(log_softmax(np.array([0.0, 0.0], dtype="float32"))), 3).tolist()
    [0.5, 0.5]
    """
    x = logits.astype("float32", copy=False)
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype("float32")


def top_entries(logp: np.ndarray, k: int) -> List[tuple]:
    """[(token, logprob)] of the k most likely tokens, most likely first.

    >>> [(t, round(lp, 3)) for t, lp in top_entries(np.log(np.array([0.1, 0.6, 0.3], dtype="float32")), 2)]
    [(1, -0.511), (2, -1.204)]
    """
    if k <= 0:
        return []
    k = min(k, logp.shape[-1])
    idx = np.argpartition(-logp, k - 1)[:k]
    idx = idx[np.argsort(-logp[idx], kind="stable")]
    return [(int(t), float(logp[t])) for t in idx]


def penalize(logits: np.ndarray, seen: Sequence[int], penalty: float) -> np.ndarray:
    """PaddleNLP's repetition penalty: seen tokens' logits divided by ``penalty`` if positive, else multiplied.

    >>> penalize(np.array([2.0, -2.0, 1.0], dtype="float32"), [0, 1], 2.0).tolist()
    [1.0, -4.0, 1.0]
    """
    if penalty == 1.0 or not len(seen):
        return logits
    out = logits.copy()
    ids = np.unique(np.asarray(seen, dtype="int64"))
    v = out[ids]
    out[ids] = np.where(v > 0, v / penalty, v * penalty)
    return out


def choose(logits: np.ndarray, row: Row, allowed: Optional[np.ndarray] = None) -> int:
    """The next token of one row from its float32 logits [V]: argmax, or a sample after temperature, top_k, top_p.

    >>> choose(np.array([0.0, 3.0, 1.0], dtype="float32"), Row(prompt=[1]))
    1
    >>> choose(np.array([0.0, 3.0, 1.0], dtype="float32"), Row(prompt=[1]), np.array([True, False, True]))
    2
    """
    x = logits if allowed is None else np.where(allowed, logits, NEG_INF)
    if row.greedy:
        return int(np.argmax(x))
    x = x / np.float32(row.temperature)
    if row.top_k and row.top_k < x.shape[0]:
        kth = np.partition(x, -row.top_k)[-row.top_k]
        x = np.where(x >= kth, x, NEG_INF)
    p = np.exp(x - x.max())  # [V] unnormalized; masked tokens are exactly 0
    ids = None
    if row.top_p < 1.0:
        order = _descending(p / p.sum(), row.top_p)
        cum = np.cumsum(p[order] / p.sum())
        ids = order[: int(np.searchsorted(cum, row.top_p) + 1)]  # the smallest set reaching top_p
        p = p[ids]
    rng = row.rng if row.rng is not None else np.random.default_rng()
    k = draw(p, rng.random())
    return int(ids[k]) if ids is not None else k


def draw(p: np.ndarray, u: float, block: int = 1024) -> int:
    """The index where ``u`` (in [0, 1)) falls in the distribution ``p`` (>= 0, unnormalized): inverse CDF over
    block sums, then within one block (a cumulative sum over a 150k vocabulary costs ~10 ms per row and step).

    >>> [draw(np.array([0.2, 0.0, 0.8]), u, block=2) for u in (0.1, 0.3, 0.99)]
    [0, 2, 2]
    """
    n = p.shape[0]
    sums = np.add.reduceat(p, np.arange(0, n, block), dtype="float64")  # [ceil(n / block)]
    cum = np.cumsum(sums)
    target = u * cum[-1]
    j = min(int(np.searchsorted(cum, target, side="right")), len(cum) - 1)
    inner = np.cumsum(p[j * block : (j + 1) * block], dtype="float64")
    k = j * block + min(int(np.searchsorted(inner, target - (cum[j - 1] if j else 0.0), side="right")), len(inner) - 1)
    if p[k] == 0:  # rounding put the draw on a masked token: take the nearest allowed one before it
        nz = np.flatnonzero(p[: k + 1])
        k = int(nz[-1]) if nz.size else int(np.argmax(p))
    return k


def _descending(p: np.ndarray, mass: float, first: int = 256) -> np.ndarray:
    """Token ids by falling probability, far enough to cover ``mass``: the ``first`` most likely sorted when
    they reach it (a full sort of a 150k vocabulary per row and step would dominate the step), else all.

    >>> p = np.array([0.1, 0.6, 0.3])
    >>> _descending(p, 0.5, first=1).tolist(), _descending(p, 0.95, first=1).tolist()
    ([1], [1, 2, 0])
    """
    if first < p.shape[0]:
        top = np.argpartition(-p, first - 1)[:first]
        top = top[np.argsort(-p[top], kind="stable")]
        if p[top].sum() >= mass:
            return top
    return np.argsort(-p, kind="stable")


def token_info(logp: np.ndarray, token: int, k: Optional[int]) -> Optional[dict]:
    """{"token", "logprob", "top": [(token, logprob)]} of a chosen token, or None without logprobs."""
    if k is None:
        return None
    return {"token": int(token), "logprob": float(logp[token]), "top": top_entries(logp, k)}


def _prefix_prepare(model):
    """PrefixModel: the inner model's prepare_inputs_for_generation with the prefix as the first cache
    and the masks extended (what ``PrefixModel.generate`` installs for PaddleNLP's loop)."""
    inner = model.model

    def prepare(input_ids, **kw):
        inputs = inner.prepare_inputs_for_generation(input_ids, **kw)
        ids = inputs["input_ids"]  # [B, q]
        if inputs.get("past_key_values") is None:
            inputs["past_key_values"] = model.past_key_values(ids.shape[0])
        kv_len = inputs["past_key_values"][0][0].shape[1] + ids.shape[1]
        mask, startend = model.extend_masks(inputs.get("attention_mask"), None, ids.shape[0], ids.shape[1], kv_len)
        inputs["attention_mask"] = mask
        if startend is not None:
            inputs["attn_mask_startend_row_indices"] = startend
        return inputs

    return inner, prepare


def prompt_logprobs(logits_row: np.ndarray, prompt: List[int], k: int) -> list:
    """[None, (logprob, top)...]: each prompt token's log-probability given the tokens before it.

    ``logits_row`` [n, V] are the prefill logits of the row's n real positions (position j predicts token j+1).
    """
    out: list = [None]
    if len(prompt) < 2:
        return out
    logp = log_softmax(logits_row[:-1])  # [n-1, V]
    for j, t in enumerate(prompt[1:]):
        out.append(token_info(logp[j], t, k))
    return out


def decode(
    model,
    rows: List[Row],
    eos_ids: Sequence[int],
    pad_id: int,
    max_new: int,
    on_token: Callable[[int, int, Optional[dict]], bool],
) -> None:
    """Generate for ``rows`` (module doc) for at most ``max_new`` steps."""
    import paddle

    from ..predict.generate import left_padded

    inner, prepare = (
        (model, model.prepare_inputs_for_generation) if not hasattr(model, "prefix_config") else _prefix_prepare(model)
    )
    ids, mask, pos = left_padded([r.prompt for r in rows])  # [B, L] each
    B, L = ids.shape
    pad = [L - len(r.prompt) for r in rows]
    seen = [list(ids[i]) for i in range(B)]  # the repetition penalty sees the padding too, as generate's does
    done = [not r.generate for r in rows]
    kwargs = {"attention_mask": paddle.to_tensor(mask), "position_ids": paddle.to_tensor(pos), "use_cache": True}
    input_ids = paddle.to_tensor(ids)
    with paddle.no_grad():
        for step in range(max(max_new, 1)):
            inputs = prepare(input_ids, **kwargs)
            outputs = inner(**inputs)
            logits = outputs[0] if isinstance(outputs, tuple) else outputs.logits  # [B, q, V]
            if step == 0:
                for i, r in enumerate(rows):
                    if r.echo:  # the prompt's own logprobs, from the prefill
                        r.prompt_logprobs = prompt_logprobs(
                            logits[i, pad[i] :].astype("float32").numpy(), r.prompt, r.logprobs or 0
                        )
            if all(done):
                return
            last = logits[:, -1, :].astype("float32").numpy()  # [B, V]
            nxt = np.full((B,), pad_id, dtype="int64")
            for i, r in enumerate(rows):
                if done[i]:
                    continue
                x = penalize(last[i], seen[i], r.repetition_penalty)
                allowed = r.constraint.mask(x.shape[0]) if r.constraint is not None else None
                t = choose(x, r, allowed)
                if r.constraint is not None:
                    r.constraint.consume(t)
                nxt[i] = t
                seen[i].append(t)
                info = token_info(log_softmax(last[i]), t, r.logprobs) if r.logprobs is not None else None
                if on_token(i, t, info) or t in eos_ids:
                    done[i] = True
            if all(done):
                return
            input_ids = paddle.concat([input_ids, paddle.to_tensor(nxt).unsqueeze(-1)], axis=1)  # [B, L+step+1]
            kwargs = inner.update_model_kwargs_for_generation(outputs, kwargs, is_encoder_decoder=False)
