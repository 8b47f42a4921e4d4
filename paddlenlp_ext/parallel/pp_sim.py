"""A pipeline of N stages simulated in one CPU process (how pipeline-parallel adapters are tested).

Paddle's CPU build cannot run fleet's pipeline parallelism (``PipelineLayer``
reads a device id a CPU build never sets; the schedule sends activations with
device streams).  The simulation builds THE SAME stage models --
PaddleNLP's ``*ForCausalLMPipe``, one per stage, each holding only its layers
(:func:`build_stages`, through
:func:`paddlenlp_ext.integrations.paddlenlp_pipe.pipeline_stage_construction`) -- and
runs one micro-batch through them (:func:`run_pipeline`):

* forward: stage ``s`` receives the previous stage's output with its
  activation detached ("sent"), runs its layers (with ``virtual_pp_degree``
  ``V > 1`` every stage holds ``V`` chunks and the order is chunk 0 of every
  stage, then chunk 1, ...), and the last stage applies the model's criterion;
* backward: the last stage back-propagates its loss; every earlier stage then
  back-propagates the gradient its successor computed for the activation it
  received ("received"), so each stage's gradients come only from what a
  pipeline sends.

PaddleNLP's 1F1B / interleaved schedules only reorder these per-micro-batch
steps; the gradient is their sum.  :class:`SimulatedPipelineGroup` gives every
stage the pipeline group a save needs (``all_gather_object`` across threads).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, List, Sequence

import paddle

from .pipeline_group import PipelineGroup

__all__ = ["build_stages", "run_pipeline", "SimulatedPipelineGroup", "run_stages_in_threads"]


def build_stages(model_class: Any, config: Any, num_stages: int) -> List[paddle.nn.Layer]:
    """``num_stages`` stage models of ``model_class(config)`` (``config.virtual_pp_degree`` chunks each)."""
    from ..integrations.paddlenlp_pipe import pipeline_stage_construction

    stages = []
    for s in range(num_stages):
        with pipeline_stage_construction(num_stages, s):
            stages.append(model_class(config))
    return stages


def _send(args: Any) -> Any:
    """The activation as the next stage receives it: a new leaf (float tensors take gradients)."""
    if isinstance(args, tuple):
        return tuple(_send(a) for a in args)
    if isinstance(args, paddle.Tensor):
        out = args.detach()
        out.stop_gradient = not paddle.is_floating_point(args)
        return out
    return args


def _floats(args: Any) -> List[paddle.Tensor]:
    items = args if isinstance(args, tuple) else (args,)
    return [a for a in items if isinstance(a, paddle.Tensor) and paddle.is_floating_point(a)]


def run_pipeline(
    stages: Sequence[paddle.nn.Layer], inputs: Any, labels: Any, criterion: Callable[[Any, Any], paddle.Tensor]
) -> paddle.Tensor:
    """Forward ``inputs`` (the first stage's tuple) through the stages, the loss on the last, and backward."""
    from ..integrations.paddlenlp_pipe import gpu_argument_routing

    virtual = stages[0].get_num_virtual_stages()
    hops = [(s, c) for c in range(virtual) for s in range(len(stages))]
    sent: List[tuple] = []  # (output of hop i, what hop i + 1 received)
    x = inputs
    with gpu_argument_routing():
        for i, (s, c) in enumerate(hops):
            out = stages[s](x, chunk_id=c) if virtual > 1 else stages[s](x)
            if i + 1 < len(hops):
                x = _send(out)
                sent.append((out, x))
            else:
                loss = criterion(out, labels)
    loss.backward()
    for out, received in reversed(sent):
        outs, recv = _floats(out), _floats(received)
        grads = [r.grad for r in recv]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        if pairs:
            paddle.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return loss


class SimulatedPipelineGroup:
    """A pipeline group of ``num_stages`` simulated stages; :meth:`view` is what stage ``s`` holds.

    ``all_gather_object`` meets the other stages at a barrier: run the stages' saves in threads
    (:func:`run_stages_in_threads`)."""

    def __init__(self, num_stages: int):
        self.num_stages = int(num_stages)
        self._barrier = threading.Barrier(self.num_stages, timeout=120)
        self._slots: List[Any] = [None] * self.num_stages

    def view(self, stage: int) -> PipelineGroup:
        group = self

        class _Stage(PipelineGroup):
            def __init__(self):
                self.stage, self.num_stages = int(stage), group.num_stages

            def all_gather_object(self, obj: Any) -> List[Any]:
                group._slots[self.stage] = obj
                group._barrier.wait()
                out = list(group._slots)
                group._barrier.wait()  # everyone has read before the slots are reused
                return out

        return _Stage()


def run_stages_in_threads(num_stages: int, fn: Callable[[int], Any]) -> List[Any]:
    """``[fn(0), ..., fn(num_stages - 1)]``, each in its own thread (they may meet at collectives)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=num_stages) as pool:
        futures = [pool.submit(fn, s) for s in range(num_stages)]
        return [f.result(timeout=300) for f in futures]  # a stage's exception is raised here
