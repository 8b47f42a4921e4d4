"""The sparse mixture-of-experts block of the decoder's MoE rows (mixtral, qwen2_moe, qwen3_moe,
ernie4_5_moe, deepseek_v2, deepseek_v3, gpt_oss), computing what each ``modeling_<type>.py`` of transformers 4.55 does.

Build it from a transformers config: ``MoEBlock.from_config(config)`` (routing and expert forms in
:mod:`.moe_spec`, layers in :mod:`.moe_experts`).  ``forward(hidden [B, L, H])`` returns
``(hidden [B, L, H], router_logits [B*L, E])`` — for gpt_oss the second is the router's scores (softmax of
the top-k logits, zeros elsewhere), which is what transformers records as gpt_oss' ``router_logits``, so
:func:`~.moe_balance.load_balancing_loss` on it equals transformers' aux loss.

Grouped compute: the T*k (token, slot) assignments are sorted by expert (one stable argsort), the token
rows gathered once in that order, and each expert runs one matmul chain over its contiguous slice; an
expert with no tokens is skipped (never called).  The only loop is over experts; the only host read is the
E per-expert counts (slice sizes depend on the data).  The outputs are put back in (token, slot) order,
weighted and summed over the k slots.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from .moe_experts import MoEStatics, Router, SwiGLUExpert, build_experts
from .moe_spec import MoESpec, moe_spec

__all__ = ["MoEBlock", "route", "group_limited_mask"]


def group_limited_mask(scores, n_group: int, topk_group: int, group_score: str = "top2_sum"):
    """1.0 for the experts in each token's ``topk_group`` best groups (a group scores by the sum of its
    2 best experts, or with ``group_score="max"`` by its best one), else 0.0; ``scores`` [T, E] -> [T, E].

    >>> s = paddle.to_tensor([[0.9, 0.8, 0.1, 0.2, 0.5, 0.6]])  # 3 groups of 2: sums 1.7, 0.3, 1.1
    >>> group_limited_mask(s, 3, 2).tolist()
    [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]
    >>> group_limited_mask(paddle.to_tensor([[0.9, 0.0, 0.1, 0.2, 0.5, 0.6]]), 3, 1, "max").tolist()  # best 0.9
    [[1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    """
    t, e = scores.shape
    grouped = scores.reshape([t, n_group, e // n_group])  # [T, G, E/G]
    if group_score == "max":
        group_scores = grouped.max(axis=-1)  # [T, G]
    else:
        group_scores = paddle.topk(grouped, 2, axis=-1)[0].sum(axis=-1)  # [T, G]
    best = paddle.topk(group_scores, topk_group, axis=-1)[1]  # [T, topk_group]
    keep = F.one_hot(best, n_group).sum(axis=1)  # [T, G]
    return keep.unsqueeze(-1).expand([t, n_group, e // n_group]).reshape([t, e])  # [T, E]


def route(logits, spec: MoESpec, correction_bias=None):
    """Routing of ``logits`` [T, E] (float32) under ``spec``: ``(weights [T, k], selected [T, k] int64,
    router_output [T, E])``.  Weights stay differentiable w.r.t. the logits; the choice is not.

    >>> spec = MoESpec("mixtral", 4, 4, 2, 8)
    >>> w, sel, out = route(paddle.to_tensor([[0.0, 2.0, 1.0, 0.0]]), spec)
    >>> sel.tolist(), [round(v, 4) for v in w[0].tolist()]
    ([[1, 2]], [0.7311, 0.2689])
    """
    if spec.scoring == "topk_softmax":  # gpt_oss: softmax over the k best logits only
        top, selected = paddle.topk(logits, spec.top_k, axis=-1)  # [T, k]
        weights = F.softmax(top, axis=-1)  # [T, k]
        scores = (F.one_hot(selected, spec.num_experts) * weights.unsqueeze(-1)).sum(axis=1)  # [T, E]
        return weights, selected, scores
    probs = F.sigmoid(logits) if spec.scoring == "sigmoid" else F.softmax(logits, axis=-1)  # [T, E]
    choice = probs.detach()
    if correction_bias is not None:
        choice = choice + correction_bias.reshape([1, -1])  # [T, E]; biases the choice, never the weights
    if spec.n_group > 1:
        # deepseek: experts outside the best groups score 0 (not -inf), as transformers masks them
        choice = choice * group_limited_mask(choice, spec.n_group, spec.topk_group, spec.group_score)
    if correction_bias is None and spec.n_group == 1:
        weights, selected = paddle.topk(probs, spec.top_k, axis=-1)  # [T, k] each
    else:
        selected = paddle.topk(choice, spec.top_k, axis=-1)[1]  # [T, k]
        weights = paddle.take_along_axis(probs, selected, axis=-1)  # [T, k]
    if spec.norm_topk_prob:
        weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=spec.norm_min)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, selected, logits


class MoEBlock(nn.Layer):
    """Router + routed experts (+ shared experts) of one decoder layer; see the module docstring.

    Sublayers, by transformers' names: the router ``gate`` (gpt_oss: ``router``), the experts
    ``experts.J.<gate>/<up>/<down>`` (gpt_oss: ``experts.gate_up_proj`` ... 3-D), ``shared_expert`` +
    ``shared_expert_gate`` (qwen2_moe) or ``shared_experts`` (ernie4_5_moe, deepseek_v2/v3), ernie's
    ``moe_statics.e_score_correction_bias``, deepseek's ``gate.e_score_correction_bias``.

    After each forward, ``last_selected`` holds the chosen experts ``[T, k]`` (int64, no gradient) for
    the load statistics and the bias update of :mod:`.moe_balance`.
    """

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.spec = spec
        h, e = spec.hidden_size, spec.num_experts
        router = Router(h, e, bias=spec.router_bias, correction_bias=spec.correction_bias == "gate",
                        fp32=spec.router_fp32)
        setattr(self, spec.router_name, router)
        if spec.correction_bias == "moe_statics":
            self.moe_statics = MoEStatics(e)
        self.experts = build_experts(spec)
        if spec.shared_intermediate_size:
            setattr(self, spec.shared_name, SwiGLUExpert(h, spec.shared_intermediate_size, spec.hidden_act,
                                                         spec.shared_expert_bias))
            if spec.shared_gate:
                self.shared_expert_gate = nn.Linear(h, 1, bias_attr=False)
        # a plain dict, not a Tensor attribute: Paddle would register a Tensor attribute as a buffer
        self.routing_state = {"selected": None}
        # parallel/expert.py's ExpertParallel when expert_parallel_degree > 1 (this rank then holds E/N experts)
        self.expert_parallel = None

    @classmethod
    def from_config(cls, config: Any, model_type: Optional[str] = None) -> "MoEBlock":
        """The block of a transformers config (object or dict) of ``model_type`` (default its own)."""
        return cls(moe_spec(config, model_type))

    @property
    def last_selected(self) -> Optional[paddle.Tensor]:
        """The experts chosen by the last forward, [T, k] int64 (no gradient), or None before any."""
        return self.routing_state["selected"]

    @property
    def gate_layer(self) -> Router:
        """The router (sublayer ``gate``, gpt_oss' ``router``)."""
        return getattr(self, self.spec.router_name)

    @property
    def correction_bias(self) -> Optional[paddle.Tensor]:
        """The ``e_score_correction_bias`` buffer (deepseek [E], ernie [1, E]) or None."""
        if self.spec.correction_bias == "gate":
            return self.gate_layer.e_score_correction_bias
        if self.spec.correction_bias == "moe_statics":
            return self.moe_statics.e_score_correction_bias
        return None

    def router_parameters(self):
        """The router's trainable parameters (weight, and gpt_oss' bias): what ``freeze_router`` fixes."""
        return [p for p in (self.gate_layer.weight, self.gate_layer.bias) if p is not None]

    def run_expert(self, e: int, x):
        """Routed expert ``e`` (global id) on its tokens ``x`` [t, H] -> [t, H] (t > 0: never called without
        tokens)."""
        if self.spec.fused_experts:
            return self.experts.expert_forward(e, x)
        if self.expert_parallel is not None:  # this rank holds experts local.start.. as experts.0..
            e -= self.expert_parallel.local.start
        return self.experts[e](x)

    def run_sorted(self, xs, counts):
        """``xs`` [sum(counts), H], rows sorted by expert (``counts`` [E] host ints) -> each row's expert
        output, same order; experts with no rows are never called."""
        pieces, start = [], 0
        for e in np.flatnonzero(counts).tolist():
            n = int(counts[e])
            pieces.append(self.run_expert(e, xs[start:start + n]))  # [n_e, H]
            start += n
        return paddle.concat(pieces, axis=0)  # [T*k, H] in expert order

    def forward(self, hidden_states):
        b, l, h = hidden_states.shape
        if self.training and self.spec.jitter_noise > 0:  # mixtral: multiplicative noise on the input
            j = self.spec.jitter_noise
            hidden_states = hidden_states * paddle.uniform(hidden_states.shape, hidden_states.dtype, 1 - j, 1 + j)
        x = hidden_states.reshape([-1, h])  # [T, H]
        logits = self.gate_layer(x)  # [T, E]
        weights, selected, router_out = route(logits.astype("float32"), self.spec, self.correction_bias)
        self.routing_state["selected"] = selected.detach()
        out = self._grouped(x, weights.astype(x.dtype), selected)  # [T, H]
        if self.spec.shared_intermediate_size:
            shared = getattr(self, self.spec.shared_name)(x)  # [T, H]
            if self.spec.shared_gate:
                shared = F.sigmoid(self.shared_expert_gate(x)) * shared  # [T, 1] * [T, H]
            out = out + shared
        return out.reshape([b, l, h]), router_out

    def _grouped(self, x, weights, selected):
        """sum_j weights[t, j] * expert_{selected[t, j]}(x[t]), one expert call per expert with tokens.
        x [T, H], weights [T, k], selected [T, k] -> [T, H]."""
        t, k = selected.shape
        if t == 0:
            return paddle.zeros_like(x)
        flat = selected.reshape([-1])  # [T*k] expert of each (token, slot)
        order = paddle.argsort(flat, stable=True)  # [T*k] (token, slot) pairs grouped by expert
        counts = paddle.bincount(flat, minlength=self.spec.num_experts).numpy()  # [E] on the host: slice sizes
        xs = paddle.gather(x, order // k)  # [T*k, H] token rows in expert order
        if self.expert_parallel is not None:  # dispatch to the experts' ranks and combine back (parallel/expert.py)
            ys = self.expert_parallel.run(self, xs, counts)  # [T*k, H] in expert order
        else:
            ys = self.run_sorted(xs, counts)  # [T*k, H] in expert order
        back = paddle.gather(ys, paddle.argsort(order)).reshape([t, k, -1])  # [T, k, H] in (token, slot) order
        return (back * weights.unsqueeze(-1)).sum(axis=1)  # [T, H]
