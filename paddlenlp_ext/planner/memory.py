"""The memory model: bytes per device of one training step, for one parallel layout.

    peak = weights + gradients + optimizer states
           + max(activations + logits, step temporaries) + framework overhead

Gradients stay allocated between steps (PaddleNLP's Trainer calls ``clear_grad()``, which zeroes
them in place unless ``release_grads``), so they coexist with the next step's activations.  The
step temporaries come after backward, when the activations are gone: Paddle's single-process
``ClipGradByGlobalNorm`` returns a new gradient for every parameter (``max_grad_norm`` > 0 and no
hybrid parallelism; fleet's hybrid-parallel clip scales in place), and on a CPU run the final save
copies the weights (one shard of at most 4 GB) to numpy.

Measured on this repository's CPU runs (bench/plan_memory.py, docs/parallel.md) and derived for GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from .moe_shape import act_intermediate, moe_dispatch_elements
from .params import ParamAccount
from .shapes import ModelShape, PlanError

GiB = 2**30

# Activation elements kept for backward per token and decoder layer, measured on Paddle 3.3.1 CPU with
# PaddleNLP 3.0.0b4's Llama (fp32, eager attention; RSS after forward minus before, 2 vs 4 layers): least
# squares over 6 shapes (hidden 1024/2048, intermediate 2048-5504, 8/16 heads, kv heads 4-16, seq 256/512),
# every point within 3.5%.  0.84B shape at 256 tokens: 49,792 elements = 48.6 MiB per layer in fp32.
ACT_PER_HIDDEN = 10.75
ACT_PER_KV = 3.5
ACT_PER_INTERMEDIATE = 3.0
ACT_PER_SCORE = 1.0  # x heads x key length: the softmax output of eager attention (none with flash attention)
#: of the hidden-sized ones: input, fp32-normalised and output of the two RMSNorms, replicated on every TP rank
#: (the rest -- q, rope, attention output -- is split by heads)
ACT_REPLICATED_HIDDEN = 6.0
#: of the 6: the fp32 internals of PaddleNLP's unfused RMSNorm (x cast to fp32 and the normalised x),
#: which stay 4 bytes under AMP
ACT_FP32_NORM_HIDDEN = 4.0
#: the MLP half of a layer (for recompute_granularity full_attn): the second norm and gate/up/act
ACT_MLP_HIDDEN = 3.0
#: fp32 copies of the logits alive at the loss: the logits (cast to fp32) and the softmax kept for backward
#: (measured 2.05 copies at 256 tokens x 32000)
LOGIT_FP32_COPIES = 2

#: RSS of the Paddle 3.3.1 + PaddleNLP 3.0.0b4 runtime before the model exists (imports, tokenizer, tokenized
#: alpaca_en_demo): 0.52 GiB in every run of bench/plan_memory.py (run_summary.json rss_before_model_bytes)
CPU_RUNTIME_BYTES = int(0.52 * GiB)
#: Not measured here (no GPU): the CUDA context with cuBLAS/cuDNN loaded (~0.5-0.8 GiB on A100/H100) and
#: allocator slack, plus NCCL buffers when more than one device takes part
GPU_CONTEXT_BYTES = int(1.0 * GiB)
GPU_NCCL_BYTES = int(0.5 * GiB)
#: the final save of a full fine-tune converts one shard (max_shard_size "4GB") to numpy
SAVE_SHARD_BYTES = 4 * 10**9

#: optimizer state bytes per trainable parameter (PaddleNLP's ``optim`` names, paddlenlp/utils/optimizer.py):
#: AdamW keeps two fp32 moments; Adam-mini one fp32 moment (the second is one value per tensor);
#: adamw_16bit_moment two 16-bit moments
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw_custom": 8, "adamw_mini": 4, "adamw_16bit_moment": 4}
MASTER_WEIGHT_BYTES = 4  # O2: the optimizer's fp32 copy of every trainable 16-bit parameter

BREAKDOWN_KEYS = (
    "weights",
    "gradients",
    "optimizer_states",
    "activations",
    "logits",
    "step_temporaries",
    "framework_overhead",
)


@dataclass(frozen=True)
class Layout:
    """A parallel layout: devices = tp * pp * sharding_degree * dp."""

    tp: int = 1
    pp: int = 1
    sharding_stage: int = 0  # 0 = no sharding
    sharding_degree: int = 1
    dp: int = 1
    offload: bool = False  # "stage2 offload" / "stage3 offload" / offload_optim: optimizer states on the host
    #: expert_parallel_degree: the routed experts split over EP of the data-parallel / sharding ranks (each holds
    #: E / EP of them); it adds no device (PaddleFormers' meaning)
    ep: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.sharding_degree * self.dp

    @property
    def hybrid(self) -> bool:
        """PaddleNLP runs fleet's hybrid-parallel optimizer (in-place gradient clip) when any degree > 1."""
        return self.tp > 1 or self.pp > 1 or (self.sharding_stage > 0 and self.sharding_degree > 1)

    def describe(self) -> str:
        parts = []
        if self.sharding_stage and self.sharding_degree > 1:
            parts.append(
                f"sharding stage{self.sharding_stage} x{self.sharding_degree}" + (" offload" if self.offload else "")
            )
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        if self.dp > 1:
            parts.append(f"DP {self.dp}")
        if self.ep > 1:
            parts.append(f"EP {self.ep}")
        n = self.devices
        return f"{n} device{'s' if n > 1 else ''}" + (f" ({', '.join(parts)})" if parts else "")

    def config_keys(self) -> Dict[str, object]:
        """The config keys that select this layout (``sharding`` "" when not sharded)."""
        stage = f"stage{self.sharding_stage}" + (" offload" if self.offload else "") if self.sharding_stage else ""
        keys = {
            "tensor_parallel_degree": self.tp,
            "pipeline_parallel_degree": self.pp,
            "sharding": stage,
            "sharding_parallel_degree": self.sharding_degree if self.sharding_stage else -1,
        }
        if self.ep > 1:
            keys["expert_parallel_degree"] = self.ep
        return keys


@dataclass
class PlanInputs:
    """What the memory of a training step depends on (built from a RunConfig by ``planner.run``)."""

    shape: ModelShape
    params: ParamAccount
    target: str = "gpu"  # gpu | cpu
    precision: str = "fp32"  # fp32 | bf16 | fp16
    amp_level: str = "O1"  # O1: fp32 weights + autocast; O2: 16-bit weights + fp32 master copy
    amp_master_grad: bool = False
    optim: str = "adamw"
    batch: int = 1  # per_device_train_batch_size (the micro-batch)
    seq: int = 2048  # max_length: every row padded or packed to it (the worst case)
    grad_accum: int = 1
    recompute: bool = False
    recompute_granularity: str = "full"
    no_recompute_layers: int = 0
    flash_attention: bool = False
    prefix_tokens: int = 0
    fused_linear_cross_entropy: bool = False
    tensor_parallel_output: bool = False
    sequence_parallel: bool = False
    max_grad_norm: float = 1.0
    release_grads: bool = False
    do_train: bool = True

    @property
    def amp(self) -> bool:
        return self.precision in ("bf16", "fp16") and self.amp_level in ("O1", "O2")

    @property
    def weight_bytes(self) -> int:
        return 2 if self.amp and self.amp_level == "O2" else 4

    @property
    def grad_bytes(self) -> int:
        return 4 if self.amp_master_grad else self.weight_bytes

    @property
    def act_bytes(self) -> int:
        return 2 if self.amp else 4


@dataclass
class Estimate:
    """Bytes per device of one training step; ``breakdown`` keys are ``BREAKDOWN_KEYS``."""

    per_device_bytes: int
    breakdown: Dict[str, int]
    assumptions: List[str]
    layout: Layout
    inputs: PlanInputs
    stage: str = "only"  # the pipeline stage that peaks: only | first | last
    facts: Dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, object]:
        return {
            "per_device_bytes": self.per_device_bytes,
            "breakdown": dict(self.breakdown),
            "assumptions": list(self.assumptions),
            "layout": {**asdict(self.layout), "devices": self.layout.devices},
            "target": self.inputs.target,
            "peak_stage": self.stage,
            **self.facts,
        }


def _group_bytes(groups, n, inp: PlanInputs, tp: int, ep: int = 1):
    """(weight bytes, trainable params, bytes that sharding stage 3 slices) of ``groups`` repeated ``n`` times
    on one TP rank (and one EP rank: E / ``ep`` of the routed experts)."""
    w = tparams = sliced = 0.0
    for g in groups:
        div = (tp if g.tp_split else 1) * (ep if g.ep_split else 1)
        b = g.fixed_bytes if g.fixed_bytes is not None else g.params * inp.weight_bytes
        w += n * b / div
        if g.trainable:
            tparams += n * g.params / div
        if g.stage3:
            sliced += n * b / div
    return w, tparams, sliced


def layer_activation_elements(inp: PlanInputs, tp: int) -> Dict[str, float]:
    """Activation elements per token of one decoder layer on one TP rank, by part."""
    s, p = inp.shape, inp.params
    h, k, i = s.hidden_size, s.kv_dim, act_intermediate(s)
    keys = inp.seq + inp.prefix_tokens  # prefix tuning puts its key/values in front of every layer's keys
    repl = ACT_REPLICATED_HIDDEN * h / (tp if inp.sequence_parallel else 1)
    attn = (ACT_PER_HIDDEN - ACT_REPLICATED_HIDDEN) * h + ACT_PER_KV * k * keys / inp.seq
    scores = 0.0 if inp.flash_attention else ACT_PER_SCORE * s.num_attention_heads * keys
    return {
        "replicated": repl,
        "attn": attn / tp,
        "mlp": ACT_PER_INTERMEDIATE * i / tp + moe_dispatch_elements(s),
        "scores": scores / tp,
        "adapters": p.adapter_act_elements / tp,
        "hidden": h / (tp if inp.sequence_parallel else 1),
    }


def activation_bytes(inp: PlanInputs, tp: int, layers: int, in_flight: int) -> float:
    """Activations kept by ``layers`` decoder layers for ``in_flight`` micro-batches, plus what backward adds."""
    if layers == 0:
        return 0.0
    e = layer_activation_elements(inp, tp)
    b = inp.act_bytes
    norm_extra = (4 - b) * ACT_FP32_NORM_HIDDEN * inp.shape.hidden_size / (tp if inp.sequence_parallel else 1)
    score_bytes = 4 + (2 if inp.amp else 0)  # softmax in fp32, plus its 16-bit copy under AMP
    mask = inp.params.adapter_dropout_mask_elements / tp  # 1-byte dropout masks
    full = (e["replicated"] + e["attn"] + e["mlp"] + e["adapters"]) * b + norm_extra + e["scores"] * score_bytes + mask
    tokens = inp.batch * inp.seq
    if not inp.do_train:  # forward only: one layer's working set
        return tokens * full
    if not inp.recompute:
        return tokens * full * layers * in_flight
    kept = min(inp.no_recompute_layers, layers)
    redo = layers - kept
    if inp.recompute_granularity == "core_attn":  # only the attention scores are recomputed
        saved = full - e["scores"] * score_bytes
        transient = e["scores"] * score_bytes
    elif inp.recompute_granularity == "full_attn":  # the attention half is recomputed, the MLP half kept
        mlp = (ACT_MLP_HIDDEN * inp.shape.hidden_size / (tp if inp.sequence_parallel else 1) + e["mlp"]) * b
        saved = e["hidden"] * b + mlp
        transient = full - mlp
    else:  # full: only each layer's input is kept; backward recomputes one layer at a time
        saved = e["hidden"] * b
        transient = full
    per_mb = tokens * (redo * saved + kept * full)
    return per_mb * in_flight + tokens * transient


def logits_bytes(inp: PlanInputs, tp: int) -> float:
    s = inp.shape
    vocab = s.vocab_size / tp if (tp > 1 and inp.tensor_parallel_output) else s.vocab_size
    per = LOGIT_FP32_COPIES * 4 + (2 if inp.amp else 0)  # the 16-bit logits before the fp32 cast under AMP
    if inp.fused_linear_cross_entropy and inp.target == "gpu":
        return 0.0  # the fused kernel never materialises the logits (it works in vocabulary chunks)
    return inp.batch * inp.seq * vocab * per


def overhead_bytes(inp: PlanInputs, layout: Layout) -> int:
    if inp.target == "cpu":
        return CPU_RUNTIME_BYTES
    return GPU_CONTEXT_BYTES + (GPU_NCCL_BYTES if layout.devices > 1 else 0)


def _stage(inp: PlanInputs, layout: Layout, which: str) -> Dict[str, float]:
    acc, tp, pp, ep = inp.params, layout.tp, layout.pp, layout.ep
    layers = math.ceil(acc.num_layers / pp)
    parts = [(acc.layer_groups, layers), (acc.every_groups, 1)]
    if which in ("only", "first"):
        parts.append((acc.first_groups, 1))
    if which in ("only", "last"):
        parts.append((acc.last_groups, 1))
    sd = layout.sharding_degree if layout.sharding_stage else 1
    # the routed experts (ep_split) of an EP rank are sharded over the moe-sharding group: sd / EP ranks
    sds = {False: sd, True: max(1, sd // ep)}
    w = grads = states = 0.0
    train = inp.do_train
    optim = OPTIMIZER_STATE_BYTES.get(inp.optim)
    if train and optim is None:
        raise PlanError(f"optim {inp.optim!r}: PaddleNLP's Trainer supports {', '.join(OPTIMIZER_STATE_BYTES)}")
    master = MASTER_WEIGHT_BYTES if inp.weight_bytes == 2 else 0
    for experts, div in sds.items():
        pw = tp_params = s3_bytes = 0.0
        for groups, n in parts:
            gw, gp, gs = _group_bytes([g for g in groups if g.ep_split == experts], n, inp, tp, ep)
            pw, tp_params, s3_bytes = pw + gw, tp_params + gp, s3_bytes + gs
        if train:
            grads += tp_params * inp.grad_bytes / (div if layout.sharding_stage >= 2 else 1)
            if not layout.offload:
                states += tp_params * (optim + master) / (div if layout.sharding_stage >= 1 else 1)
        if layout.sharding_stage >= 3:
            # the large parameters are sliced; the layer being computed (and the next, prefetched) is gathered whole
            layer = [g for g in acc.layer_groups if g.ep_split == experts]
            per_layer = _group_bytes(layer, 1, inp, tp, ep)[2]
            pw = pw - s3_bytes + s3_bytes / div + 2 * per_layer * (1 - 1 / div)
        w += pw
    in_flight = min(pp, inp.grad_accum) if (pp > 1 and which == "first") else 1
    act = activation_bytes(inp, tp, layers, in_flight)
    logits = logits_bytes(inp, tp) if which in ("only", "last") else 0.0
    temps = 0.0
    if train and inp.max_grad_norm and inp.max_grad_norm > 0 and not layout.hybrid:
        temps = grads  # ClipGradByGlobalNorm: one new gradient per parameter
    if train and inp.target == "cpu" and acc.method == "full":
        temps = max(temps, min(w, SAVE_SHARD_BYTES))  # the final save's numpy copy of one shard
    if s_moe := inp.shape.moe:  # the routers' e_score_correction_bias buffers (fp32), on every rank
        w += 4 * s_moe.router_buffer_elements * layers / acc.num_layers
    return {
        "weights": w,
        "gradients": grads,
        "optimizer_states": states,
        "activations": act,
        "logits": logits,
        "step_temporaries": temps,
        "framework_overhead": float(overhead_bytes(inp, layout)),
    }


def total_of(b: Dict[str, float]) -> float:
    step = max(b["activations"] + b["logits"], b["step_temporaries"])
    return b["weights"] + b["gradients"] + b["optimizer_states"] + step + b["framework_overhead"]


def estimate(inp: PlanInputs, layout: Optional[Layout] = None) -> Estimate:
    """Per-device bytes of ``inp`` under ``layout`` (default: one device); the heaviest pipeline stage."""
    layout = layout or Layout()
    s = inp.shape
    if layout.tp > 1 and (s.num_attention_heads % layout.tp or s.num_key_value_heads % layout.tp):
        raise PlanError(
            f"tensor_parallel_degree {layout.tp} must divide num_attention_heads "
            f"{s.num_attention_heads} and num_key_value_heads {s.num_key_value_heads}"
        )
    if layout.ep > 1:
        if s.moe is None:
            raise PlanError(f"expert_parallel_degree {layout.ep}: {s.model_type} has no experts; set it to 1")
        if s.moe.num_experts % layout.ep:
            raise PlanError(
                f"expert_parallel_degree {layout.ep} must divide the {s.moe.num_experts} experts (each rank holds "
                "num_experts / expert_parallel_degree of them)"
            )
        if s.moe.fused_experts:
            raise PlanError(
                f"expert_parallel_degree {layout.ep}: {s.model_type}'s fused experts (one 3-D parameter for all "
                "experts) are not split here; set expert_parallel_degree to 1"
            )
        if layout.sharding_stage and layout.sharding_degree > 1 and layout.sharding_degree % layout.ep:
            raise PlanError(
                f"expert_parallel_degree {layout.ep} must divide sharding_parallel_degree {layout.sharding_degree} "
                "(PaddleNLP shards each rank's experts over sharding_parallel_degree / expert_parallel_degree ranks)"
            )
        if (layout.sharding_degree * layout.dp) % layout.ep:
            raise PlanError(
                f"expert_parallel_degree {layout.ep} must divide the data-parallel x sharding ranks "
                f"({layout.sharding_degree * layout.dp}): the expert-parallel ranks are those"
            )
    if layout.pp > s.num_hidden_layers:
        raise PlanError(f"pipeline_parallel_degree {layout.pp} exceeds num_hidden_layers {s.num_hidden_layers}")
    stages = ["only"] if layout.pp == 1 else ["first", "last"]
    best = max(((w, _stage(inp, layout, w)) for w in stages), key=lambda x: total_of(x[1]))
    which, b = best
    breakdown = {k: int(round(b[k])) for k in BREAKDOWN_KEYS}
    est = Estimate(int(round(total_of(b))), breakdown, assumptions(inp, layout), layout, inp, which)
    est.facts = {
        "base_params": s.total_params,
        "total_params": inp.params.total_params,
        "trainable_params": inp.params.trainable_params,
        "method": inp.params.method,
    }
    if s.moe is not None:
        est.facts.update(
            active_params=s.active_params,
            num_experts=s.moe.num_experts,
            experts_per_token=s.moe.top_k,
            moe_layers=s.moe.moe_layers,
            expert_params=s.expert_params,
            experts_per_rank=s.moe.num_experts // layout.ep,
            expert_parallel_degree=layout.ep,
            router_buffer_elements=s.moe.router_buffer_elements,
        )
    return est


def assumptions(inp: PlanInputs, layout: Layout) -> List[str]:
    a = []
    s = inp.shape
    added = inp.params.total_params - s.total_params
    a.append(
        f"model {s.model_type} from {s.source or 'given shape'}: {s.total_params:,} parameters"
        + (f" (+ {added:,} of the method)" if added else "")
        + f", {inp.params.trainable_params:,} trainable"
    )
    if s.moe is not None:
        m = s.moe
        a.append(
            f"mixture of experts: {m.num_experts} experts, top-{m.top_k} per token, in {m.moe_layers} of "
            f"{s.num_hidden_layers} layers"
            + (f" (+ shared experts of {m.shared_intermediate})" if m.shared_intermediate else "")
            + f": {s.active_params:,} parameters active per token of {s.total_params:,}; routed experts "
            f"{s.expert_params:,}"
            + (f", {m.num_experts // layout.ep} per rank (expert_parallel_degree {layout.ep})" if layout.ep > 1 else "")
            + (
                f"; router buffers (e_score_correction_bias) {m.router_buffer_elements:,} fp32"
                if m.router_buffer_elements
                else ""
            )
            + "; activations: top-k experts' widths + the gathered rows and router logits per token"
        )
    a.append(f"micro-batch {inp.batch} x {inp.seq} tokens (every row padded or packed to max_length: the worst case)")
    if inp.target == "cpu":
        a.append(
            f"CPU: framework overhead = the Paddle + PaddleNLP runtime measured before the model "
            f"({CPU_RUNTIME_BYTES / GiB:.2f} GiB; grows with a large in-memory dataset)"
        )
    else:
        a.append(
            f"GPU: framework overhead = CUDA context + allocator slack {GPU_CONTEXT_BYTES / GiB:.1f} GiB"
            + (f" + NCCL buffers {GPU_NCCL_BYTES / GiB:.1f} GiB" if layout.devices > 1 else "")
            + " (assumed, not measured here)"
        )
        a.append(
            "GPU activations: the element counts measured on CPU, at 2 bytes under AMP (fp32 RMSNorm internals "
            "and softmax at 4); fused kernels (flash attention, fused RMSNorm/rope) keep at most as much"
        )
    prec = "fp32" if not inp.amp else f"{inp.precision} {inp.amp_level}"
    a.append(
        f"precision {prec}: weights {inp.weight_bytes} B, gradients {inp.grad_bytes} B, activations "
        f"{inp.act_bytes} B per element"
        + (", fp32 master weights in the optimizer" if inp.weight_bytes == 2 and inp.do_train else "")
    )
    if inp.do_train:
        a.append(
            f"optimizer {inp.optim}: {OPTIMIZER_STATE_BYTES.get(inp.optim, '?')} B of state per trainable "
            "parameter" + (" (on the host: offload)" if layout.offload else "")
        )
        a.append(
            "gradients stay allocated between steps (clear_grad sets them to zero)"
            if not inp.release_grads
            else "release_grads: gradients are freed after each step (still counted: they peak in backward)"
        )
    else:
        a.append("do_train false: forward only, no gradients or optimizer states")
    if inp.recompute:
        a.append(f"recompute ({inp.recompute_granularity}): activations of one layer at a time in backward")
    if not inp.flash_attention:
        a.append("eager attention keeps the [heads, seq, seq] softmax per layer (use_flash_attention removes it)")
    if layout.sharding_stage == 3:
        a.append(
            "sharding stage3 slices the float weights, frozen or not (Paddle slices every parameter above "
            "2**20 elements); quantized weights (buffers), adapters and norms stay whole"
        )
    if layout.pp > 1:
        a.append(
            f"pipeline 1F1B: the first stage holds min(pp, gradient_accumulation_steps) = "
            f"{min(layout.pp, inp.grad_accum)} micro-batches of activations"
        )
    if inp.params.quantized_linears:
        a.append("quantized base: the dequantized weight of one layer is transient (measured: does not raise the peak)")
    a.extend(inp.params.notes)
    return a
