"""From a validated RunConfig to a plan: the inputs, the layout, the estimate, the one-line summary.

``estimate_for_run(cfg)`` and ``format_one_line(estimate, device_memory)`` are what the training
CLI prints at start; ``llm/tools/plan_memory.py`` uses the same functions (``cli.plan_memory``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Optional, Tuple

from ..adapters.methods import method_by_key, method_keys
from ..config.environment import paddle_build, world_size as launched_world_size
from ..prefix.config import ModelFacts, PrefixConfigError, prefix_config_for_model
from .memory import GiB, Estimate, Layout, PlanInputs, estimate
from .params import AdapterSpec, Group, QuantSpec, account
from .shapes import ModelShape, PlanError, read_json_object, read_model_shape


def plan_target(cfg, target: Optional[str] = None) -> str:
    """``target`` if given; else cpu when the config says device cpu or the installed Paddle has no CUDA."""
    if target is not None:
        if target not in ("gpu", "cpu"):
            raise PlanError(f"target must be gpu or cpu, got {target!r}")
        return target
    if cfg.training.get("device") == "cpu" or not paddle_build()["cuda"]:
        return "cpu"
    return "gpu"


def parse_sharding(value) -> Tuple[int, bool]:
    """``"stage2 offload"`` -> ``(2, True)``; ``""`` -> ``(0, False)`` (PaddleNLP's ``sharding`` key)."""
    tokens = value if isinstance(value, (list, tuple)) else re.split(r"[\s,]+", str(value or "").strip())
    stage, offload = 0, False
    for tok in filter(None, tokens):
        if tok in ("stage1", "stage2", "stage3"):
            stage = max(stage, int(tok[-1]))
        elif tok == "offload":
            offload = True
        else:
            raise PlanError(f"sharding: unknown option {tok!r}; use stage1, stage2 or stage3, optionally with offload")
    return stage, offload


def layout_from_config(t: dict, world_size: Optional[int] = None) -> Layout:
    """The layout of the training keys; world size: ``world_size``, else the launch's, else the degrees' product."""
    tp = max(1, int(t.get("tensor_parallel_degree", -1) or 1))
    pp = max(1, int(t.get("pipeline_parallel_degree", -1) or 1))
    stage, offload = parse_sharding(t.get("sharding", ""))
    sd = int(t.get("sharding_parallel_degree", -1) or -1)
    if sd <= 0:
        sd = int(t.get("sharding_degree", -1) or -1)  # PaddleNLP's deprecated alias
    try:
        ep = max(1, int(t.get("expert_parallel_degree", -1) or 1))
    except (TypeError, ValueError):
        raise PlanError(f"expert_parallel_degree={t.get('expert_parallel_degree')!r} must be an integer") from None
    world = world_size or launched_world_size()
    if world <= 1:
        world = tp * pp * math.lcm(max(sd, 1), ep)  # the expert-parallel ranks are data-parallel / sharding ranks
    if world % (tp * pp):
        raise PlanError(
            f"world size {world} is not a multiple of tensor_parallel_degree x pipeline_parallel_degree = {tp * pp}"
        )
    if not stage:
        sd = 1  # PaddleNLP: no sharding option means no sharding, whatever the degree
    elif sd <= 0:
        sd = world // (tp * pp)  # -1: shard over every device left after TP and PP
    if world % (tp * pp * sd):
        raise PlanError(
            f"world size {world} is not a multiple of tensor x pipeline x sharding_parallel_degree = {tp * pp * sd}"
        )
    if sd == 1:
        stage = 0
    offload = offload or bool(t.get("offload_optim", False))
    return Layout(
        tp=tp, pp=pp, sharding_stage=stage, sharding_degree=sd, dp=world // (tp * pp * sd), offload=offload, ep=ep
    )


def _quant(cfg, saved_quant: Optional[dict]) -> Optional[QuantSpec]:
    m = cfg.model
    if m.weight_quantize_algo:
        return QuantSpec(
            m.weight_quantize_algo, m.weight_blocksize, m.weight_double_quant, m.weight_double_quant_block_size
        )
    q = saved_quant
    if q:  # an adapter trained on a quantized base continues on the same quantized base
        return QuantSpec(
            q["weight_quantize_algo"],
            q.get("weight_blocksize", 64),
            q.get("weight_double_quant", False),
            q.get("weight_double_quant_block_size", 256),
        )
    return None


def _saved_adapter(path: str, model_type: str) -> Tuple[AdapterSpec, Optional[dict]]:
    """The adapter in ``lora_path``: ours (adapter_config.json) or PaddleNLP's (lora_config.json)."""
    for name, paddlenlp in (("adapter_config.json", False), ("lora_config.json", True)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            d = read_json_object(full, "the lora_path adapter config")
            if paddlenlp:  # PaddleNLP's LoRAConfig keys
                targets = d.get("target_modules")
                return AdapterSpec(
                    "lora",
                    int(d.get("r", 8)),
                    float(d.get("lora_dropout", 0.0) or 0.0),
                    tuple(targets) if targets else None,
                    model_type,
                ), None
            targets = d.get("target_modules")
            return AdapterSpec(
                d.get("method", "lora"),
                int(d.get("r", 8)),
                float(d.get("dropout", 0.0) or 0.0),
                tuple(targets) if targets else None,
                model_type,
                int(d.get("lokr_factor", -1)),
                bool(d.get("lokr_decompose_both", False)),
                bool(d.get("pissa", False)),
            ), d.get("quantization")
    raise PlanError(f"lora_path {path!r} has no adapter_config.json or lora_config.json")


def _adapter(cfg, shape: ModelShape) -> Tuple[Optional[AdapterSpec], Optional[dict]]:
    """(adapter settings, the quantization a saved adapter was trained on).  config.parse validated the keys."""
    m = cfg.model
    if m.lora_path:
        return _saved_adapter(m.lora_path, shape.model_type)  # the saved adapter's own settings apply
    targets = m.lora_target_modules or m.target_modules
    targets = tuple(targets) if targets else None
    on = [key for key in method_keys() if getattr(m, key, False)]
    if on:  # the row maps its own flat keys (adapters.methods); AdapterSpec keeps the ones that size it
        kw = method_by_key(on[0]).from_args(dataclasses.asdict(m))
        return AdapterSpec(
            method_by_key(on[0]).name,
            kw["r"],
            kw.get("dropout", 0.0),
            targets,
            shape.model_type,
            kw.get("lokr_factor", -1),
            kw.get("lokr_decompose_both", False),
            kw.get("pissa", False),
        ), None
    return None, None


def inputs_from_run(cfg, target: Optional[str] = None, shape: Optional[ModelShape] = None) -> PlanInputs:
    """The memory model's inputs for a RunConfig (``shape``: instead of reading model_name_or_path)."""
    m, d, t = cfg.model, cfg.data, cfg.training
    shape = shape or read_model_shape(m.model_name_or_path)
    adapter, saved_quant = _adapter(cfg, shape)
    quant = _quant(cfg, saved_quant)
    prefix = None
    if m.prefix_tuning:
        try:
            prefix = prefix_config_for_model(
                ModelFacts(
                    shape.model_type,
                    shape.hidden_size,
                    shape.num_attention_heads,
                    shape.num_key_value_heads,
                    shape.num_hidden_layers,
                ),
                m.num_prefix_tokens,
                m.prefix_projection,
                m.prefix_projection_hidden_size,
            )
        except PrefixConfigError as e:
            raise PlanError(f"prefix_tuning: {e}") from None
    do_train = bool(t.get("do_train", False))
    method = (
        "eval"
        if not do_train
        else (adapter.method if adapter is not None else "prefix" if prefix is not None else "full")
    )
    acc = account(
        shape,
        method,
        adapter=adapter,
        quant=quant,
        prefix=prefix,
        fuse_qkv=bool(m.fuse_attention_qkv),
        fuse_ffn=bool(m.fuse_attention_ffn),
    )
    if cfg.alignment is not None:
        acc.notes.append(
            "DPO: planned as fine-tuning on rows of max_seq_len tokens (chosen + rejected packed); "
            "a full-fine-tuning reference model (not reference_free) adds a frozen copy of the weights"
        )
    precision = "bf16" if t.get("bf16") else "fp16" if t.get("fp16") else "fp32"
    level = t.get("fp16_opt_level", "O1")
    if level == "O0":
        precision = "fp32"  # AMP level O0: no autocast, fp32 everywhere
    layers = t.get("no_recompute_layers") or []
    inp = PlanInputs(
        shape=shape,
        params=acc,
        target=plan_target(cfg, target),
        precision=precision,
        amp_level=level,
        amp_master_grad=bool(t.get("amp_master_grad", False)),
        optim=str(t.get("optim", "adamw")),
        batch=int(t.get("per_device_train_batch_size", 8)),
        seq=int(cfg.alignment.max_seq_len if cfg.alignment is not None else d.max_length),
        grad_accum=int(t.get("gradient_accumulation_steps", 1)),
        recompute=bool(t.get("recompute", False)),
        recompute_granularity=str(t.get("recompute_granularity", "full")),
        no_recompute_layers=len(layers),
        flash_attention=bool(m.use_flash_attention),
        prefix_tokens=m.num_prefix_tokens if prefix else 0,
        fused_linear_cross_entropy=bool(t.get("use_fused_linear_cross_entropy", False)),
        tensor_parallel_output=bool(t.get("tensor_parallel_output", False)),
        sequence_parallel=bool(t.get("sequence_parallel", False)),
        max_grad_norm=float(t.get("max_grad_norm", 1.0) or 0.0),
        release_grads=bool(t.get("release_grads", False)),
        do_train=do_train,
    )
    if cfg.alignment is not None and method == "full" and not cfg.alignment.reference_free:
        acc.every_groups.append(_reference_copy(acc))
    return inp


def _reference_copy(acc):
    """DPO with full fine-tuning: a frozen copy of every parameter (the reference model)."""
    return Group("DPO reference model (frozen copy)", acc.total_params, False)


def estimate_for_run(
    cfg, target: Optional[str] = None, world_size: Optional[int] = None, shape: Optional[ModelShape] = None
) -> Estimate:
    """Bytes per device of ``cfg`` (a validated RunConfig) under its own parallel layout.

    ``target``: "gpu" / "cpu" (default: this machine, see :func:`plan_target`); ``world_size``:
    default the launch's (PADDLE_TRAINERS_NUM), else the product of the degrees.  PlanError when the
    model shape cannot be read or a key makes no sense for planning."""
    inp = inputs_from_run(cfg, target, shape)
    return estimate(inp, layout_from_config(cfg.training, world_size))


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def format_one_line(est: Estimate, device_memory: Optional[int] = None) -> str:
    """``memory plan: 4.44 GiB per device (weights 3.14, ...; cpu, 1 device)`` + `` -- exceeds ...`` when it does."""
    b = est.breakdown
    parts = ", ".join(
        f"{k.replace('_', ' ')} {b[k] / GiB:.2f}"
        for k in ("weights", "gradients", "optimizer_states", "activations", "logits")
        if b[k]
    )
    line = (
        f"memory plan: {gib(est.per_device_bytes)} per device ({parts}; overhead "
        f"{b['framework_overhead'] / GiB:.2f} GiB; {est.inputs.target}, {est.layout.describe()})"
    )
    if device_memory:
        if est.per_device_bytes > device_memory:
            line += (
                f" -- exceeds the {gib(device_memory)} available; see python llm/tools/plan_memory.py CONFIG "
                f"--device_memory {device_memory / GiB:.0f}GB for a layout that fits"
            )
        else:
            line += f" -- fits in {gib(device_memory)}"
    return line


def host_memory_bytes() -> Optional[int]:
    """MemTotal of this machine (Linux /proc/meminfo), the "device" memory of a CPU run; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux: the caller prints the plan without a fit check
        return None
    return None
