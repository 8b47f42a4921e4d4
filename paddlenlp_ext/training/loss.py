"""The fine-tuning loss normalized by the label tokens of the whole global batch.

PaddleNLP's criterion returns each micro-batch's mean over its own tokens with
``loss > 0`` (a token the model predicts with probability 1.0 in fp32 is not
counted), so data parallel and gradient accumulation average means of
different sizes.  :func:`global_token_loss` returns instead

    sum of the micro-batch's token losses x ranks x accumulation / N

with ``N`` the label tokens of the whole global batch
(:mod:`paddlenlp_ext.data.global_batches` tags every index with it).  PaddleNLP
then divides by the accumulation steps and data parallel averages over ranks,
so the gradient is (sum over every label token of the global batch) / N, the
same for any layout; the logged loss is the global batch's token mean.

``lm_head`` runs only on the supervised positions where the model splits into
body + head (:func:`paddlenlp_ext.models.heads.split_lm_head`); a model wrapped
for data parallel (``paddle.DataParallel`` has no ``config``) takes its own
forward, which is what arms its gradient all-reduce.  The decoder's MoE rows
split too: the body's router logits are recorded as the whole forward records
them (``DecoderForCausalLM.record_moe_forward``), and the trainer adds the aux
loss (``training.moe_aux.add_aux_loss``) as before.  With a plain fp32 lm_head
(``models.heads.plain_head_weight``: PaddleNLP's Llama / Qwen2 heads, the
decoder's without bias or soft-cap) the head and the loss run in chunks of
tokens (:mod:`paddlenlp_ext.kernels.linear_cross_entropy`), so the [T, V]
logits are never whole in memory.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from ..kernels.linear_cross_entropy import linear_cross_entropy_sum
from ..models.heads import plain_head_weight, split_lm_head

IGNORE_INDEX = -100


def _logits_of(outputs):
    if isinstance(outputs, paddle.Tensor):
        return outputs
    if isinstance(outputs, dict):
        return outputs["logits"]
    return outputs[0]


def supervised_logits(model, inputs, labels: paddle.Tensor):
    """(logits [T, V], targets [T]) at the ``T`` positions whose label is not -100."""
    split = split_lm_head(model, router_aux=True)  # MoE rows: the body's router logits are recorded below
    if split is not None:
        body, head = split
        rows, targets = _supervised_rows(model, body, inputs, labels)  # [T, H], [T]
        # squeeze, not [0]: the gradient of an index zero-fills a [1, T, V] tensor (~80 ms at T=170 on CPU)
        return head(rows.unsqueeze(0)).squeeze(0), targets  # [T, V], [T]
    flat_labels = labels.reshape([-1])  # [B*S]
    index = paddle.nonzero(flat_labels != IGNORE_INDEX).reshape([-1])  # [T]
    targets = paddle.gather(flat_labels, index)  # [T]
    logits = _logits_of(model(**inputs, return_dict=True))  # [B, S, V]
    v = logits.shape[-1]
    return paddle.gather(logits.reshape([-1, v]), index, axis=0), targets  # [T, V], [T]


def token_loss_sum(logits: paddle.Tensor, targets: paddle.Tensor) -> paddle.Tensor:
    """Sum of the cross-entropies of ``logits`` [T, V] at ``targets`` [T], in float32 ([] ; 0 when T = 0)."""
    if targets.shape[0] == 0:  # no supervised token in this micro-batch: contributes 0, keeps the graph
        return logits.sum() * 0.0
    with paddle.amp.auto_cast(False):
        return F.cross_entropy(logits.astype("float32"), targets.unsqueeze(-1), reduction="sum")  # []


def global_scale(ranks: int, accumulation: int, global_tokens: int) -> float:
    """The factor that turns a micro-batch's loss sum into its share of the global token mean."""
    return float(ranks * accumulation) / max(int(global_tokens), 1)


def global_token_loss(model, inputs, global_tokens: int, ranks: int, accumulation: int) -> paddle.Tensor:
    """Scalar loss whose gradient, after PaddleNLP's /accumulation and the ranks' mean, is sum / N.

    ``inputs`` holds ``labels`` and the model's other inputs (ids, positions, mask).
    """
    model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
    return supervised_loss_sum(model, model_inputs, inputs["labels"]) * global_scale(ranks, accumulation, global_tokens)


def supervised_loss_sum(model, inputs, labels: paddle.Tensor) -> paddle.Tensor:
    """Sum of the token cross-entropies at the positions whose label is not -100 ([], float32).

    With a plain fp32 lm_head (``models.heads.plain_head_weight``) outside autocast, the head and the loss run
    together in chunks of tokens (``kernels.linear_cross_entropy``): the [T, V] logits and their gradient are
    never whole in memory.  Otherwise :func:`supervised_logits` + :func:`token_loss_sum`.
    """
    split = split_lm_head(model, router_aux=True)
    plain = plain_head_weight(split[1]) if split is not None else None
    if plain is None or plain[0].dtype != paddle.float32 or paddle.amp.is_autocast_enabled():
        return token_loss_sum(*supervised_logits(model, inputs, labels))
    rows, targets = _supervised_rows(model, split[0], inputs, labels)  # [T, H], [T]
    if targets.shape[0] == 0:  # no supervised token in this micro-batch: contributes 0, keeps the graph
        return rows.sum() * 0.0
    weight, transpose_y = plain
    return linear_cross_entropy_sum(rows, weight, targets, transpose_y)


def _supervised_rows(model, body, inputs, labels: paddle.Tensor):
    """(the body's hidden rows [T, H], their targets [T]) at the ``T`` positions whose label is not -100.

    On the decoder's rows the body's router logits go to ``model.record_moe_forward``, which records the aux loss
    and the expert counts exactly as the whole forward does (``training.moe_aux.add_aux_loss`` adds the aux loss
    to the loss afterwards)."""
    flat_labels = labels.reshape([-1])  # [B*S]
    index = paddle.nonzero(flat_labels != IGNORE_INDEX).reshape([-1])  # [T]
    out = body(**inputs, use_cache=False, return_dict=True)
    if hasattr(model, "record_moe_forward"):
        model.record_moe_forward(
            getattr(out, "router_logits", None),
            inputs.get("attention_mask"),
            inputs.get("input_ids"),
            inputs.get("inputs_embeds"),
        )
    hidden = out[0]  # [B, S, H]
    b, s, h = hidden.shape
    return paddle.gather(hidden.reshape([b * s, h]), index, axis=0), paddle.gather(flat_labels, index)


def shifts_labels_itself(model) -> bool:
    """The model's forward shifts ``labels`` again (codegen; the family table's ``shifts_labels``)."""
    from ..models.family_table import row

    family = row(getattr(getattr(model, "config", None), "model_type", None))
    return family is not None and family.shifts_labels


def token_mean_loss(model, inputs):
    """(token-mean cross-entropy over labels != -100, model outputs) with our already-shifted labels kept
    from the model: position i predicts labels[i].  For families that would shift them a second time."""
    labels = inputs["labels"]  # [B, S]
    outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, return_dict=True)
    logits = _logits_of(outputs)  # [B, S, V]
    flat = labels.reshape([-1])  # [B*S]
    index = paddle.nonzero(flat != IGNORE_INDEX).reshape([-1])  # [T]
    rows = paddle.gather(logits.reshape([-1, logits.shape[-1]]), index, axis=0)  # [T, V]
    total = token_loss_sum(rows, paddle.gather(flat, index))
    return total / max(int(index.shape[0]), 1), outputs
