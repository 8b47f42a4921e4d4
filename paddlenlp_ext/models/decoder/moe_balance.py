"""Load balancing of MoE routers: the auxiliary loss, per-layer expert load, DeepSeek-V3's bias update.

- :func:`load_balancing_loss` equals transformers' ``load_balancing_loss_func`` (Switch Transformer
  eq. 4-6, as mixtral/qwen3_moe/ernie4_5_moe/gpt_oss compute it): over every layer's router logits,
  ``E * sum_{j, e} f[j, e] * P[e]`` with ``f[j, e]`` the fraction of tokens whose j-th choice (top-k of the
  softmax) is expert e and ``P[e]`` the mean softmax probability of e, both over the real tokens only
  (``attention_mask`` [B, S], 1 = real token; for packed rows, the mask of the real tokens of all the
  documents of the row).
- :func:`expert_load` / :func:`load_stats`: the fraction of routed assignments per expert, and its
  max / mean (1.0 = perfectly balanced, E / k = every token on the same k experts), for logging.
- :func:`update_correction_bias`: DeepSeek-V3's auxiliary-loss-free balancing, ``b_e += rate *
  sign(mean_load - load_e)``, on the ``e_score_correction_bias`` buffer only.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import paddle
import paddle.nn.functional as F

__all__ = ["load_balancing_loss", "expert_load", "load_stats", "update_correction_bias"]


def _token_mask(attention_mask, n_tokens: int):
    """attention_mask [B, S] (bool/int/float) -> float32 [B*S] of 1 (real) / 0, checked against the logits."""
    m = paddle.to_tensor(attention_mask) if not isinstance(attention_mask, paddle.Tensor) else attention_mask
    if m.ndim != 2:
        raise ValueError(
            f"attention_mask must be [batch, seq] of 0/1 (got shape {list(m.shape)}); pass the "
            "2-D mask of real tokens, not an attention bias or a start-row mask"
        )
    m = m.astype("float32").reshape([-1])  # [B*S]
    if m.shape[0] != n_tokens:
        raise ValueError(f"attention_mask covers {m.shape[0]} tokens but a layer's router logits have {n_tokens} rows")
    return m


def load_balancing_loss(
    router_logits_per_layer: Sequence[paddle.Tensor], num_experts: int, top_k: int, attention_mask=None
) -> paddle.Tensor:
    """The auxiliary load-balancing loss (a float32 scalar) of ``router_logits_per_layer`` (one [B*S, E]
    tensor per MoE layer, as :class:`~.moe.MoEBlock` returns them), differentiable w.r.t. them.
    No layers: 0 (transformers returns 0 too).

    Worked example: one layer, 2 tokens, 2 experts, top-1, both tokens on expert 0 with p = (0.5+d, 0.5-d):
    f = (1, 0), P = (0.5+d, 0.5-d), loss = 2 * (0.5+d); d -> 0 gives 1.0 (the balanced value is also 1.0
    when f = (0.5, 0.5)).

    >>> z = paddle.to_tensor([[0.0, 0.0], [0.0, 0.0]])
    >>> round(float(load_balancing_loss([z], 2, 1)), 6)
    1.0
    >>> round(float(load_balancing_loss([z, z], 2, 1, attention_mask=[[1, 0]])), 6)  # 1 real token of 2
    1.0
    """
    if not router_logits_per_layer:
        return paddle.zeros([], "float32")
    n_layers = len(router_logits_per_layer)
    logits = paddle.concat([z.astype("float32") for z in router_logits_per_layer], axis=0)  # [N*T, E]
    probs = F.softmax(logits, axis=-1)  # [N*T, E]
    selected = paddle.topk(probs, top_k, axis=-1)[1]  # [N*T, k]
    chosen = F.one_hot(selected, num_experts)  # [N*T, k, E]
    if attention_mask is None:
        tokens_per_expert = chosen.mean(axis=0)  # [k, E]
        prob_per_expert = probs.mean(axis=0)  # [E]
    else:
        m = _token_mask(attention_mask, logits.shape[0] // n_layers)  # [T]
        m = paddle.tile(m, [n_layers])  # [N*T], layer-major as the logits are concatenated
        real = m.sum()
        tokens_per_expert = (chosen * m.reshape([-1, 1, 1])).sum(axis=0) / real  # [k, E]
        prob_per_expert = (probs * m.reshape([-1, 1])).sum(axis=0) / real  # [E]
    return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * num_experts


def expert_load(selected: paddle.Tensor, num_experts: int, attention_mask=None) -> paddle.Tensor:
    """Per-expert token-assignment counts [E] (float32) of one layer's choices ``selected`` [T, k]
    (``MoEBlock.last_selected``), counting only the real tokens when ``attention_mask`` [B, S] is given.

    >>> expert_load(paddle.to_tensor([[0, 1], [0, 2]]), 4).tolist()
    [2.0, 1.0, 1.0, 0.0]
    >>> expert_load(paddle.to_tensor([[0, 1], [0, 2]]), 4, attention_mask=[[1, 0]]).tolist()
    [1.0, 1.0, 0.0, 0.0]
    """
    onehot = F.one_hot(selected, num_experts).sum(axis=1)  # [T, E]
    if attention_mask is not None:
        onehot = onehot * _token_mask(attention_mask, selected.shape[0]).unsqueeze(-1)
    return onehot.sum(axis=0).astype("float32")  # [E]


def load_stats(counts: paddle.Tensor) -> Dict[str, object]:
    """Logging figures of one layer's expert load ``counts`` [E]: the fraction of assignments per expert,
    its max and mean, and max / mean (1.0 = balanced).

    >>> s = load_stats(paddle.to_tensor([2.0, 1.0, 1.0, 0.0]))
    >>> s["fraction"], s["max"], s["mean"], s["max_over_mean"]
    ([0.5, 0.25, 0.25, 0.0], 0.5, 0.25, 2.0)
    """
    c = counts.astype("float32").numpy()
    total = float(c.sum())
    frac = (c / total) if total > 0 else c
    mean = 1.0 / len(c)
    return {
        "fraction": [float(v) for v in frac],
        "max": float(frac.max()),
        "mean": mean,
        "max_over_mean": float(frac.max()) / mean if total > 0 else 0.0,
    }


def update_correction_bias(layer, expert_counts, rate: float) -> Optional[paddle.Tensor]:
    """DeepSeek-V3's bias balancing on one MoE layer: ``e_score_correction_bias += rate * sign(mean(load)
    - load)`` (overloaded experts are chosen less next step, idle ones more).  Touches that buffer only —
    never the gate weights, and records no gradient.  Returns the step applied ([E]), or None when the
    layer has no correction bias (mixtral, qwen, gpt_oss).

    >>> from paddlenlp_ext.models.decoder.moe import MoEBlock
    >>> from paddlenlp_ext.models.decoder.moe_spec import MoESpec
    >>> blk = MoEBlock(MoESpec("deepseek_v3", 8, 4, 2, 8, scoring="sigmoid", correction_bias="gate"))
    >>> [round(v, 4) for v in update_correction_bias(blk, paddle.to_tensor([6.0, 2.0, 0.0, 0.0]), 0.01).tolist()]
    [-0.01, 0.0, 0.01, 0.01]
    >>> [round(v, 4) for v in blk.correction_bias.tolist()]  # mean load 2: expert 1 is on target
    [-0.01, 0.0, 0.01, 0.01]
    """
    bias = getattr(layer, "correction_bias", None)
    if bias is None:
        return None
    with paddle.no_grad():
        load = paddle.to_tensor(expert_counts).astype("float32").reshape([-1])  # [E]
        if load.shape[0] != bias.numel():
            raise ValueError(f"expert_counts has {load.shape[0]} entries, the layer has {bias.numel()} experts")
        step = rate * paddle.sign(load.mean() - load)  # [E]
        bias.set_value(bias + step.reshape(bias.shape).astype(bias.dtype))
    return step
