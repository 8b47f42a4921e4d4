"""Which decoder tensors are split under tensor parallelism, and how (paddle-free; numpy only).

PaddleNLP's ``save_pretrained(merge_tensor_parallel=True)`` gathers each split tensor from every rank and asks
the model class how to join them (``_get_tensor_parallel_mappings(config, is_split=False)``); with
``is_split=True`` the same table cuts a single-device tensor into this rank's part.  The layout is the one the
decoder's tensor-parallel layers build (``parallel/layers.py``): column-parallel q/k/v/gate/up and the vocab
(embeddings, lm_head), row-parallel o/down, a fused projection per segment, OLMo 2's whole-projection q/k norm
like its projection.

    >>> k = {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 4,
    ...      "vocab_size": 6, "mlp_bias": True}
    >>> splits = split_layout(Arch(fused_gate_up=True, mlp_bias="mlp_bias"), k)
    >>> splits["layers.0.mlp.gate_up_proj.weight"], splits["layers.0.self_attn.o_proj.weight"]
    ((1, (4, 4)), (0, ()))
    >>> import numpy as np
    >>> merge = tensor_parallel_actions(Arch(fused_gate_up=True, mlp_bias="mlp_bias"), k, 2, 0, is_split=False)
    >>> merge["layers.0.mlp.gate_up_proj.bias"]([np.array([0, 1, 4, 5]), np.array([2, 3, 6, 7])]).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Mapping, Sequence, Tuple

import numpy as np

from .rows import Arch, resolve

#: name -> (axis of the split, fused segments or ()), for weights; a column layer's bias is split on axis 0 too
Layout = Dict[str, Tuple[int, Tuple[int, ...]]]


def split_layout(arch: Arch, cfg: Mapping[str, Any]) -> Layout:
    """Every split tensor of the decoder (names under the body, plus ``lm_head.weight``) and how it is cut."""
    k = resolve(arch, cfg)
    q_out, kv_out = k.heads * k.head_dim, k.kv_heads * k.head_dim
    # lm_head.weight [hidden, vocab]; tied, the state dict names the embedding table [vocab, hidden] there too
    out: Layout = {"embed_tokens.weight": (0, ()), "lm_head.weight": (0 if k.tie else 1, ())}
    for i in range(k.layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.{arch.mlp_name}."
        column, row = {}, [f"{attn}o_proj"]
        if arch.mlp == "moe" and _is_moe_layer(cfg, i):
            _moe_layout(cfg, mlp, column, row, out)
        elif arch.fused_gate_up:
            column[f"{mlp}gate_up_proj"] = ((k.intermediate,) * 2, k.mlp_bias)
        else:
            column.update({f"{mlp}gate_proj": ((), k.mlp_bias), f"{mlp}up_proj": ((), k.mlp_bias)})
        if not (arch.mlp == "moe" and _is_moe_layer(cfg, i)):
            row.append(f"{mlp}down_proj")
        if arch.attn == "mla":  # deepseek: the head-split projections; the latent path is replicated (mla.py)
            column[f"{attn}q_proj" if cfg.get("q_lora_rank") is None else f"{attn}q_b_proj"] = ((), False)
            column[f"{attn}kv_b_proj"] = ((), False)
        elif arch.fused_qkv:
            column[f"{attn}qkv_proj"] = ((q_out, kv_out, kv_out), k.qkv_bias)
        else:
            column.update({f"{attn}{p}_proj": ((), k.qkv_bias) for p in "qkv"})
        for name, (segs, bias) in column.items():
            out[f"{name}.weight"] = (1, segs)
            if bias:
                out[f"{name}.bias"] = (0, segs)
        for name in row:
            out[f"{name}.weight"] = (0, ())
        if arch.qk_norm == "proj":
            out[f"{attn}q_norm.weight"], out[f"{attn}k_norm.weight"] = (0, ()), (0, ())
        if arch.attn_sinks:  # gpt_oss: one sink logit per query head
            out[f"{attn}sinks"] = (0, ())
    return out


def _is_moe_layer(cfg: Mapping[str, Any], i: int) -> bool:
    from .moe_spec import is_moe_layer

    return is_moe_layer(cfg, i)


def _moe_layout(cfg: Mapping[str, Any], mlp: str, column: dict, row: list, out: Layout) -> None:
    """An MoE block's split tensors (``moe_experts.py``): each routed / shared expert's gate and up column-parallel,
    down row-parallel; gpt_oss' fused 3-D experts on their intermediate axis.  The router is replicated."""
    from .moe_spec import moe_spec

    spec = moe_spec(cfg)
    if spec.fused_experts:
        out[f"{mlp}experts.gate_up_proj"], out[f"{mlp}experts.gate_up_proj_bias"] = (2, ()), (1, ())
        out[f"{mlp}experts.down_proj"] = (1, ())
        return
    gate, up, down = spec.expert_names
    experts = [(f"{mlp}experts.{j}.", spec.expert_bias) for j in range(spec.num_experts)]
    if spec.shared_intermediate_size:
        experts.append((f"{mlp}{spec.shared_name}.", spec.shared_expert_bias))
    for prefix, bias in experts:
        names = (
            (gate, up, down) if not prefix.endswith(f"{spec.shared_name}.") else ("gate_proj", "up_proj", "down_proj")
        )
        column[f"{prefix}{names[0]}"] = ((), bias)
        column[f"{prefix}{names[1]}"] = ((), bias)
        row.append(f"{prefix}{names[2]}")


def _numpy(t) -> np.ndarray:
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


def _take(full, axis: int, segs: Sequence[int], degree: int, rank: int) -> np.ndarray:
    full = _numpy(full)
    parts = np.split(full, np.cumsum(segs)[:-1], axis=axis) if segs else [full]
    return np.concatenate([np.split(p, degree, axis=axis)[rank] for p in parts], axis=axis)


def _join(ranks: Sequence[Any], axis: int, segs: Sequence[int]) -> np.ndarray:
    ranks = [_numpy(r) for r in ranks]
    if not segs:
        return np.concatenate(ranks, axis=axis)
    local = np.cumsum([s // len(ranks) for s in segs])[:-1]
    pieces = [np.split(r, local, axis=axis) for r in ranks]  # per rank: its part of each segment
    return np.concatenate([np.concatenate([p[i] for p in pieces], axis=axis) for i in range(len(segs))], axis=axis)


def tensor_parallel_actions(
    arch: Arch, cfg: Mapping[str, Any], degree: int, rank: int, is_split: bool = True
) -> Dict[str, Callable]:
    """PaddleNLP's ``{name: action}``: cut a full tensor into rank ``rank``'s part (``is_split``), or join the
    ranks' parts (a list, rank order) into the full tensor."""
    actions = {}
    for name, (axis, segs) in split_layout(arch, cfg).items():
        actions[name] = (
            functools.partial(_take, axis=axis, segs=segs, degree=degree, rank=rank)
            if is_split
            else functools.partial(_join, axis=axis, segs=segs)
        )
    return actions
