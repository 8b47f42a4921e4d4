"""PaddleNLP LoRA adapters saved per tensor-parallel rank, joined into one complete adapter.

``LoRAModel.save_pretrained`` under ``tensor_parallel_degree`` N without
``merge_tensor_parallel`` writes ``lora_model_state.tp00.pdparams`` ...
``tp{N-1}`` (with pipeline parallel ``tpXX_ppYY``, one per stage), each
holding its rank's part under the plain model's keys.  Its TP LoRA layers
(``ColumnParallelLoRALinear`` / ``RowParallelLoRALinear``) split like this:

==========================================  ===============================  ===============================
target (PaddleNLP's Llama / Qwen2 TP layer)  lora_A                          lora_B
==========================================  ===============================  ===============================
q/k/v/gate/up_proj (column parallel)         [in, r] replicated              [r, out / N] split along axis 1
o_proj, down_proj (row parallel)             [in / N, r] split along axis 0  [r, out] replicated
==========================================  ===============================  ===============================

:func:`join_tp_shards` concatenates the split tensors in rank order and checks
that the replicated ones are the same on every rank.  The fused projections
(``qkv_proj``, ``gate_up_fused_proj``) are refused: each rank's shard holds
its own parts of q, k and v side by side, so joined shards are not the
single-device layout.  A joined adapter is then loaded strictly, so a shape
that does not fit the base model is an error naming the tensor.

Worked example (N = 2, a column target): ``lora_B`` shards ``[[1, 2]]`` and
``[[3, 4]]`` join to ``[[1, 2, 3, 4]]``; ``lora_A`` ``[[5], [6]]`` on both
ranks stays ``[[5], [6]]``.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Mapping, Optional

import numpy as np

from .paddlenlp_format import PaddleNLPAdapterError

__all__ = ["TP_FILE", "tp_shard_files", "split_axis", "join_tp_shards"]

TP_FILE = re.compile(r"lora_model_state\.tp(\d+)(?:_pp(\d+))?\.pdparams")
COLUMN_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_TARGETS = ("o_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "gate_up_fused_proj")


class TensorParallelShardError(PaddleNLPAdapterError):
    """Per-rank PaddleNLP LoRA files that cannot be joined (the message names the file or tensor)."""


def tp_shard_files(directory: str) -> Dict[int, List[str]]:
    """``{tensor-parallel rank: [its files (one per pipeline stage)]}`` in ``directory`` (empty if none)."""
    out: Dict[int, List[str]] = {}
    for name in sorted(os.listdir(directory)):
        m = TP_FILE.fullmatch(name)
        if m:
            out.setdefault(int(m.group(1)), []).append(os.path.join(directory, name))
    if out and sorted(out) != list(range(len(out))):
        raise TensorParallelShardError(
            f"{directory}: tensor-parallel ranks {sorted(out)} are not 0..{len(out) - 1}: "
            "a rank's lora_model_state.tpXX file is missing"
        )
    return out


def split_axis(key: str) -> Optional[int]:
    """The axis along which PaddleNLP split ``key`` (``<module>.lora_A`` / ``.lora_B``); None: replicated.

    >>> split_axis("llama.layers.0.self_attn.q_proj.lora_B"), split_axis("llama.layers.0.mlp.down_proj.lora_A")
    (1, 0)
    >>> split_axis("llama.layers.0.self_attn.q_proj.lora_A") is None
    True
    """
    module, _, suffix = key.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in FUSED_TARGETS:
        raise TensorParallelShardError(
            f"{key}: a fused projection ({leaf}) saved per tensor-parallel rank: each rank's shard interleaves its "
            "own parts of the fused outputs, so joined shards are not the single-device layout; save it with "
            "PaddleNLP's LoRAModel.save_pretrained(dir, merge_tensor_parallel=True)"
        )
    if leaf in COLUMN_TARGETS:
        return 1 if suffix == "lora_B" else None
    if leaf in ROW_TARGETS:
        return 0 if suffix == "lora_A" else None
    raise TensorParallelShardError(
        f"{key}: paddlenlp_ext does not know how PaddleNLP splits {leaf!r} under tensor parallelism (known: column "
        f"{', '.join(COLUMN_TARGETS)}; row {', '.join(ROW_TARGETS)}); save it with merge_tensor_parallel=True"
    )


def join_tp_shards(rank_states: List[Mapping[str, np.ndarray]], where: str) -> Dict[str, np.ndarray]:
    """One complete adapter from the ranks' states (rank order); ``where`` names the directory in errors."""
    keys = set(rank_states[0])
    for r, state in enumerate(rank_states[1:], start=1):
        if set(state) != keys:
            raise TensorParallelShardError(
                f"{where}: rank {r} holds other tensors than rank 0: {sorted(set(state) ^ keys)[:5]}"
            )
    out: Dict[str, np.ndarray] = {}
    for key in sorted(keys):
        parts = [np.asarray(state[key]) for state in rank_states]
        axis = split_axis(key)
        if axis is None:
            for r, p in enumerate(parts[1:], start=1):
                if p.shape != parts[0].shape or not np.array_equal(p, parts[0]):
                    raise TensorParallelShardError(
                        f"{where}: {key} should be the same on every tensor-parallel "
                        f"rank but differs between rank 0 and rank {r}"
                    )
            out[key] = parts[0]
        else:
            out[key] = np.concatenate(parts, axis=axis)
    return out
