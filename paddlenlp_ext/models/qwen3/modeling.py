"""Qwen3 (dense) on PaddleNLP's Qwen2 classes: per-head q/k RMSNorm, optional q/k/v/o bias, explicit head_dim.

What differs from PaddleNLP 3.0.0b4's Qwen2 (transformers' ``modeling_qwen3.py``
is the reference; ``tests/test_qwen3.py`` compares logits and greedy tokens):

* ``q_norm`` / ``k_norm``: an RMSNorm over ``head_dim`` (weight ``[head_dim]``)
  applied to every query / key head *before* the rotary embedding;
* ``head_dim`` comes from the config (may differ from ``hidden // heads``):
  ``q_proj`` ``[hidden, heads * head_dim]``, ``o_proj`` ``[heads * head_dim, hidden]``;
* no bias on q/k/v by default (``attention_bias``: bias on q/k/v/o, as transformers).

Everything else is Qwen2's own code, reused by subclassing: the attention
kernel (``scaled_dot_product_attention``: dense masks, and FlashMask start rows
through ``fusion_ops`` -- on the CPU our kernel via ``integrations.flashmask``),
rotary tables, MLP, decoder-layer / model / causal-LM forwards, recompute,
tensor-parallel linears and the TP split mappings, the LM head and criterion.
The Qwen2 pieces relied on are listed in ``integrations.qwen3.RELIED_ON``.

Parameter names: ``qwen3.embed_tokens.weight``, ``qwen3.layers.N.self_attn.{q,k,v,o}_proj.weight``,
``qwen3.layers.N.self_attn.{q,k}_norm.weight``, ``qwen3.layers.N.mlp.{gate,up,down}_proj.weight``,
``qwen3.layers.N.{input,post_attention}_layernorm.weight``, ``qwen3.norm.weight``, ``lm_head.weight``;
Linear weights are ``[in, out]`` as in every PaddleNLP model.
"""

from __future__ import annotations

from typing import Optional, Tuple

import paddle
from paddle import nn
from paddle.distributed.fleet.utils import recompute
from paddlenlp.transformers import linear_utils
from paddlenlp.transformers.conversion_utils import StateDictNameMapping, init_name_mappings
from paddlenlp.transformers.model_utils import PretrainedModel, register_base_model
from paddlenlp.transformers.qwen2.modeling import (
    Qwen2Attention,
    Qwen2DecoderLayer,
    Qwen2ForCausalLM,
    Qwen2LMHead,
    Qwen2MLP,
    Qwen2Model,
    Qwen2PretrainedModel,
    Qwen2PretrainingCriterion,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
    scaled_dot_product_attention,
)
from paddlenlp.transformers.refined_recompute import get_skip_recompute_ops

from .configuration import Qwen3Config
from .support import unsupported_settings

__all__ = ["Qwen3Attention", "Qwen3DecoderLayer", "Qwen3PretrainedModel", "Qwen3Model", "Qwen3ForCausalLM"]


class Qwen3HeadRMSNorm(nn.Layer):
    """RMSNorm over the last axis (``head_dim``), the same weight for every head.

    Under tensor parallelism each rank holds different heads, so each rank's
    weight gradient is a partial sum: the weight goes through the model-parallel
    ``identity`` (forward identity, backward all-reduce) to make it the full sum.
    Always unfused (``use_fused_rms_norm`` fuses the layer norms only; the math is the same).
    """

    def __init__(self, config: Qwen3Config, dim: int, mp_group=None):
        super().__init__()
        self.weight = paddle.create_parameter(
            shape=[dim], dtype=paddle.get_default_dtype(), default_initializer=nn.initializer.Constant(1.0)
        )
        self.variance_epsilon = config.rms_norm_eps
        self.mp_group = mp_group

    def forward(self, x):
        # x: [..., heads, head_dim]
        weight = self.weight
        if self.mp_group is not None and not weight.stop_gradient:
            from ...parallel.collectives import collectives_for

            weight = collectives_for(self.mp_group).identity(weight)
        with paddle.amp.auto_cast(False):  # as Qwen2RMSNorm: the statistics in fp32
            variance = x.astype("float32").pow(2).mean(-1, keepdim=True)
            x = paddle.rsqrt(variance + self.variance_epsilon) * x
        if weight.dtype in (paddle.float16, paddle.bfloat16):
            x = paddle.cast(x, weight.dtype)
        return x * weight


def _linear_classes(config):
    """(column, row) Linear classes of the attention, as Qwen2Attention chooses them (refined recompute aside)."""
    if config.sequence_parallel:
        return linear_utils.ColumnSequenceParallelLinear, linear_utils.RowSequenceParallelLinear
    return linear_utils.ColumnParallelLinear, linear_utils.RowParallelLinear


class Qwen3Attention(Qwen2Attention):
    """Qwen2's attention with per-head q/k RMSNorm and an explicit head_dim (forward: see the module docstring)."""

    def __init__(self, config: Qwen3Config, layerwise_recompute: bool = True, skip_recompute_ops=None):
        nn.Layer.__init__(self)  # Qwen2Attention.__init__ would build [hidden, hidden] projections
        problems = unsupported_settings(config)
        if problems:
            raise ValueError("Qwen3 does not support " + "; ".join(problems))
        self.config = config
        self.skip_recompute_ops = skip_recompute_ops or {}
        self.hidden_size = config.hidden_size
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        if self.num_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.gqa_or_mqa = self.num_heads != self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = config.rope_theta
        self.is_causal = True
        self.attention_dropout = config.attention_dropout
        self.seq_length = config.seq_length
        self.sequence_parallel = config.sequence_parallel
        self.fuse_attention_qkv = False
        self.enable_recompute = False  # set by the Trainer
        self.layerwise_recompute = layerwise_recompute
        self.recompute_granularity = config.recompute_granularity
        self.use_fused_rope = False  # the unfused rotary path (fused rope is GPU-only and untested here)
        bias = bool(config.attention_bias)
        q_out, kv_out = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        tp = config.tensor_parallel_degree
        mp_group = None
        if tp > 1:
            for what, n in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_key_value_heads)):
                if n % tp:
                    raise ValueError(f"{what}={n} is not a multiple of tensor_parallel_degree={tp}")
            self.num_heads //= tp
            self.num_key_value_heads //= tp
            column, row = _linear_classes(config)
            self.q_proj = column(self.hidden_size, q_out, has_bias=bias, gather_output=False)
            self.k_proj = column(self.hidden_size, kv_out, has_bias=bias, gather_output=False)
            self.v_proj = column(self.hidden_size, kv_out, has_bias=bias, gather_output=False)
            self.o_proj = row(q_out, self.hidden_size, has_bias=bias, input_is_parallel=True)
            mp_group = self.q_proj.model_parallel_group
        else:
            self.q_proj = linear_utils.Linear(self.hidden_size, q_out, bias_attr=bias)
            self.k_proj = linear_utils.Linear(self.hidden_size, kv_out, bias_attr=bias)
            self.v_proj = linear_utils.Linear(self.hidden_size, kv_out, bias_attr=bias)
            self.o_proj = linear_utils.Linear(q_out, self.hidden_size, bias_attr=bias)
        self.q_norm = Qwen3HeadRMSNorm(config, self.head_dim, mp_group)
        self.k_norm = Qwen3HeadRMSNorm(config, self.head_dim, mp_group)
        self.rotary_emb = Qwen2RotaryEmbedding(
            self.head_dim, max_position_embeddings=self.max_position_embeddings, base=self.rope_theta
        )
        self.attn_func = scaled_dot_product_attention

    def forward(
        self,
        hidden_states,
        position_ids: Optional[paddle.Tensor] = None,
        past_key_value: Optional[Tuple[paddle.Tensor]] = None,
        attention_mask: Optional[paddle.Tensor] = None,
        output_attentions: bool = False,
        use_cache: bool = False,
        attn_mask_startend_row_indices: Optional[paddle.Tensor] = None,
        **kwargs,
    ):
        """Qwen2Attention.forward with q_norm/k_norm between the head reshape and the rotary embedding."""
        if kwargs:  # nothing may be swallowed silently (Qwen2's signature has **kwargs)
            raise TypeError(f"Qwen3Attention.forward got unexpected arguments {sorted(kwargs)}")
        # [b, s, hidden] -> [b, s, heads, head_dim]  (sequence parallel: [s*b/n, hidden] -> [b, s, heads, head_dim])
        lead = [-1, self.seq_length] if self.sequence_parallel else [0, 0]
        query_states = self.q_norm(self.q_proj(hidden_states).reshape(lead + [self.num_heads, self.head_dim]))
        key_states = self.k_norm(self.k_proj(hidden_states).reshape(lead + [self.num_key_value_heads, self.head_dim]))
        value_states = self.v_proj(hidden_states).reshape(lead + [self.num_key_value_heads, self.head_dim])

        kv_seq_len = key_states.shape[-3]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-3]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        # [b, s_past + s, kv_heads, head_dim]
        if past_key_value is not None:
            key_states = paddle.concat([past_key_value[0], key_states], axis=1)
            value_states = paddle.concat([past_key_value[1], value_states], axis=1)
        past_key_value = (key_states, value_states) if use_cache else None

        if not self.config.use_flash_attention:  # the flash / FlashMask kernels take grouped kv heads as they are
            key_states = repeat_kv(key_states, self.num_key_value_groups)
            value_states = repeat_kv(value_states, self.num_key_value_groups)

        has_gradient = not (query_states.stop_gradient and key_states.stop_gradient and value_states.stop_gradient)
        args = (query_states, self.config, key_states, value_states, attention_mask, output_attentions)
        kw = dict(
            attn_mask_startend_row_indices=attn_mask_startend_row_indices,
            training=self.training,
            sequence_parallel=self.sequence_parallel,
        )
        if (
            self.enable_recompute
            and self.layerwise_recompute
            and has_gradient
            and self.recompute_granularity == "core_attn"
        ):
            outputs = recompute(self.attn_func, *args, use_reentrant=self.config.recompute_use_reentrant, **kw)
        else:
            outputs = self.attn_func(*args, **kw)
        attn_output, attn_weights = outputs if output_attentions else (outputs, None)

        # [b, s, heads * head_dim] -> [b, s, hidden]
        attn_output = self.o_proj(attn_output)
        out = (attn_output,)
        if output_attentions:
            out += (attn_weights,)
        if use_cache:
            out += (past_key_value,)
        return out[0] if len(out) == 1 else out


class Qwen3DecoderLayer(Qwen2DecoderLayer):
    """Qwen2's decoder layer (forward inherited) with :class:`Qwen3Attention`."""

    def __init__(self, config: Qwen3Config, layerwise_recompute: bool = False, skip_recompute_ops=None, mlp=None):
        nn.Layer.__init__(self)
        skip_recompute_ops = skip_recompute_ops or {}
        self.config = config
        self.skip_recompute_ops = skip_recompute_ops
        self.hidden_size = config.hidden_size
        self.self_attn = Qwen3Attention(config, layerwise_recompute, skip_recompute_ops=skip_recompute_ops)
        self.mlp = mlp if mlp is not None else Qwen2MLP(config, skip_recompute_ops=skip_recompute_ops)
        self.input_layernorm = Qwen2RMSNorm(config)
        self.post_attention_layernorm = Qwen2RMSNorm(config)
        self.enable_recompute = False
        self.layerwise_recompute = layerwise_recompute
        self.recompute_granularity = config.recompute_granularity


class Qwen3PretrainedModel(Qwen2PretrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "qwen3"
    _keys_to_ignore_on_load_unexpected = [r"self_attn.rotary_emb.inv_freq"]

    @classmethod
    def _mlp_linear_names(cls, config, layer_idx: int) -> tuple:
        """The Linear layers of decoder layer ``layer_idx``'s MLP (Qwen3-MoE's sparse layers differ)."""
        return ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

    @classmethod
    def _get_name_mappings(cls, config: Qwen3Config) -> list:
        """transformers' names -> ours (PaddleNLP's ``convert_from_torch``): ``model.`` -> ``qwen3.``, Linear
        weights transposed."""
        model_mappings = [["embed_tokens.weight"], ["norm.weight"]]
        for i in range(config.num_hidden_layers):
            pre = f"layers.{i}."
            for name in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                *cls._mlp_linear_names(config, i),
            ):
                model_mappings.append([f"{pre}{name}.weight", None, "transpose"])
                if config.attention_bias and name.startswith("self_attn"):
                    model_mappings.append([f"{pre}{name}.bias"])
            for name in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm"):
                model_mappings.append([f"{pre}{name}.weight"])
        init_name_mappings(mappings=model_mappings)
        if not any(a.endswith("Model") for a in (config.architectures or [])):
            for mapping in model_mappings:
                mapping[0] = "model." + mapping[0]
                mapping[1] = f"{cls.base_model_prefix}." + mapping[1]
            if not config.tie_word_embeddings:
                model_mappings.append(["lm_head.weight", "lm_head.weight", "transpose"])
        return [StateDictNameMapping(*m, index=i) for i, m in enumerate(model_mappings)]


@register_base_model
class Qwen3Model(Qwen3PretrainedModel, Qwen2Model):
    """Qwen2Model (forward, masks, recompute inherited) with :class:`Qwen3DecoderLayer` layers."""

    def __init__(self, config: Qwen3Config, decoder_layer=None):
        """``decoder_layer(i, layerwise_recompute=, skip_recompute_ops=)`` builds layer i (Qwen3-MoE's differ)."""
        PretrainedModel.__init__(self, config)
        decoder_layer = decoder_layer or (lambda i, **kw: Qwen3DecoderLayer(config, **kw))
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.sequence_parallel = config.sequence_parallel
        self.recompute_granularity = config.recompute_granularity
        self.no_recompute_layers = config.no_recompute_layers if config.no_recompute_layers is not None else []
        self.enable_recompute = False
        if config.tensor_parallel_degree > 1 and config.vocab_size % config.tensor_parallel_degree == 0:
            from paddle.distributed.fleet import meta_parallel as mpu

            self.embed_tokens = mpu.VocabParallelEmbedding(
                self.vocab_size,
                self.hidden_size,
                weight_attr=paddle.ParamAttr(initializer=nn.initializer.XavierNormal()),
            )
        else:
            self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size)
        self.layers = nn.LayerList(
            [
                decoder_layer(
                    i,
                    layerwise_recompute=i not in self.no_recompute_layers,
                    skip_recompute_ops=get_skip_recompute_ops(config, i),
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = Qwen2RMSNorm(config)


class Qwen3ForCausalLM(Qwen3PretrainedModel, Qwen2ForCausalLM):
    """Qwen2ForCausalLM (forward, generation hooks inherited) over :class:`Qwen3Model`, held as ``self.qwen3``
    (the attribute is ``base_model_prefix``: ``qwen3_moe`` for Qwen3-MoE)."""

    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: Qwen3Config, body=None):
        PretrainedModel.__init__(self, config)
        body = body if body is not None else Qwen3Model(config)
        setattr(self, self.base_model_prefix, body)
        if config.tie_word_embeddings:
            self.lm_head = Qwen2LMHead(config, embedding_weights=body.embed_tokens.weight, transpose_y=True)
            self.tie_weights()
        else:
            self.lm_head = Qwen2LMHead(config)
        self.criterion = Qwen2PretrainingCriterion(config)
        self.vocab_size = config.vocab_size

    @property
    def qwen2(self):
        # Qwen2ForCausalLM's forward and embedding accessors call ``self.qwen2``: the body is ``self.qwen3``
        return getattr(self, self.base_model_prefix)

    def set_decoder(self, decoder):
        setattr(self, self.base_model_prefix, decoder)
