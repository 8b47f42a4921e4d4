"""The scalar score head on a causal LM's decoder, last-token scores and the pairwise loss.

``attach_score_head(model)`` adds ``model.score_head`` = ``Linear(hidden_size, 1, bias=False)``
(float32, as PaddleNLP's ``LlamaModelForScore.score_head``), always trainable, to a causal LM whose
family splits into body + lm_head (:func:`paddlenlp_ext.models.heads.split_lm_head`).  The lm_head
stays in the model (unused by scoring, saved with full weights so the directory is still a causal
LM) and is frozen for full fine-tuning: it gets no gradient from a reward loss.

``sequence_scores(model, inputs, score_index)``: body forward -> hidden rows at ``score_index``
-> score_head -> ``[K]`` float32 scores.
"""

from __future__ import annotations

from typing import Dict, List

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from ..models.heads import split_lm_head

SCORE_HEAD_ATTR = "score_head"
MASK_KEYS = ("attn_mask_startend_row_indices", "attention_mask")


def body_of(model):
    """The decoder body of ``model`` (ValueError naming the family if it has none we can score with).  On the
    decoder's MoE rows too: :func:`sequence_scores` takes their router logits from the body's output, so the
    router's aux loss is kept (``training.moe_aux.record_body_forward``)."""
    split = split_lm_head(model, router_aux=True)
    if split is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(
            f"reward models need a causal LM that splits into decoder body + lm_head (llama, qwen2, "
            f"qwen3, qwen3_moe, our decoder's rows, without sequence or tensor parallel); got model_type "
            f"{model_type!r}"
        )
    return split[0]


def attach_score_head(model, freeze_lm_head: bool = True) -> nn.Linear:
    """Add (or return the existing) ``model.score_head``: Linear(hidden_size -> 1, no bias), float32,
    trainable; ``freeze_lm_head``: the unused lm_head gets no gradient (full fine-tuning)."""
    body_of(model)
    head = getattr(model, SCORE_HEAD_ATTR, None)
    if head is None:
        head = nn.Linear(int(model.config.hidden_size), 1, bias_attr=False)
        if head.weight.dtype != paddle.float32:
            head.to(dtype="float32")
        setattr(model, SCORE_HEAD_ATTR, head)  # a sublayer: in model.parameters() (optimizer, AMP, resume)
    head.weight.stop_gradient = False
    if freeze_lm_head:
        body, lm_head = split_lm_head(model, router_aux=True)
        shared = {p.name for p in body.parameters()}  # tied word embeddings: the body's embedding still trains
        for p in lm_head.parameters():
            if p.name not in shared:
                p.stop_gradient = True
    return head


def sequence_scores(
    model, inputs: Dict[str, paddle.Tensor], score_index: paddle.Tensor, real_tokens=None
) -> paddle.Tensor:
    """Scores ``[K]`` float32 of the hidden states at ``score_index`` ``[K]`` (flat ``row * S + position``).

    ``inputs``: ``input_ids`` [B, S], optional ``position_ids`` [B, S] and at most one mask
    (``attn_mask_startend_row_indices`` [B, 1, S, 1] or ``attention_mask``).  ``real_tokens`` [B, S]: a training
    forward of an MoE body, whose router aux loss over those tokens is recorded for the trainer (docs/moe.md)."""
    body = body_of(model)
    kw = {"input_ids": inputs["input_ids"]}
    if inputs.get("position_ids") is not None:
        kw["position_ids"] = inputs["position_ids"]
    for key in MASK_KEYS:
        if inputs.get(key) is not None:
            kw[key] = inputs[key]
            break
    out = body(**kw, use_cache=False, return_dict=True)
    if real_tokens is not None:
        from ..training.moe_aux import record_body_forward

        record_body_forward(model, getattr(out, "router_logits", None), real_tokens)
    hidden = out[0]  # [B, S, H]
    b, s, h = hidden.shape
    rows = paddle.gather(hidden.reshape([b * s, h]), score_index.astype("int64").reshape([-1]), axis=0)  # [K, H]
    head = getattr(model, SCORE_HEAD_ATTR)
    return head(rows.astype(head.weight.dtype)).reshape([-1]).astype("float32")  # [K]


def pairwise_loss(chosen: paddle.Tensor, rejected: paddle.Tensor) -> paddle.Tensor:
    """Bradley-Terry: ``-log sigmoid(chosen - rejected)`` per pair, ``[N]``.

    Equal scores give ln 2 = 0.6931...; chosen 2.0, rejected 0.0 give ``log(1 + e^-2)`` = 0.1269."""
    return -F.log_sigmoid(chosen - rejected)  # [N]


def pair_score_metrics(chosen: paddle.Tensor, rejected: paddle.Tensor) -> Dict[str, List[float]]:
    """Per pair: accuracy (1.0 if chosen > rejected), margin, chosen and rejected score -- DPO's metric
    names, so the console's final table and ``metric_for_best_model`` read them alike.  Lists, one value
    per pair, so the trainer's means are over pairs (exact dev pair accuracy), not over batches.

    >>> pair_score_metrics(paddle.to_tensor([2.0, 0.0]), paddle.to_tensor([1.0, 0.5]))["rewards/accuracies"]
    [1.0, 0.0]
    """
    c = chosen.detach().astype("float32").numpy().reshape([-1])
    r = rejected.detach().astype("float32").numpy().reshape([-1])
    return {
        "rewards/accuracies": (c > r).astype("float64").tolist(),
        "rewards/margins": (c - r).tolist(),
        "rewards/chosen": c.tolist(),
        "rewards/rejected": r.tolist(),
    }
