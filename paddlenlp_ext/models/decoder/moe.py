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

Tensor parallel (``tp``, N ranks): the router, its correction bias and qwen2_moe's shared-expert gate are
replicated (every rank routes every token identically, so the aux loss, the expert load and the bias update
are one process's); every routed and shared expert is split like the dense MLP (:mod:`.moe_experts`), so each
rank runs the same experts on the same tokens over its 1/N of their intermediate size.  The combine is linear:
the ranks' partial expert outputs are weighted and summed first and ONE all-reduce per block completes them
(:meth:`MoEBlock._tensor_parallel`); when an adapter wraps an expert's Linear, that layer's own forward runs
instead (its row-parallel all-reduce per expert), which computes the same.  Under sequence
parallelism the block gathers its rank's tokens first (an all-gather whose backward keeps this rank's rows of
its own, already complete, gradient) and hands back this rank's rows of the output (``seq_scatter``).
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

    #: DecoderLayer passes the sequence-parallel padding (``MaskPlan.sp_pad``) to the block's forward
    takes_sp_pad = True

    def __init__(self, spec: MoESpec, tp=None):
        super().__init__()
        self.spec, self.tp = spec, tp
        # the experts see every token of the block (gathered under sequence parallelism): plain column/row layers
        expert_tp = None if tp is None else type(tp)(tp.group, False)
        h, e = spec.hidden_size, spec.num_experts
        router = Router(
            h, e, bias=spec.router_bias, correction_bias=spec.correction_bias == "gate", fp32=spec.router_fp32
        )
        setattr(self, spec.router_name, router)
        if spec.correction_bias == "moe_statics":
            self.moe_statics = MoEStatics(e)
        self.experts = build_experts(spec, expert_tp)
        if spec.shared_intermediate_size:
            setattr(
                self,
                spec.shared_name,
                SwiGLUExpert(h, spec.shared_intermediate_size, spec.hidden_act, spec.shared_expert_bias, tp=expert_tp),
            )
            if spec.shared_gate:
                self.shared_expert_gate = nn.Linear(h, 1, bias_attr=False)
        # a plain dict, not a Tensor attribute: Paddle would register a Tensor attribute as a buffer
        self.routing_state = {"selected": None}
        # decoder/expert_parallel.py's ExpertParallel when expert_parallel_degree > 1 (this rank then holds E/N experts)
        self.expert_parallel = None

    @classmethod
    def from_config(cls, config: Any, model_type: Optional[str] = None, tp=None) -> "MoEBlock":
        """The block of a transformers config (object or dict) of ``model_type`` (default its own); ``tp``: the
        decoder's :class:`~paddlenlp_ext.parallel.layers.TPContext` (None: one device)."""
        return cls(moe_spec(config, model_type), tp)

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

    def run_expert(self, e: int, x, partial: bool = False):
        """Routed expert ``e`` (global id) on its tokens ``x`` [t, H] -> [t, H] (t > 0: never called without
        tokens).  ``partial`` (tensor parallel): this rank's share of the output, before the all-reduce and the
        down bias."""
        if self.spec.fused_experts:
            return self.experts.expert_forward(e, x, partial)
        if self.expert_parallel is not None:  # this rank holds experts local.start.. as experts.0..
            e -= self.expert_parallel.local.start
        return self.experts[e].partial(x) if partial else self.experts[e](x)

    def run_sorted(self, xs, counts, partial: bool = False):
        """``xs`` [sum(counts), H], rows sorted by expert (``counts`` [E] host ints) -> each row's expert
        output, same order; experts with no rows are never called.

        One ``split`` into the experts' runs, not one slice each: a slice's backward writes its gradient into a
        zero-filled [T*k, H] tensor (E of them, then summed), a split's backward is one concat."""
        used = np.flatnonzero(counts).tolist()
        sizes = [int(counts[e]) for e in used]
        runs = paddle.split(xs, sizes, axis=0) if len(sizes) > 1 else [xs]  # [n_e, H] each, expert order
        pieces = [
            self.run_expert(e, rows, True) if partial else self.run_expert(e, rows) for e, rows in zip(used, runs)
        ]
        return paddle.concat(pieces, axis=0) if len(pieces) > 1 else pieces[0]  # [T*k, H] in expert order

    def _one_all_reduce(self) -> bool:
        """Tensor parallel with every expert a plain split MLP (no adapter wraps one of its Linears): the ranks'
        partial expert outputs are combined first and summed by ONE all-reduce per block (the combine is linear).
        An adapter keeps its layer's own forward: then each expert all-reduces its output itself."""
        if self.tp is None or self.spec.fused_experts:
            return self.tp is not None
        from ...parallel.layers import ParallelLinear
        from ...quant.parallel_linear import QuantizedParallelLinear

        experts = list(self.experts)
        if self.spec.shared_intermediate_size:
            experts.append(getattr(self, self.spec.shared_name))
        return all(
            isinstance(getattr(ex, n), (ParallelLinear, QuantizedParallelLinear)) for ex in experts for n in ex.names
        )

    def forward(self, hidden_states, sp_pad: int = 0):
        """``hidden_states`` [B, L, H] -> ([B, L, H], router output [B*L, E]).  Sequence parallel: this rank's
        rows [(B*L + sp_pad) / N, H] of the tokens (``sp_pad`` zero rows at the end of the last ranks) -> this
        rank's rows of the output, and the router output of every token."""
        if self.tp is None or not self.tp.sequence_parallel:
            return self._forward(hidden_states)
        comm, h = self.tp.comm, hidden_states.shape[-1]
        # every rank's rows, [T + sp_pad, H]; the flat all-gather's backward keeps this rank's part of its own
        # gradient, which is already complete (replicated router, experts whose column inputs sum the ranks')
        full = comm.all_gather(hidden_states.reshape([1, -1])).reshape([-1, h])
        t = full.shape[0] - sp_pad
        out, router_out = self._forward(full[:t].unsqueeze(0))  # [1, T, H]
        out = out.reshape([t, h])
        if sp_pad:
            out = paddle.concat([out, paddle.zeros([sp_pad, h], dtype=out.dtype)], axis=0)
        return comm.seq_scatter(out), router_out  # this rank's rows; the backward gathers the complete gradient

    def _forward(self, hidden_states):
        b, l, h = hidden_states.shape
        if self.training and self.spec.jitter_noise > 0:  # mixtral: multiplicative noise on the input
            j = self.spec.jitter_noise
            hidden_states = hidden_states * paddle.uniform(hidden_states.shape, hidden_states.dtype, 1 - j, 1 + j)
        x = hidden_states.reshape([-1, h])  # [T, H]
        logits = self.gate_layer(x)  # [T, E]
        weights, selected, router_out = route(logits.astype("float32"), self.spec, self.correction_bias)
        self.routing_state["selected"] = selected.detach()
        weights = weights.astype(x.dtype)
        if self._one_all_reduce():
            return self._tensor_parallel(x, weights, selected).reshape([b, l, h]), router_out
        out = self._grouped(x, weights, selected)  # [T, H]
        if self.spec.shared_intermediate_size:
            shared = getattr(self, self.spec.shared_name)(x)  # [T, H]
            if self.spec.shared_gate:
                shared = F.sigmoid(self.shared_expert_gate(x)) * shared  # [T, 1] * [T, H]
            out = out + shared
        return out.reshape([b, l, h]), router_out

    def _tensor_parallel(self, x, weights, selected):
        """The block's output [T, H] from the replicated tokens ``x`` [T, H] and routing, with ONE all-reduce:
        sum_j w[t, j] * partial_e(x[t]) (+ the gated shared expert's partial) summed over the ranks, then the down
        biases (replicated) weighted the same way.  ``identity`` on the experts' input and on the combine's weights
        sums the ranks' partial gradients of both (each rank's partial outputs see 1/N of the intermediate units);
        the biases' term uses the weights as they are (its gradient is already complete on every rank)."""
        comm = self.tp.comm
        xe = comm.identity(x)  # [T, H]
        out = self._grouped(xe, comm.identity(weights), selected, partial=True)  # [T, H], this rank's share
        gate = None
        if self.spec.shared_intermediate_size:
            shared = getattr(self, self.spec.shared_name)
            part = shared.partial(xe)  # [T, H]
            if self.spec.shared_gate:
                gate = F.sigmoid(self.shared_expert_gate(x))  # [T, 1], replicated
                part = comm.identity(gate) * part
            out = out + part
        out = comm.all_reduce(out)  # [T, H] complete
        if self.spec.fused_experts:
            down_bias = self.experts.down_proj_bias  # [E, H]
        elif self.spec.expert_bias:
            down_bias = paddle.stack([ex.down_bias() for ex in self.experts])  # [E, H]
        else:
            down_bias = None
        if down_bias is not None:
            t, k = selected.shape
            picked = paddle.gather(down_bias, selected.reshape([-1])).reshape([t, k, -1])  # [T, k, H]
            out = out + (picked.astype(out.dtype) * weights.unsqueeze(-1)).sum(axis=1)
        if self.spec.shared_intermediate_size and shared.down_bias() is not None:
            b = shared.down_bias().astype(out.dtype)
            out = out + (b if gate is None else gate * b)
        return out

    def _grouped(self, x, weights, selected, partial: bool = False):
        """sum_j weights[t, j] * expert_{selected[t, j]}(x[t]), one expert call per expert with tokens.
        x [T, H], weights [T, k], selected [T, k] -> [T, H] (``partial``: of each expert's partial output)."""
        t, k = selected.shape
        if t == 0:
            return paddle.zeros_like(x)
        flat = selected.reshape([-1])  # [T*k] expert of each (token, slot)
        order = paddle.argsort(flat, stable=True)  # [T*k] (token, slot) pairs grouped by expert
        counts = paddle.bincount(flat, minlength=self.spec.num_experts).numpy()  # [E] on the host: slice sizes
        xs = paddle.gather(x, order // k)  # [T*k, H] token rows in expert order
        if (
            self.expert_parallel is not None
        ):  # dispatch to the experts' ranks and combine back (decoder/expert_parallel.py)
            ys = self.expert_parallel.run(self, xs, counts)  # [T*k, H] in expert order
        else:
            ys = self.run_sorted(xs, counts, partial)  # [T*k, H] in expert order
        back = paddle.gather(ys, paddle.argsort(order)).reshape([t, k, -1])  # [T, k, H] in (token, slot) order
        return (back * weights.unsqueeze(-1)).sum(axis=1)  # [T, H]
