"""The KTO loss (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization").

With ``r = log pi(y|x) - log pi_ref(y|x)`` (summed answer log-probs) and the KL reference point
``z0 = max(0, mean_j(log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)))`` over the batch's mismatched
pairs (completion of example j-1 scored after the prompt of example j), detached::

    desirable:    w_d * (1 - sigmoid(beta * (r - z0)))
    undesirable:  w_u * (1 - sigmoid(beta * (z0 - r)))

The loss is the mean over examples (TRL's ``KTOTrainer`` and PaddleNLP's ``kto_loss``).  The
implied reward is ``beta * r``.  At initialization (policy == reference) ``r = 0`` and
``z0 = 0``, so every term is ``0.5 * weight``.
"""

from __future__ import annotations

from typing import Dict, Optional

import paddle
import paddle.nn.functional as F

__all__ = ["kl_reference_point", "kto_loss", "kto_metrics"]


def kl_reference_point(kl_logps, ref_kl_logps, reduce_over_ranks: bool = False):
    """z0: the mean KL estimate of the mismatched pairs, clamped at 0, without gradient.

    ``kl_logps``, ``ref_kl_logps``: ``[N]`` summed log-probs of the mismatched completions under
    the policy and the reference.  ``reduce_over_ranks``: average over every data-parallel
    rank's pairs (TRL gathers the KL terms of all processes the same way).

    >>> float(kl_reference_point(paddle.to_tensor([-3.0, -5.0]), paddle.to_tensor([-4.0, -2.0])))
    0.0
    """
    diff = (kl_logps.astype("float32") - ref_kl_logps.astype("float32")).detach()  # [N]
    total = diff.sum().reshape([1])  # [1]
    count = paddle.to_tensor([float(diff.shape[0])], dtype="float32")  # [1]
    if reduce_over_ranks and paddle.distributed.get_world_size() > 1:
        both = paddle.concat([total, count])  # [2]
        paddle.distributed.all_reduce(both)
        total, count = both[:1], both[1:]
    return (total / paddle.clip(count, min=1.0)).clip(min=0.0).reshape([])  # []


def kto_loss(
    logps, ref_logps, labels, z0, *, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
):
    """Per-example KTO losses ``[N]`` and rewards ``beta * r`` ``[N]`` (detached).

    ``logps``, ``ref_logps``: ``[N]`` summed completion log-probs (policy, reference);
    ``labels``: ``[N]`` (bool or 0/1: desirable); ``z0``: scalar from :func:`kl_reference_point`.

    >>> loss, _ = kto_loss(paddle.zeros([2]), paddle.zeros([2]), paddle.to_tensor([1, 0]), paddle.zeros([]),
    ...                    beta=0.1, desirable_weight=1.0, undesirable_weight=2.0)
    >>> [round(v, 4) for v in loss.tolist()]
    [0.5, 1.0]
    """
    r = logps.astype("float32") - ref_logps.astype("float32")  # [N]
    z0 = z0.astype("float32").detach()  # []
    desirable = labels.astype("bool")  # [N]
    loss_d = float(desirable_weight) * (1.0 - F.sigmoid(beta * (r - z0)))  # [N]
    loss_u = float(undesirable_weight) * (1.0 - F.sigmoid(beta * (z0 - r)))  # [N]
    return paddle.where(desirable, loss_d, loss_u), (beta * r).detach()  # [N], [N]


def _mean_where(values, mask) -> Optional[float]:
    n = int(mask.astype("int64").sum())
    if n == 0:
        return None
    return float((values * mask.astype("float32")).sum()) / n


def kto_metrics(losses, rewards, logps, labels, z0) -> Dict[str, float]:
    """Per-label means as python floats (TRL / PaddleNLP names).

    rewards/chosen, logps/chosen, loss/chosen over the desirable examples; rewards/rejected,
    logps/rejected, loss/rejected over the undesirable ones (a label absent from the batch is left
    out, so averages over micro-batches only count the batches that had it); kl (z0) and
    count/chosen, count/rejected.
    """
    d = labels.astype("bool")  # [N]
    u = paddle.logical_not(d)  # [N]
    out: Dict[str, float] = {"kl": float(z0)}
    for name, mask in (("chosen", d), ("rejected", u)):
        out[f"count/{name}"] = float(int(mask.astype("int64").sum()))
        for key, values in (("rewards", rewards), ("logps", logps), ("loss", losses)):
            value = _mean_where(values.astype("float32").detach(), mask)
            if value is not None:
                out[f"{key}/{name}"] = value
    return out
