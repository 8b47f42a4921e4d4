"""Per-pair response log-probabilities for preference training.

Consumes the batch contract documented in :mod:`paddlenlp_ext.dpo`
(``logp_index`` / ``logp_token`` / ``logp_segment`` / ``num_pairs``) and the
model's logits, and returns the summed (or token-averaged) log-probability
of every chosen and every rejected answer.

Memory: only the ``T`` scored rows are taken out of the logits before the
float32 softmax cross-entropy, so the float32 working set is ``T x V`` rather than
``B x S x V`` (``T`` = number of scored response tokens in the batch).

The segment sum uses ``paddle.index_add`` into a zero vector of explicit
length ``2N``: it has CPU forward and backward kernels, does not need sorted
segment ids, and keeps empty trailing segments (``paddle.geometric.segment_sum``
sizes its output from the largest id present, so it would silently drop
them).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

__all__ = ["pair_logps", "scored_logits"]


def logits_from(outputs):
    """Logits of a causal-LM forward without labels: ModelOutput, dict, tuple or tensor."""
    if isinstance(outputs, paddle.Tensor):
        return outputs
    if isinstance(outputs, dict):
        return outputs["logits"]
    if hasattr(outputs, "logits"):
        return outputs.logits
    return outputs[0]


def scored_logits(model, inputs, logp_index: paddle.Tensor, real_tokens=None):
    """Logits for the scored positions and the index of each scored token into them.

    ``inputs``: ``input_ids``, ``position_ids`` and one mask (``attn_mask_startend_row_indices`` or
    ``attention_mask``), as the collator builds them.  On families that split into body + lm_head
    (:func:`paddlenlp_ext.models.heads.split_lm_head`) lm_head runs on the ``T`` scored hidden rows
    only and the result is ``([1, T, V], arange(T))``; otherwise the full forward's
    ``([B, S, V], logp_index)``.  Either pair gives the same :func:`pair_logps`.

    ``real_tokens`` [B, S] (the batch's ``real_tokens``): this is the policy's training forward, so on an MoE
    row the router's aux loss over those tokens and the expert counts are recorded for
    ``training.moe_aux.add_aux_loss`` (docs/moe.md); None (a reference or a no-gradient forward) records nothing.
    """
    from ..models.heads import split_lm_head
    from ..training.moe_aux import prepare_forward, record_body_forward

    split = split_lm_head(model, router_aux=True)  # MoE rows: the router logits come back from the body
    if split is None:
        if real_tokens is not None:
            prepare_forward(model, real_tokens)  # the whole forward records the aux loss over real tokens itself
        return logits_from(model(**inputs, use_cache=False, return_dict=True)), logp_index  # [B, S, V], [T]
    body, head = split
    out = body(**inputs, use_cache=False, return_dict=True)
    if real_tokens is not None:
        record_body_forward(model, getattr(out, "router_logits", None), real_tokens)
    hidden = out[0]  # [B, S, H]
    b, s, h = hidden.shape
    idx = logp_index.astype("int64").reshape([-1])  # [T]
    rows = paddle.gather(hidden.reshape([b * s, h]), idx, axis=0)  # [T, H]
    logits = head(rows.unsqueeze(0))  # [1, T, V]
    return logits, paddle.arange(idx.shape[0], dtype="int64")  # [1, T, V], [T]


def pair_logps(
    logits: paddle.Tensor,
    logp_index: paddle.Tensor,
    logp_token: paddle.Tensor,
    logp_segment: paddle.Tensor,
    num_pairs: int,
    normalize: bool = False,
):
    """Sum the log-probs of the scored tokens per answer.

    Args:
        logits: ``[B, S, V]`` (any float dtype) model output, not shifted.
        logp_index: ``[T]`` int64, flat ``row * S + position`` of the logits
            row predicting each scored token.
        logp_token: ``[T]`` int64, the scored token ids.
        logp_segment: ``[T]`` int64, ``2 * pair`` (chosen) or
            ``2 * pair + 1`` (rejected).
        num_pairs: ``N``.
        normalize: if True, divide each answer's sum by its token count
            (PaddleNLP's ``average_log_prob``, used for ipo / or / simpo).
            An answer with zero tokens then gives 0 instead of NaN.

    Returns:
        ``(chosen [N], rejected [N], chosen_tokens [N], rejected_tokens [N])``;
        the log-probs are float32 and differentiable w.r.t. ``logits``; the
        token counts are float32 constants (no gradient).
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, S, V], got shape {list(logits.shape)}")
    num_pairs = int(num_pairs)
    if num_pairs < 0:
        raise ValueError(f"num_pairs must be >= 0, got {num_pairs}")
    b, s, v = logits.shape  # B, S, V
    num_seg = 2 * num_pairs  # 2N

    flat = logits.reshape([b * s, v])  # [B*S, V]
    idx = logp_index.astype("int64").reshape([-1])  # [T]
    tok = logp_token.astype("int64").reshape([-1])  # [T]
    seg = logp_segment.astype("int64").reshape([-1])  # [T]

    rows = paddle.gather(flat, idx, axis=0)  # [T, V]  (gather first: T x V, not B x S x V)
    # log p(tok) = -cross_entropy: the same number as log_softmax + gather, but Paddle's CPU log_softmax
    # kernel is ~500x slower than its fused softmax-cross-entropy (74 s vs 0.13 s for [600, 32000])
    tok_logp = -F.cross_entropy(rows.astype("float32"), tok.unsqueeze(-1), reduction="none").squeeze(-1)  # [T]

    zeros = paddle.zeros([num_seg], dtype="float32")  # [2N]
    seg_logp = paddle.index_add(zeros, seg, 0, tok_logp)  # [2N]
    ones = paddle.ones_like(tok_logp).detach()  # [T]
    seg_count = paddle.index_add(paddle.zeros([num_seg], dtype="float32"), seg, 0, ones).detach()  # [2N]

    if normalize:
        seg_logp = seg_logp / paddle.clip(seg_count, min=1.0)  # [2N]

    pairs = seg_logp.reshape([num_pairs, 2])  # [N, 2]
    counts = seg_count.reshape([num_pairs, 2])  # [N, 2]
    chosen = pairs[:, 0]  # [N]
    rejected = pairs[:, 1]  # [N]
    chosen_tokens = counts[:, 0]  # [N]
    rejected_tokens = counts[:, 1]  # [N]
    return chosen, rejected, chosen_tokens, rejected_tokens
