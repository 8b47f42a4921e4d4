"""Which parameters a run holds, which of them train, and how many bytes the quantized ones take.

The accounting is a list of parameter groups per decoder layer (averaged over the layers, so a
target_modules regex that picks some layers only is spread evenly over pipeline stages) and per
model part (embeddings on the first pipeline stage, final norm and lm_head on the last, the
prefix encoder on the first).  Each group knows whether it trains, whether tensor parallelism
splits it, and -- for quantized linears -- its fixed storage in bytes.

Target layers follow the rules the run uses (``adapters.apply_adapters``: LoRA / VeRA / LoKr
target_modules matched with ``re.fullmatch`` against PaddleNLP's sublayer names, default
``models.targets``' decoder linears, which a quantized base replaces too).  What one adapted Linear adds
comes from the method's row of the paddle-free method table (``adapters.methods``: its saved shapes
minus its frozen tensors, and any shared tensors); the planner imports nothing else of ``adapters/``
(docs/architecture.md), so :class:`AdapterSpec` carries the few settings that size an adapter (an
``AdapterConfig`` has the same attributes and works as well).  Bytes of a
quantized linear follow ``quant.formats`` (codes + scales; numpy only, no paddle).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from ..adapters.methods import method as method_row  # paddle-free: the adapter method table
from ..models.targets import NEVER_TARGET_PARTS, decoder_linear_targets
from ..quant.formats import DEFAULT_DOUBLE_QUANT_BLOCK_SIZE, get_format
from .shapes import ModelShape, PlanError


@dataclass(frozen=True)
class QuantSpec:
    """``weight_quantize_algo`` and its block settings (QLoRA base)."""

    algo: str
    block_size: int = 64
    double_quant: bool = False
    double_quant_block_size: int = DEFAULT_DOUBLE_QUANT_BLOCK_SIZE


def quantized_linear_bytes(in_features: int, out_features: int, q: QuantSpec) -> int:
    """Codes + scales of one quantized ``[in, out]`` Linear, as ``quant.formats`` stores it (bias not counted).

    nf4 ``[4096, 4096]``, block 64: 4096 * 2048 codes + 4096 * 64 f32 scales = 9,437,184 bytes (0.5625 B/param);
    with double quant the scales are int8 + one f32 per 256 of them + one f32 offset: 8,654,852 (0.516 B/param).
    """
    fmt = get_format(q.algo)
    codes = out_features * fmt.packed_in(in_features)
    if not fmt.blockwise:
        return codes + 4 * out_features  # one f32 scale per output channel
    scales = out_features * fmt.num_blocks(in_features, q.block_size)
    if not q.double_quant:
        return codes + 4 * scales
    return codes + scales + 4 * math.ceil(scales / q.double_quant_block_size) + 4


@dataclass(frozen=True)
class AdapterSpec:
    """The settings that size an adapter: the attributes of ``adapters.config.AdapterConfig`` that matter here."""

    method: str  # lora | vera | lokr
    r: int = 8
    dropout: float = 0.0
    target_modules: Optional[Tuple[str, ...]] = None  # None: the family's decoder linears
    model_type: Optional[str] = None
    lokr_factor: int = -1
    lokr_decompose_both: bool = False
    pissa: bool = False

    @property
    def resolved_target_modules(self) -> List[str]:
        return list(self.target_modules) if self.target_modules else decoder_linear_targets(self.model_type)


@dataclass(frozen=True)
class Group:
    """``params`` parameters (per layer for layer groups) that train or not, split by TP or not."""

    what: str
    params: float
    trainable: bool
    tp_split: bool = True
    #: fixed storage (quantized codes + scales) instead of the run's weight dtype; total bytes of the group
    fixed_bytes: Optional[float] = None
    #: sliced by sharding stage 3: Paddle's GroupShardedStage3 slices every parameter above its segment size
    #: (2**20 elements) whether it trains or not; quantized weights are buffers, adapters and norms are small
    stage3: bool = False
    #: routed experts (and their adapters): expert parallelism keeps E / EP of them on each rank
    ep_split: bool = False


@dataclass
class ParamAccount:
    """Everything the memory model needs to know about the parameters of one run."""

    method: str  # full | lora | vera | lokr | prefix | eval
    layer_groups: List[Group] = field(default_factory=list)  # per decoder layer (averaged)
    first_groups: List[Group] = field(default_factory=list)  # on the first pipeline stage
    last_groups: List[Group] = field(default_factory=list)  # on the last pipeline stage
    every_groups: List[Group] = field(default_factory=list)  # a copy on every stage (VeRA's shared projections)
    num_layers: int = 0
    adapted_linears: int = 0
    quantized_linears: int = 0
    pissa: bool = False  # PiSSA initialises from an SVD of each whole weight (no tensor parallelism)
    #: extra activation elements per token and layer that the adapters save (x @ A, dropout copies)
    adapter_act_elements: float = 0.0
    #: input features per token and layer of the adapted linears whose dropout keeps a 1-byte mask
    adapter_dropout_mask_elements: float = 0.0
    notes: List[str] = field(default_factory=list)

    def _all(self):
        for g in self.layer_groups:
            yield g, self.num_layers
        for g in self.first_groups + self.last_groups + self.every_groups:
            yield g, 1

    @property
    def total_params(self) -> int:
        return int(round(sum(g.params * n for g, n in self._all())))

    @property
    def trainable_params(self) -> int:
        return int(round(sum(g.params * n for g, n in self._all() if g.trainable)))


def _match(patterns: Sequence[str], name: str) -> bool:
    return any(re.fullmatch(p, name) for p in patterns)


def lokr_params(r: int, in_f: int, out_f: int, factor: int = -1, decompose_both: bool = False) -> int:
    """Trainable parameters of one LoKr layer, by ``adapters.methods.lokr_shapes``' rule.

    >>> lokr_params(4, 64, 176)  # W1 [11, 8] + W2 = [16, 4] @ [4, 8]
    184
    """
    spec = AdapterSpec("lokr", r, lokr_factor=factor, lokr_decompose_both=decompose_both)
    return method_row("lokr").trainable_params(spec, in_f, out_f)


def adapter_params(adapter, in_f: int, out_f: int) -> int:
    """Trainable parameters that ``adapter`` (AdapterSpec or AdapterConfig) adds to one ``[in, out]`` Linear:
    the saved tensors of its method's row that train (``adapters.methods``)."""
    return method_row(adapter.method).trainable_params(adapter, in_f, out_f)


def account(
    shape: ModelShape,
    method: str,
    adapter=None,
    quant: Optional[QuantSpec] = None,
    prefix=None,
    fuse_qkv: bool = False,
    fuse_ffn: bool = False,
) -> ParamAccount:
    """The parameter groups of ``shape`` trained with ``method``.

    ``adapter``: an AdapterSpec / AdapterConfig (LoRA / VeRA / LoKr) or None; ``quant``: the quantized base or None;
    ``prefix``: a ``prefix.config.PrefixConfig`` for prefix tuning.  ``method`` "full" trains everything,
    "eval" nothing.  PlanError when target_modules match no Linear (the run would stop there too).
    """
    acc = ParamAccount(method=method, num_layers=shape.num_hidden_layers)
    full = method == "full"
    L = shape.num_hidden_layers
    quant_targets = decoder_linear_targets(shape.model_type) if quant else []
    adapter_targets = adapter.resolved_target_modules if adapter is not None else []
    adapted = quantized = 0
    # per kind of Linear ("" or "expert": what expert parallelism splits, "router": replicated under TP)
    q_bytes, q_params, frozen, trainable = {}, {}, {}, {}
    lora_elems = mask_elems = 0.0
    vera_in = vera_out = 0
    first_name = ""
    for index in range(L):
        for suffix, in_f, out_f, role in shape.layer_parts(index, fuse_qkv, fuse_ffn):
            kind = role if role in ("expert", "router") else ""
            name = shape.layer_name(index, suffix)
            first_name = first_name or name
            excluded = any(part in name for part in NEVER_TARGET_PARTS)
            if quant and not excluded and _match(quant_targets, name):
                q_bytes[kind] = q_bytes.get(kind, 0) + quantized_linear_bytes(in_f, out_f, quant)
                q_params[kind] = q_params.get(kind, 0) + in_f * out_f
                quantized += 1
            elif full:
                trainable[kind] = trainable.get(kind, 0) + in_f * out_f
            else:
                frozen[kind] = frozen.get(kind, 0) + in_f * out_f
            if adapter is not None and _match(adapter_targets, name):
                adapted += 1
                trainable[kind] = trainable.get(kind, 0) + adapter_params(adapter, in_f, out_f)
                vera_in, vera_out = max(vera_in, in_f), max(vera_out, out_f)
                # x @ A (LoRA / VeRA) is kept for backward; an expert sees only its tokens: top_k / E of them
                share = shape.moe.top_k / shape.moe.num_experts if role == "expert" and shape.moe else 1.0
                lora_elems += adapter.r * share
                if adapter.dropout > 0:
                    lora_elems += in_f * share  # the dropped-out copy of the input
                    mask_elems += in_f * share
    head_adapted = adapter is not None and shape.lm_head_params and _match(adapter_targets, "lm_head")
    if adapter is not None and adapted == 0 and not head_adapted:
        raise PlanError(
            f"target_modules {adapter_targets} match no Linear layer of this {shape.model_type} model "
            f"(re.fullmatch against names like {first_name!r}); "
            "the run would stop with the same error"
        )
    groups = acc.layer_groups
    label = {"": "", "expert": "expert ", "router": "router "}
    for kind in ("", "router", "expert"):
        ep, tp = kind == "expert", kind != "router"
        if frozen.get(kind):
            groups.append(Group(f"frozen {label[kind]}linears", frozen[kind] / L, False, tp, stage3=True, ep_split=ep))
        if trainable.get(kind):
            what = f"trainable {label[kind]}linears" if full else f"{label[kind]}adapters"
            groups.append(Group(what, trainable[kind] / L, True, tp, stage3=full, ep_split=ep))
        if q_params.get(kind):
            groups.append(
                Group(
                    f"quantized {label[kind]}linears",
                    q_params[kind] / L,
                    False,
                    tp,
                    fixed_bytes=q_bytes[kind] / L,
                    ep_split=ep,
                )
            )
    if shape.layer_plans:  # norms, biases, sinks, router biases; the fused experts of gpt_oss (3-D parameters)
        other = sum(n for p in shape.layer_plans for _, n, r in p.others if r != "expert")
        experts = sum(n for p in shape.layer_plans for _, n, r in p.others if r == "expert")
        groups.append(Group("norms and biases", other / L, full, tp_split=False))
        if experts:
            groups.append(Group("expert biases and fused experts", experts / L, full, stage3=full, ep_split=True))
    else:
        bias = shape.layer_other_params - shape.layer_norm_params
        if bias:
            groups.append(Group("q/k/v biases", bias, full))
        groups.append(Group("RMSNorm weights", shape.layer_norm_params, full, tp_split=False))
    acc.first_groups.append(Group("embeddings", shape.embedding_params, full, stage3=True))
    acc.last_groups.append(Group("final norm", shape.hidden_size, full, tp_split=False))
    if shape.lm_head_bias:
        acc.last_groups.append(Group("lm_head bias", shape.vocab_size, full))
    if shape.lm_head_params:
        acc.last_groups.append(Group("lm_head", shape.lm_head_params, full, stage3=True))
        if head_adapted:
            acc.last_groups.append(
                Group("lm_head adapter", adapter_params(adapter, shape.hidden_size, shape.vocab_size), True)
            )
            adapted += 1
    shared = method_row(adapter.method).shared_params(adapter, vera_in, vera_out) if adapter is not None else 0
    if shared:  # frozen, one copy per model (VeRA's projections A [r, max_in], B [max_out, r])
        title = method_row(adapter.method).title
        acc.every_groups.append(Group(f"{title} shared projections", shared, False, tp_split=False))
    if prefix is not None:
        acc.first_groups.append(Group("prefix encoder", prefix.trainable_params(), True, tp_split=False))
    acc.adapted_linears, acc.quantized_linears = adapted, quantized
    acc.pissa = adapter is not None and adapter.method == "lora" and adapter.pissa
    acc.adapter_act_elements, acc.adapter_dropout_mask_elements = lora_elems / L, mask_elems / L
    return acc
