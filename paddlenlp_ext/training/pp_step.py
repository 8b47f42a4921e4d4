"""Fine-tuning under pipeline parallelism: the pipeline's inputs and the last stage's loss.

With ``pipeline_parallel_degree > 1`` PaddleNLP's Trainer does not call
``compute_loss``: ``training_pipeline_step`` collects the
``gradient_accumulation_steps`` micro-batches of one step, turns them into
``[first-stage inputs, last-stage inputs]`` with the model's
``_prepare_pipeline_inputs_func``, and fleet's ``PipelineParallel`` runs them,
applying the model's criterion on the last stage and dividing each
micro-batch's loss by the accumulation steps.

:func:`pipeline_inputs` is that function for our batches: the first stage
gets ``(input_ids, attention_mask, attn_mask_startend_row_indices,
position_ids)`` (FlashMask start rows as int32 and positions as int64:
PaddleNLP's pipeline layers tell them apart by dtype), the last stage
``(labels, N)`` with ``N`` the label tokens of the micro-batch's whole global
batch (``data.global_batches``).  :class:`PipelineCriterion` then returns
``sum of the micro-batch's token losses x ranks x accumulation / N`` -- the
same normalization as ``training.loss.global_token_loss``, so a pipeline run
follows the one global order and one normalization of every other layout.
Without ``N`` (evaluation) it returns the micro-batch's token mean.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Union

import paddle
import paddle.nn as nn

from ..data.global_batches import GLOBAL_TOKENS_KEY
from .loss import IGNORE_INDEX, global_scale, token_loss_sum
from .trainer import REAL_TOKENS_KEY

__all__ = ["FIRST_STAGE_KEYS", "pipeline_inputs", "PipelineCriterion", "install_pipeline_training"]

FIRST_STAGE_KEYS = ("input_ids", "attention_mask", "attn_mask_startend_row_indices", "position_ids")
#: what a stage never needs: the trainer counts the real tokens (training_pipeline_step) before the pipeline
NOT_SENT = (REAL_TOKENS_KEY,)
_DTYPES = {"attn_mask_startend_row_indices": "int32", "position_ids": "int64"}


def _cast(key: str, value: Any) -> Any:
    dtype = _DTYPES.get(key)
    if dtype is None or value is None or not isinstance(value, paddle.Tensor):
        return value
    return value.astype(dtype) if value.dtype != getattr(paddle, dtype) else value


def pipeline_inputs(batches: Union[Dict[str, Any], Sequence[Dict[str, Any]]]) -> List[Any]:
    """``[first-stage tuple, last-stage inputs]`` from one batch (a dict) or a step's micro-batches (a list).

    Worked example (two micro-batches; ``real_tokens`` is counted by the trainer, not sent):

    >>> micro = [{"input_ids": "A0", "labels": "L0", "global_label_tokens": 9, "real_tokens": "R0"},
    ...          {"input_ids": "A1", "labels": "L1", "global_label_tokens": 9, "real_tokens": "R1"}]
    >>> pipeline_inputs(micro)
    [(['A0', 'A1'], None, None, None), (['L0', 'L1'], [9, 9])]
    >>> pipeline_inputs({"input_ids": "A", "labels": "L"})
    [('A', None, None, None), 'L']
    """
    known = set(FIRST_STAGE_KEYS) | {"labels", GLOBAL_TOKENS_KEY, *NOT_SENT}
    for b in [batches] if isinstance(batches, dict) else batches:
        unknown = sorted(set(b) - known)
        if unknown:  # a key no stage would receive: refuse rather than train without it
            raise ValueError(
                f"pipeline parallel: the batch has keys no pipeline stage takes: {unknown} "
                f"(the first stage takes {list(FIRST_STAGE_KEYS)}, the last labels)"
            )
    if isinstance(batches, dict):
        first = tuple(_cast(k, batches.get(k)) for k in FIRST_STAGE_KEYS)
        labels, n = batches.get("labels"), batches.get(GLOBAL_TOKENS_KEY)
        return [first, labels if n is None else (labels, n)]
    micro = list(batches)

    def column(key: str):
        values = [_cast(key, b.get(key)) for b in micro]
        return None if all(v is None for v in values) else values

    first = tuple(column(k) for k in FIRST_STAGE_KEYS)
    labels, n = column("labels"), column(GLOBAL_TOKENS_KEY)
    return [first, labels if n is None else (labels, n)]


class PipelineCriterion(nn.Layer):
    """The last stage's loss: ``(logits [B, S, V], labels [B, S] or (labels, N))`` -> [].

    ``ranks`` x ``accumulation`` / ``N`` undoes the pipeline's division by the accumulation steps
    and the data-parallel mean, as in ``training.loss.global_token_loss``."""

    def __init__(self, ranks: int, accumulation: int):
        super().__init__()
        self.ranks, self.accumulation = int(ranks), int(accumulation)

    def forward(self, logits: paddle.Tensor, target: Any) -> paddle.Tensor:
        labels, n = target if isinstance(target, (tuple, list)) else (target, None)
        flat = labels.reshape([-1])  # [B*S]
        index = paddle.nonzero(flat != IGNORE_INDEX).reshape([-1])  # [T]
        v = logits.shape[-1]
        rows = paddle.gather(logits.reshape([-1, v]), index, axis=0)  # [T, V]
        total = token_loss_sum(rows, paddle.gather(flat, index))  # []
        if n is None:
            return total / max(int(index.shape[0]), 1)
        return total * global_scale(self.ranks, self.accumulation, int(n))


def install_pipeline_training(model: Any, ranks: int, accumulation: int) -> None:
    """Make a pipeline model take :func:`pipeline_inputs` and compute :class:`PipelineCriterion`."""
    from ..integrations.paddlenlp_pipe import set_pipeline_inputs, set_pipeline_loss

    set_pipeline_loss(model, PipelineCriterion(ranks, accumulation))
    set_pipeline_inputs(model, pipeline_inputs)
