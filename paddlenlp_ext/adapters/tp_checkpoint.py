"""Complete adapter checkpoints from tensor-parallel models.

An adapter saved from a tensor-parallel model is written in the normal format
(``adapter_model.safetensors`` with the complete tensors, see
``adapters.save_adapter``), so merge, predict and single-device loading need
nothing new:

* :func:`full_adapter_state_dict` gathers every split adapter tensor over the
  model-parallel group (a collective: EVERY rank of the group must call it, in
  the same order); :func:`is_checkpoint_writer` says which rank writes (rank 0
  of the group).
* :func:`unshard_adapter_states` does the same offline, from the per-rank
  ``adapter_state_dict`` s and :func:`adapter_split_axes` (e.g. shards written by
  another tool, or the simulated ranks of a test); replicated tensors must be
  identical on every rank.

Loading a complete adapter into a tensor-parallel model slices each rank's
part (``ParallelAdapterMixin.load_adapter_state_dict``).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np
import paddle
import paddle.nn as nn

from .base import AdapterError, iter_adapter_layers, to_numpy_f32


def full_adapter_state_dict(model: nn.Layer) -> Dict[str, paddle.Tensor]:
    """``{f"{module}.{suffix}": complete tensor}`` of every adapter layer (split tensors all-gathered)."""
    out: Dict[str, paddle.Tensor] = {}
    for name, layer in iter_adapter_layers(model):
        state = layer.full_adapter_state() if layer.tensor_parallel else layer.adapter_state_dict()
        for suffix, t in state.items():
            out[f"{name}.{suffix}"] = t
    return out


def is_checkpoint_writer(model: nn.Layer) -> bool:
    """True on the rank that writes the model's complete adapter (rank 0 of its model-parallel group)."""
    ranks = {layer.shard.rank for _, layer in iter_adapter_layers(model) if layer.tensor_parallel}
    if len(ranks) > 1:
        raise AdapterError(f"the model's tensor-parallel adapter layers disagree on their rank: {sorted(ranks)}")
    return ranks in (set(), {0})


def adapter_split_axes(model: nn.Layer) -> Dict[str, Optional[int]]:
    """``{f"{module}.{suffix}": axis}`` along which each adapter tensor is split (None: replicated)."""
    out: Dict[str, Optional[int]] = {}
    for name, layer in iter_adapter_layers(model):
        axes = layer.split_axes() if layer.tensor_parallel else {s: None for s in layer.adapter_state_dict()}
        out.update({f"{name}.{s}": a for s, a in axes.items()})
    return out


def adapter_shard_specs(model: nn.Layer) -> Dict[str, Any]:
    """``{f"{module}.{suffix}": ShardSpec}`` of every split adapter tensor of a fused (segmented) projection,
    for :func:`unshard_adapter_states` (the ranks' parts are joined per segment there)."""
    out: Dict[str, Any] = {}
    for name, layer in iter_adapter_layers(model):
        if layer.tensor_parallel and layer.shard.segments:
            out.update({f"{name}.{s}": layer.shard for s, a in layer.split_axes().items() if a is not None})
    return out


def unshard_adapter_states(rank_states: Sequence[Mapping[str, Any]],
                           split_axes: Mapping[str, Optional[int]],
                           specs: Optional[Mapping[str, Any]] = None) -> Dict[str, np.ndarray]:  # fmt: skip
    """The complete adapter from the N ranks' states (rank order): split tensors concatenated along
    their axis (per fused segment for the keys of ``specs``, :func:`adapter_shard_specs`), replicated ones
    checked to be identical on every rank."""
    if not rank_states:
        raise AdapterError("unshard_adapter_states: no rank states given")
    keys = set(split_axes)
    for r, state in enumerate(rank_states):
        if set(state) != keys:
            raise AdapterError(f"rank {r}: keys differ from the layout: missing {sorted(keys - set(state))[:5]}, "
                               f"unexpected {sorted(set(state) - keys)[:5]}")  # fmt: skip
    out: Dict[str, np.ndarray] = {}
    for key in sorted(keys):
        parts = [to_numpy_f32(state[key]) for state in rank_states]
        axis = split_axes[key]
        if axis is None:
            for r, p in enumerate(parts[1:], start=1):
                if p.shape != parts[0].shape or not np.array_equal(p, parts[0]):
                    raise AdapterError(f"replicated adapter tensor {key!r} differs between rank 0 and rank {r}")
            out[key] = parts[0]
        elif specs and key in specs:
            out[key] = specs[key].join(parts, axis)
        else:
            out[key] = np.concatenate(parts, axis=axis)
    return out
