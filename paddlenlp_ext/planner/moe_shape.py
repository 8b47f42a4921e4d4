"""Shapes of the decoder's mixture-of-experts rows (and DeepSeek's latent attention) for the planner, paddle-free.

A Llama-layout layer is the same in every layer; an MoE model's is not: some layers hold the sparse block
(``moe_spec.is_moe_layer``: ernie4_5_moe from ``moe_layer_start_index`` every ``moe_layer_interval``,
deepseek after ``first_k_dense_replace``, qwen2/3_moe on ``decoder_sparse_step`` outside ``mlp_only_layers``),
the others a dense MLP of ``intermediate_size``.  So an MoE row's :class:`~.shapes.ModelShape` carries one
:class:`LayerPlan` per layer: its Linear layers and its other parameters, each with a *role*:

    attn     attention (q/k/v/o, or MLA's q_a/q_b/kv_a/kv_b/o and their two latent norms), norms, biases, sinks
    mlp      the dense MLP of a dense layer
    router   the gate [H, E] (+ gpt_oss' bias), qwen2_moe's shared_expert_gate [H, 1]: replicated, never a target
    shared   the shared experts (qwen2_moe's shared_expert, ernie / deepseek's shared_experts): every token
    expert   the routed experts (E of them; a token uses top-k): what expert parallelism splits (E / EP per rank)

The names are the decoder's (``models/decoder/moe.py``: mixtral's ``block_sparse_moe.experts.J.w1``,
the others' ``mlp.experts.J.gate_proj``), so the family's target regexes pick the same Linears the run adapts or
quantizes.  gpt_oss' experts are 3-D parameters (``experts.gate_up_proj`` [E, H, 2I] ...), not Linears: they are
"other" parameters of role ``expert``.  Buffers (not parameters): the routers' ``e_score_correction_bias``
(deepseek_v3 [E], ernie4_5_moe [1, E], fp32) per MoE layer.

Parameters per token (``active``): everything but the (E - k) routed experts a token does not use per MoE layer.
Worked example, the tiny mixtral of tests/test_planner_moe.py (hidden 64, 4 heads / 2 kv heads, 2 layers,
4 experts top-2 of intermediate 96, vocab 128): an expert is 3 x 64 x 96 = 18,432; a layer 2 x 64 x 64 +
2 x 64 x 32 (attention) + 64 x 4 (router) + 4 x 18,432 + 2 x 64 (norms) = 86,400; total 2 x 86,400 +
2 x 128 x 64 + 64 = 189,248 (the loaded model's count); active 189,248 - 2 x 2 x 18,432 = 115,520.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

ROLES = ("attn", "mlp", "router", "shared", "expert")


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: ``linears`` (suffix, in, out, role) and ``others`` (what, parameters, role)."""

    linears: Tuple[Tuple[str, int, int, str], ...]
    others: Tuple[Tuple[str, int, str], ...]
    moe: bool = False  # holds the sparse block

    def params(self, role=None) -> int:
        """Parameters of the layer (of one ``role`` when given)."""
        return sum(i * o for _, i, o, r in self.linears if role in (None, r)) + sum(
            n for _, n, r in self.others if role in (None, r)
        )


@dataclass(frozen=True)
class MoEFacts:
    """What the planner reports of an MoE model (``ModelShape.moe``)."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int
    moe_layers: int
    fused_experts: bool  # gpt_oss: experts are 3-D parameters (no per-expert Linear; not split by EP here)
    #: fp32 elements of the routers' e_score_correction_bias buffers over the model (0: none)
    router_buffer_elements: int = 0


def _mlp(prefix: str, names, h: int, i: int, bias: bool, role: str):
    """(linears, others) of one SwiGLU MLP / expert: gate and up [h, i], down [i, h], biases when ``bias``."""
    g, u, d = names
    lin = ((f"{prefix}.{g}", h, i, role), (f"{prefix}.{u}", h, i, role), (f"{prefix}.{d}", i, h, role))
    return lin, (((f"{prefix} biases", 2 * i + h, role),) if bias else ())


def _attention(k) -> Tuple[tuple, tuple]:
    """(linears, others) of the attention of knobs ``k`` (``decoder/rows.Knobs``): plain or latent (MLA)."""
    h, a = k.hidden, k.arch
    lin, oth = [], []
    if k.mla is not None:
        m, qk = k.mla, k.mla.nope + k.mla.rope
        if m.q_lora_rank is None:
            lin.append(("self_attn.q_proj", h, k.heads * qk, "attn"))
        else:
            lin += [
                ("self_attn.q_a_proj", h, m.q_lora_rank, "attn"),
                ("self_attn.q_b_proj", m.q_lora_rank, k.heads * qk, "attn"),
            ]
            oth.append(("q_a_layernorm", m.q_lora_rank, "attn"))
            if k.qkv_bias:
                oth.append(("q_a_proj bias", m.q_lora_rank, "attn"))
        lin += [
            ("self_attn.kv_a_proj_with_mqa", h, m.kv_lora_rank + m.rope, "attn"),
            ("self_attn.kv_b_proj", m.kv_lora_rank, k.heads * (m.nope + m.v), "attn"),
            ("self_attn.o_proj", k.heads * m.v, h, "attn"),
        ]
        oth.append(("kv_a_layernorm", m.kv_lora_rank, "attn"))
        if k.qkv_bias:
            oth.append(("kv_a_proj_with_mqa bias", m.kv_lora_rank + m.rope, "attn"))
    else:
        q, kv = k.heads * k.head_dim, k.kv_heads * k.head_dim
        lin += [
            ("self_attn.q_proj", h, q, "attn"),
            ("self_attn.k_proj", h, kv, "attn"),
            ("self_attn.v_proj", h, kv, "attn"),
            ("self_attn.o_proj", q, h, "attn"),
        ]
        if k.qkv_bias:
            oth.append(("q/k/v biases", q + 2 * kv, "attn"))
        qk = {"head": 2 * k.head_dim, "proj": q + kv}.get(a.qk_norm or "", 0)
        if qk:
            oth.append(("q/k norms", qk, "attn"))
    if k.o_bias:
        oth.append(("o_proj bias", h, "attn"))
    if a.attn_sinks:
        oth.append(("attention sinks", k.heads, "attn"))
    oth.append(("layer norms", sum(n is not None for n in a.layer_norms) * h, "attn"))
    return tuple(lin), tuple(oth)


def moe_layer_plans(k, cfg: dict) -> Tuple[Tuple[LayerPlan, ...], MoEFacts]:
    """The per-layer plans and the MoE facts of an MoE row's knobs ``k`` and its config.json dict ``cfg``."""
    from ..models.decoder.moe_spec import is_moe_layer, moe_spec

    s = moe_spec(cfg)
    h, e = k.hidden, s.num_experts
    mlp_name = k.arch.mlp_name
    attn = _attention(k)
    plans, moe_layers, buffers = [], 0, 0
    for index in range(k.layers):
        lin, oth = list(attn[0]), list(attn[1])
        if not is_moe_layer(cfg, index):
            dl, do = _mlp("mlp", ("gate_proj", "up_proj", "down_proj"), h, k.intermediate, k.mlp_bias, "mlp")
            plans.append(LayerPlan(tuple(lin + list(dl)), tuple(oth + list(do))))
            continue
        moe_layers += 1
        p = mlp_name
        lin.append((f"{p}.{s.router_name}", h, e, "router"))
        if s.router_bias:
            oth.append(("router bias", e, "router"))
        if s.correction_bias:
            buffers += e
        if s.fused_experts:  # gate_up_proj [E, H, 2I] + bias [E, 2I], down_proj [E, I, H] + bias [E, H]
            i = s.intermediate_size
            oth.append(("fused experts", e * (h * 2 * i + 2 * i + i * h + h), "expert"))
        else:
            for j in range(e):
                el, eo = _mlp(f"{p}.experts.{j}", s.expert_names, h, s.intermediate_size, s.expert_bias, "expert")
                lin += el
                oth += eo
        if s.shared_intermediate_size:
            sl, so = _mlp(
                f"{p}.{s.shared_name}",
                ("gate_proj", "up_proj", "down_proj"),
                h,
                s.shared_intermediate_size,
                s.shared_expert_bias,
                "shared",
            )
            lin += sl
            oth += so
            if s.shared_gate:
                lin.append((f"{p}.shared_expert_gate", h, 1, "router"))
        plans.append(LayerPlan(tuple(lin), tuple(oth), moe=True))
    facts = MoEFacts(e, s.top_k, s.intermediate_size, s.shared_intermediate_size, moe_layers, s.fused_experts, buffers)
    return tuple(plans), facts


def act_intermediate(s) -> float:
    """Per token, the MLP width a layer computes, averaged over the layers: intermediate_size (dense); in an MoE
    layer top_k x the expert's + the shared experts' (a token passes through those only).

    Mixtral 8 x top-2 of 1408 on every layer: 2 x 1408 = 2816, as the equal-active dense model's intermediate."""
    if s.moe is None:
        return float(s.intermediate_size)
    moe = s.moe.top_k * s.moe.expert_intermediate + s.moe.shared_intermediate
    L = s.num_hidden_layers
    return (s.moe.moe_layers * moe + (L - s.moe.moe_layers) * s.intermediate_size) / L


#: per token and MoE layer, what the block keeps besides the experts' own activations (``decoder/moe.py``): the
#: rows gathered for the experts and the experts' outputs kept for the routing weights' gradient (top_k x hidden
#: each), and the router's logits and probabilities (E each; the aux loss reads the logits)
MOE_KEPT_PER_HIDDEN_K = 2.0
MOE_KEPT_PER_EXPERT = 2.0


def moe_dispatch_elements(s) -> float:
    """Elements per token the MoE block keeps on top of the experts' activations, averaged over the layers.

    Mixtral-0.5B of bench/moe.py (hidden 1024, 8 experts top-2, every layer MoE): 2 x 2 x 1024 + 2 x 8 = 4112."""
    if s.moe is None:
        return 0.0
    per = MOE_KEPT_PER_HIDDEN_K * s.moe.top_k * s.hidden_size + MOE_KEPT_PER_EXPERT * s.moe.num_experts
    return per * s.moe.moe_layers / s.num_hidden_layers
