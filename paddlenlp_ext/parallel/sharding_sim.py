"""Sharding stage 2 and 3 simulated in one CPU process: the partitioned optimizer step.

``group_sharded_parallel`` (PaddleNLP's ``sharding: "stage2"`` / ``"stage3"``)
runs only on GPU/XPU.  What a run under it changes, compared with one process
stepping the whole global batch, is the optimizer step:

* every rank computes the gradient of its own micro-batch; the gradients are
  scaled by ``1 / nranks`` and reduced (Paddle's ``_world_size_scaling``);
* stage 2 (``os_g``): each parameter belongs to one rank
  (:func:`~paddlenlp_ext.integrations.sharding.stage2_partition`, Paddle's own
  rule); only the owner keeps the reduced gradient and steps it, then
  broadcasts the new value;
* stage 3 (``p_g_os``): every parameter is flattened, padded to a multiple of
  ``nranks`` and cut into ``nranks`` slices; each rank's optimizer steps
  parameters that are its slices
  (:func:`~paddlenlp_ext.integrations.sharding.stage3_slice`, Paddle's own
  wrapper: renamed ``"slice@" + name``), then the slices are all-gathered;
* a global-norm gradient clip uses the norm of ALL ranks' pieces (Paddle's
  ``GroupShardedClipGrad`` all-reduces the squared norms; simulated here by
  summing them -- that class itself needs a GPU device).

:func:`simulate_sharded_training` runs those steps for ``k`` replicas of a
model, each with the optimizer the trainer builds for it, and returns the
per-step losses; the replicas end identical, so comparing replica 0 with a
single-process run of the same global batches checks that the loss
normalization (:mod:`paddlenlp_ext.training.loss`), the per-parameter learning
rates (LoRA+), the weight-decay rule and the clip survive the partitioning.
What it does not run: Paddle's bucketed communication and its stage-3
all-gather hooks around each layer's forward (the forward here sees the whole
parameters, which is what those hooks rebuild).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import paddle
from paddle.nn.clip import ClipGradBase, ClipGradByGlobalNorm
from paddle.optimizer.lr import LRScheduler

from ..integrations.sharding import stage2_partition, stage3_slice

__all__ = ["simulate_sharded_training", "trainable_parameters"]

LossFn = Callable[[paddle.nn.Layer, Any], paddle.Tensor]


class _PresetGlobalClip(ClipGradBase):
    """Scales every clippable gradient by ``clip_norm / max(global_norm, clip_norm)``, the norm given."""

    def __init__(self, clip_norm: float, global_norm: float):
        super().__init__()
        self.scale = float(clip_norm) / max(float(global_norm), float(clip_norm))

    def _dygraph_clip(self, params_grads):
        out = []
        for p, g in params_grads:
            if g is not None and getattr(p, "need_clip", True):
                g = g * self.scale
            out.append((p, g))
        return out


def trainable_parameters(model: paddle.nn.Layer) -> List[paddle.Tensor]:
    return [p for p in model.parameters() if not p.stop_gradient]


def _clip_norm(optimizer) -> float:
    clip = getattr(optimizer, "_grad_clip", None)
    if clip is None:
        return 0.0
    if not isinstance(clip, ClipGradByGlobalNorm):
        raise TypeError(f"simulated sharding handles ClipGradByGlobalNorm only, got {type(clip).__name__}")
    return float(clip.clip_norm)


def _advance_schedule(optimizer) -> None:
    lr = optimizer._learning_rate
    if isinstance(lr, LRScheduler):
        lr.step()


def _reduced_gradients(params_per_rank: List[List[paddle.Tensor]]) -> List[paddle.Tensor]:
    """Per parameter: the sum over ranks of (gradient / nranks), as both stages reduce."""
    k = len(params_per_rank)
    reduced = []
    for i in range(len(params_per_rank[0])):
        grads = [ps[i].grad for ps in params_per_rank]
        if any(g is None for g in grads):
            reduced.append(None)
            continue
        total = paddle.zeros_like(grads[0])
        for g in grads:
            total = total + g * (1.0 / k)
        reduced.append(total)
    return reduced


def _global_norm(pieces: Sequence[paddle.Tensor], params: Sequence[paddle.Tensor]) -> float:
    sq = 0.0
    for p, g in zip(params, pieces):
        if g is not None and getattr(p, "need_clip", True):
            sq += float(paddle.sum(paddle.square(g.astype("float32"))))
    return sq**0.5


def _step_stage2(params_per_rank, optimizers, reduced, clip_norm: float) -> None:
    k = len(optimizers)
    order = {id(p): i for i, p in enumerate(params_per_rank[0])}
    owner: Dict[int, int] = {}
    for rank, owned in enumerate(stage2_partition(optimizers[0]._parameter_list, k)):
        for p in owned:
            if id(p) in order:  # frozen parameters are partitioned too, but never step
                owner[order[id(p)]] = rank
    if clip_norm > 0:
        norm = _global_norm(reduced, params_per_rank[0])
    for rank, opt in enumerate(optimizers):
        for i, p in enumerate(params_per_rank[rank]):
            if owner.get(i) == rank and reduced[i] is not None:
                p.grad.set_value(reduced[i])
            else:
                p.clear_gradient(False)  # not this rank's parameter: its gradient is released
        if clip_norm > 0:
            opt._grad_clip = _PresetGlobalClip(clip_norm, norm)
        opt.step()
        opt.clear_grad()
        _advance_schedule(opt)
    for i, p0 in enumerate(params_per_rank[0]):  # broadcast from the owner
        src = params_per_rank[owner[i]][i]
        for rank in range(k):
            if rank != owner[i]:
                params_per_rank[rank][i].set_value(src)


class _Stage3Slices:
    """Each rank's slice parameters, made once (the optimizer keys its state by their names)."""

    def __init__(self, params_per_rank: List[List[paddle.Tensor]], optimizers):
        self.k = len(optimizers)
        self.chunks = []  # per parameter: slice length
        self.slices: List[List[paddle.Tensor]] = [[] for _ in range(self.k)]
        for i, p in enumerate(params_per_rank[0]):
            chunk = -(-p.size // self.k)  # the buffer is padded to a multiple of nranks
            self.chunks.append(chunk)
            for rank in range(self.k):
                flat = self._padded(params_per_rank[rank][i].detach(), chunk)
                self.slices[rank].append(
                    stage3_slice(params_per_rank[rank][i], flat[rank * chunk : (rank + 1) * chunk])
                )
        for rank, opt in enumerate(optimizers):
            # as GroupShardedStage3._update_params_slice: the optimizer now steps the slices
            if isinstance(opt._param_groups[0], dict):
                mapping = {id(p): s for p, s in zip(params_per_rank[rank], self.slices[rank])}
                for group in opt._param_groups:
                    group["params"] = [mapping.get(id(p), p) for p in group["params"]]
            else:
                opt._parameter_list = list(self.slices[rank])
                opt._param_groups = list(self.slices[rank])

    def _padded(self, t: paddle.Tensor, chunk: int) -> paddle.Tensor:
        flat = t.reshape([-1])
        pad = chunk * self.k - flat.shape[0]
        return paddle.concat([flat, paddle.zeros([pad], dtype=flat.dtype)]) if pad else flat

    def step(self, params_per_rank, optimizers, reduced, clip_norm: float) -> None:
        if clip_norm > 0:
            norm = _global_norm(reduced, params_per_rank[0])
        for rank, opt in enumerate(optimizers):
            for i, s in enumerate(self.slices[rank]):
                params_per_rank[rank][i].clear_gradient(False)  # the full gradient is released after the reduce
                if reduced[i] is None:
                    continue
                c = self.chunks[i]
                s._copy_gradient_from(self._padded(reduced[i], c)[rank * c : (rank + 1) * c])
            if clip_norm > 0:
                opt._grad_clip = _PresetGlobalClip(clip_norm, norm)
            opt.step()
            opt.clear_grad()
            _advance_schedule(opt)
        for i in range(len(self.chunks)):  # all-gather the slices into every rank's parameter
            full = paddle.concat([self.slices[rank][i].detach() for rank in range(self.k)])
            for rank in range(self.k):
                p = params_per_rank[rank][i]
                p.set_value(full[: p.size].reshape(p.shape).astype(p.dtype))


def simulate_sharded_training(
    replicas: Sequence[paddle.nn.Layer],
    optimizers: Sequence[Any],
    batches: Sequence[Sequence[Any]],
    loss_fn: LossFn,
    stage: int,
) -> List[float]:
    """Train ``k = len(replicas)`` sharding ranks on ``batches[step][rank]``; per-step mean loss over ranks.

    ``replicas`` start identical; ``optimizers[r]`` is the trainer's optimizer
    over ``replicas[r]`` (its ``ClipGradByGlobalNorm``, if any, becomes a
    cross-rank clip); ``loss_fn(model, inputs)`` is the training loss of one
    rank's micro-batch.  The replicas are trained in place and end identical.
    """
    if stage not in (2, 3):
        raise ValueError(f"stage must be 2 or 3, got {stage}")
    k = len(replicas)
    if len(optimizers) != k:
        raise ValueError(f"{k} replicas but {len(optimizers)} optimizers")
    params_per_rank = [trainable_parameters(m) for m in replicas]
    clip_norm = _clip_norm(optimizers[0])  # Paddle swaps the clip for its cross-rank one when it wraps the optimizer
    slices = _Stage3Slices(params_per_rank, optimizers) if stage == 3 else None
    losses = []
    for step, per_rank in enumerate(batches):
        if len(per_rank) != k:
            raise ValueError(f"step {step}: {len(per_rank)} micro-batches for {k} ranks")
        total = 0.0
        for model, inputs in zip(replicas, per_rank):
            loss = loss_fn(model, inputs)
            loss.backward()
            total += float(loss)
        losses.append(total / k)
        reduced = _reduced_gradients(params_per_rank)
        if slices is None:
            _step_stage2(params_per_rank, optimizers, reduced, clip_norm)
        else:
            slices.step(params_per_rank, optimizers, reduced, clip_norm)
    return losses
