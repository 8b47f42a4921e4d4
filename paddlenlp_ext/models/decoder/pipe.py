"""The decoder as a pipeline of stages (``pipeline_parallel_degree > 1``): fleet's ``PipelineLayer`` over our layers.

The model is flattened into one sequence, as PaddleNLP's ``LlamaForCausalLMPipe`` does: the embeddings, every
decoder layer, the final norm and the LM head; fleet cuts it into stages (whole decoder layers per stage when
they divide, ``seg_method="layer:DecoderLayerPipe"``) and each stage builds only its own part.  With tied
embeddings the first stage's table and the last stage's head are one ``SharedLayerDesc``: each stage holds a
copy, fleet broadcasts the first stage's at the start and all-reduces the two gradients after backward, so both
copies take the same step (the single model's embedding gradient is their sum).

What travels between stages is a tuple of tensors told apart by dtype (fleet sends no ``None``):
``(hidden [B, L, H] float, [mask [B | 1, 1, L, L] bool], [FlashMask start rows int32], position_ids [B, L]
int64)``.  The first stage reads its inputs the same way (``training/pp_step.py`` sends
``(input_ids, attention_mask, start rows, position_ids)``, with or without the ``None`` entries): a dense mask is
turned into the bool mask the layers use (``MaskPlan.allowed``), positions default to ``0 .. L-1``.

Parameter names are the plain model's (``gemma2.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``):
the prefixes given to ``add_sequential_layer`` are what PaddleNLP's ``PipelinePretrainedModel`` maps the stage's
keys with, so checkpoints, adapters and ``from_pretrained`` read the same names as on one device.

MoE rows: a stage's MoE layers route and combine as on one device and drop their router logits; the
load-balancing loss over every layer (transformers' multiplies means over all layers, not a sum of per-layer
terms) is not computed across stages, so pipeline stages with the aux loss on are refused (config time and
here: set ``router_aux_loss_coef`` 0), as is the bias update (its counts come from the whole model's forward).
"""

from __future__ import annotations

from typing import Optional, Tuple

import paddle
from paddle import nn
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc
from paddle.distributed.fleet.utils import recompute
from paddlenlp.transformers.model_utils import PipelinePretrainedModel

from .attention import MaskPlan
from .configuration import DecoderConfig
from .layers import norm_of, rotaries
from .modeling import DecoderLayer, DecoderLMHead, DecoderPretrainedModel

__all__ = ["DecoderForCausalLMPipe", "pipe_class_for"]


def _split(args) -> Tuple[paddle.Tensor, Optional[paddle.Tensor], Optional[paddle.Tensor], Optional[paddle.Tensor]]:
    """(first tensor, bool/float mask, int32 start rows, int64 positions) of a stage's input tuple."""
    if not isinstance(args, (tuple, list)):
        return args, None, None, None
    head, mask, startend, positions = args[0], None, None, None
    for a in args[1:]:
        if a is None:
            continue
        if a.dtype == paddle.int32:
            startend = a
        elif a.dtype == paddle.int64:
            positions = a
        else:  # bool or float: a dense mask
            mask = a
    return head, mask, startend, positions


def _pass(hidden, mask, startend, positions) -> tuple:
    out = [hidden]
    for t in (mask, startend, positions):
        if t is not None:
            t.stop_gradient = True
            out.append(t)
    return tuple(out)


class DecoderEmbeddingPipe(nn.Layer):
    """First stage: token ids -> embeddings (Gemma's sqrt(hidden) scale), plus the mask and positions."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.knobs = config.knobs()
        self.embed_tokens = nn.Embedding(self.knobs.vocab, self.knobs.hidden)

    @property
    def embedding_weight(self):
        return self.embed_tokens.weight

    def forward(self, args):
        ids, mask, startend, positions = _split(args)
        b, s = ids.shape
        x = self.embed_tokens(ids)  # [B, L, hidden]
        if self.knobs.arch.embed_scale:
            x = x * paddle.to_tensor(self.knobs.hidden**0.5, dtype="float32").astype(x.dtype)
        if positions is None:
            positions = paddle.arange(s, dtype="int64").unsqueeze(0).expand([b, s])
        if mask is not None:  # any dense form -> the bool [B | 1, 1, L, L] the layers read
            mask = MaskPlan(b, s, 0, mask, None, positions).allowed()
        return _pass(x, mask, startend, positions)


class DecoderLayerPipe(DecoderLayer):
    """One decoder layer of a stage (the same parameters and names as :class:`DecoderLayer`)."""

    def __init__(self, config: DecoderConfig, idx: int):
        k = config.knobs()
        super().__init__(k, idx)
        self.idx, self.config = idx, config
        tables, index = rotaries(k)
        self._rotary = None if index[idx] is None else tables[index[idx]]

    def forward(self, args):
        x, mask, startend, positions = _split(args)
        b, s = x.shape[0], x.shape[1]
        plan = MaskPlan(b, s, 0, mask, startend, positions)
        rope = None if self._rotary is None else self._rotary.tables(positions, x.dtype)
        if self.training and getattr(self.config, "recompute", False):
            plan.autograd_only = True  # see MaskPlan.autograd_only
            x, _, _ = recompute(super().forward, x, rope, plan, None, False, use_reentrant=False)
        else:
            x, _, _ = super().forward(x, rope, plan)
        return _pass(x, mask, startend, positions)


class DecoderNormPipe(nn.Layer):
    """Last stage: the final norm (named ``norm`` under the body, as in the plain model)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        k = config.knobs()
        self.norm = norm_of(k, k.hidden)

    def forward(self, args):
        return self.norm(_split(args)[0])


class DecoderLMHeadPipe(DecoderLMHead):
    """Last stage: the LM head; tied, its weight [vocab, hidden] is the first stage's table (shared)."""

    def __init__(self, config: DecoderConfig, tied: bool = False):
        k = config.knobs()
        if tied:  # a weight of the table's shape, kept equal to it by fleet's shared-weight broadcast / all-reduce
            super().__init__(k, paddle.create_parameter([k.vocab, k.hidden], dtype=paddle.get_default_dtype()))
            self.weight.tied_from = (
                f"{config.model_type}.embed_tokens.weight"  # what the streaming loader fills it from
            )
        else:
            super().__init__(k)

    @property
    def embedding_weight(self):
        return self.weight


class DecoderForCausalLMPipe(PipelinePretrainedModel, PipelineLayer):
    """The decoder of one ``model_type`` cut into pipeline stages (see the module docstring)."""

    config_class = DecoderConfig
    decoder_pipe = True  # read by models/loading.py: a stage streams only its own tensors
    _keys_to_ignore_on_load_unexpected = DecoderPretrainedModel._keys_to_ignore_on_load_unexpected
    _init_weights = DecoderPretrainedModel._init_weights
    _get_name_mappings = DecoderPretrainedModel._get_name_mappings
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: DecoderConfig):
        self.config = config
        k = config.knobs()
        if k.arch.mlp != "dense" and getattr(config, "output_router_logits", False):  # refused at config time too
            raise NotImplementedError(
                "the decoder's MoE stages do not pass router logits between stages, so the "
                "load-balancing loss over every layer cannot be computed; set "
                "router_aux_loss_coef=0 or pipeline_parallel_degree=1"
            )
        hcg = fleet.get_hybrid_communicate_group()
        if int(getattr(config, "tensor_parallel_degree", 1) or 1) > 1 or hcg.get_model_parallel_world_size() > 1:
            raise NotImplementedError(
                "the decoder's pipeline stages are not tensor parallel; use one of "
                "tensor_parallel_degree / pipeline_parallel_degree"
            )
        body, shared = config.model_type, f"{config.model_type}_shared_embedding"
        if k.tie:
            self.add_sequential_layer(
                SharedLayerDesc(shared, DecoderEmbeddingPipe, shared_weight_attr="embedding_weight", config=config),
                body,
            )
        else:
            self.add_sequential_layer(LayerDesc(DecoderEmbeddingPipe, config=config), body)
        for i in range(k.layers):
            self.add_sequential_layer(LayerDesc(DecoderLayerPipe, config=config, idx=i), f"{body}.layers.{i}")
        self.add_sequential_layer(LayerDesc(DecoderNormPipe, config=config), body)
        if k.tie:
            self.add_sequential_layer(
                SharedLayerDesc(
                    shared, DecoderLMHeadPipe, shared_weight_attr="embedding_weight", config=config, tied=True
                ),
                "lm_head",
            )
        else:
            self.add_sequential_layer(LayerDesc(DecoderLMHeadPipe, config=config), "lm_head")
        stages = hcg.topology().get_dim_size("pipe")
        PipelineLayer.__init__(
            self,
            layers=self.get_sequential_layers(),
            loss_fn=None,
            topology=hcg.topology(),
            seg_method="layer:DecoderLayerPipe" if k.layers % stages == 0 else "uniform",
            recompute_interval=0,
            num_virtual_pipeline_stages=int(getattr(config, "virtual_pp_degree", 1) or 1),
        )
        self.apply(self._init_weights)

    def moe_blocks(self) -> list:
        """The MoE blocks of this stage's layers (``freeze_router`` fixes their routers)."""
        from .moe import MoEBlock

        return [
            layer.feed_forward
            for layer in self.sublayers()
            if isinstance(layer, DecoderLayer) and isinstance(layer.feed_forward, MoEBlock)
        ]


_PIPES: dict = {}


def pipe_class_for(model_type: str) -> type:
    """``Gemma2ForCausalLMPipe`` etc.: the pipeline class of a decoder row (created once)."""
    if model_type not in _PIPES:
        from .modeling import classes_for

        config_cls = classes_for(model_type)[0]
        _PIPES[model_type] = type(
            f"{config_cls.__name__[: -len('Config')]}ForCausalLMPipe",
            (DecoderForCausalLMPipe,),
            {"config_class": config_cls, "__module__": __name__},
        )
    return _PIPES[model_type]
