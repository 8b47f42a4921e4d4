"""Qwen3-MoE: Qwen3's attention with a sparse mixture of experts in place of the MLP (transformers' ``qwen3_moe``).

Layer ``i`` uses the sparse block unless ``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``
(then Qwen2's dense MLP with ``intermediate_size``).  The sparse block, for tokens ``x`` [T, H]:

    probs   = softmax(x @ gate, fp32)                       # [T, E]
    w, idx  = top_k(probs, num_experts_per_tok)             # [T, k]; renormalised to sum 1 if norm_topk_prob
    out[t]  = sum_j w[t, j] * expert_idx[t, j](x[t])        # each expert: down(silu(gate(x)) * up(x))

Each expert runs only on the tokens routed to it.  Parameter names follow transformers' with our prefix:
``qwen3_moe.layers.N.mlp.gate.weight`` ([H, E]) and ``qwen3_moe.layers.N.mlp.experts.J.{gate,up,down}_proj.weight``.
The router's load-balancing loss (``output_router_logits``) is not implemented and refused, as are tensor /
sequence parallelism (``support.unsupported_settings``); transformers trains without the loss by default too.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from paddlenlp.transformers import linear_utils
from paddlenlp.transformers.model_utils import register_base_model
from paddlenlp.transformers.qwen2.modeling import Qwen2MLP

from .configuration import Qwen3Config
from .modeling import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model, Qwen3PretrainedModel

__all__ = ["Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock", "Qwen3MoeModel", "Qwen3MoeForCausalLM"]


class Qwen3MoeConfig(Qwen3Config):
    """Qwen3Config + the experts' keys (transformers' names and defaults)."""

    model_type = "qwen3_moe"

    def __init__(
        self,
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_experts=128,
        norm_topk_prob=False,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        mlp_only_layers=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.decoder_sparse_step = int(decoder_sparse_step)
        self.moe_intermediate_size = int(moe_intermediate_size)
        self.num_experts_per_tok = int(num_experts_per_tok)
        self.num_experts = int(num_experts)
        self.norm_topk_prob = bool(norm_topk_prob)
        self.output_router_logits = bool(output_router_logits)
        self.router_aux_loss_coef = router_aux_loss_coef
        self.mlp_only_layers = list(mlp_only_layers or [])


class Qwen3MoeExpert(nn.Layer):
    """One expert: ``down(silu(gate(x)) * up(x))`` with ``moe_intermediate_size``."""

    def __init__(self, config: Qwen3MoeConfig):
        super().__init__()
        h, inter = config.hidden_size, config.moe_intermediate_size
        self.gate_proj = linear_utils.Linear(h, inter, bias_attr=False)
        self.up_proj = linear_utils.Linear(h, inter, bias_attr=False)
        self.down_proj = linear_utils.Linear(inter, h, bias_attr=False)

    def forward(self, x):
        # x: [t, H] -> [t, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MoeSparseMoeBlock(nn.Layer):
    """Top-k routed experts (see the module docstring)."""

    def __init__(self, config: Qwen3MoeConfig):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (
            config.num_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
        )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}")
        self.gate = linear_utils.Linear(config.hidden_size, self.num_experts, bias_attr=False)
        self.experts = nn.LayerList([Qwen3MoeExpert(config) for _ in range(self.num_experts)])

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape([-1, shape[-1]])  # [T, H]
        router_logits = self.gate(x)  # [T, E]
        probs = F.softmax(router_logits.astype("float32"), axis=-1)  # [T, E]
        weights, selected = paddle.topk(probs, self.top_k, axis=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdim=True)
        weights = weights.astype(x.dtype)
        out = paddle.zeros_like(x)  # [T, H]
        chosen = selected.numpy()  # routing is data-dependent: which experts run is decided on the host
        for e in sorted(set(chosen.reshape(-1).tolist())):
            tok, slot = (chosen == e).nonzero()  # tokens routed to e, and at which of their k slots
            tok_t = paddle.to_tensor(tok, dtype="int64")
            w = paddle.gather_nd(weights, paddle.to_tensor(np.stack([tok, slot], axis=1), dtype="int64"))  # [t]
            y = self.experts[e](paddle.gather(x, tok_t)) * w.unsqueeze(-1)  # [t, H]
            out = paddle.index_add(out, tok_t, 0, y)  # out[tok] += y
        return out.reshape(shape)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def __init__(
        self, config: Qwen3MoeConfig, layer_idx: int, layerwise_recompute: bool = False, skip_recompute_ops=None
    ):
        mlp = (
            Qwen3MoeSparseMoeBlock(config)
            if is_sparse_layer(config, layer_idx)
            else Qwen2MLP(config, skip_recompute_ops=skip_recompute_ops)
        )
        super().__init__(config, layerwise_recompute, skip_recompute_ops, mlp=mlp)


def is_sparse_layer(config: Qwen3MoeConfig, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` has the sparse block (else the dense MLP), as transformers decides."""
    return (
        layer_idx not in config.mlp_only_layers
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoePretrainedModel(Qwen3PretrainedModel):
    config_class = Qwen3MoeConfig
    base_model_prefix = "qwen3_moe"

    @classmethod
    def _mlp_linear_names(cls, config, layer_idx: int) -> tuple:
        if not is_sparse_layer(config, layer_idx):
            return super()._mlp_linear_names(config, layer_idx)
        return ("mlp.gate",) + tuple(
            f"mlp.experts.{j}.{p}" for j in range(config.num_experts) for p in ("gate_proj", "up_proj", "down_proj")
        )


@register_base_model
class Qwen3MoeModel(Qwen3MoePretrainedModel, Qwen3Model):
    def __init__(self, config: Qwen3MoeConfig):
        Qwen3Model.__init__(self, config, decoder_layer=lambda i, **kw: Qwen3MoeDecoderLayer(config, i, **kw))


class Qwen3MoeForCausalLM(Qwen3MoePretrainedModel, Qwen3ForCausalLM):
    def __init__(self, config: Qwen3MoeConfig):
        Qwen3ForCausalLM.__init__(self, config, body=Qwen3MoeModel(config))
