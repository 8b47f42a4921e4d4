"""LoRA (rsLoRA, LoRA+) and VeRA on tensor-parallel linears.

The same layers run under fleet on GPU and on simulated ranks in tests; only
their :class:`~paddlenlp_ext.parallel.collectives.Collectives` differ.  Paddle orientation, full
weight ``W [in, out]``, N ranks, r the adapter rank; every trainable tensor is
either replicated or split like the weight, and the replicated ones sit on the
side of the collective where their gradient is already complete:

column parallel (W split along out; PaddleNLP's ``ColumnParallelLoRALinear``)::

    y_i = identity(x) @ W_i (+ b_i)                          [..., out / N]
    u   = dropout(x) @ A                 (LoRA, A [in, r] replicated)
        = (dropout(x) @ Avera^T) * d     (VeRA, d [r] replicated)
    y_i += identity(u) @ B_i * s         (LoRA, B_i [r, out / N])
         = identity(u) @ Bvera^T_i * b_i (VeRA, b_i [out / N])
    y   = all_gather(y_i) if gather_output else y_i

row parallel (W split along in; PaddleNLP's ``RowParallelLoRALinear``)::

    x_i = x_i if input_is_parallel else split(x)             [..., in / N]
    y   = all_reduce(x_i @ W_i)                              [..., out]
    u   = all_reduce(dropout(x_i) @ A_i)        (LoRA, A_i [in / N, r]; reduced BEFORE B)
        = all_reduce(dropout(x_i) @ Avera^T_i) * d   (VeRA)
    y  += u @ B * s  |  (u @ Bvera^T) * b       (B [r, out], b [out] replicated)
    y  += bias                                  (once, after the reductions)

sequence parallel (``sequence_parallel=true``: Paddle's Column/RowSequenceParallelLinear;
activations between them are this rank's part of the sequence, axis 0, ``S / N`` rows)::

    column:  x_g = seq_all_gather(x)                         [S / N, ...] -> [S, ...]
             y_i = x_g @ W_i (+ b_i) + identity(u(scale_grad(x_g, 1 / N))) @ B_i * s   (u as above)
    row:     y   = seq_reduce_scatter(x_i @ W_i)             [S, ..., out] -> [S / N, ..., out]
             y  += seq_scatter(all_reduce(u(x_i)) @ B * s)   (the full-sequence branch, this rank's rows)
             y  += bias

``seq_all_gather``'s backward reduce-scatters the input gradient (the column
input gradient summed over ranks, as ``identity`` does without sequence
parallelism).  After ``identity(u)`` every rank holds the branch's complete
input gradient, which that sum would count N times: ``scale_grad`` (forward
identity, backward x 1/N) leaves it counted once, while A and d keep their
complete gradients.  ``seq_scatter``'s backward all-gathers, so the replicated B (row)
gets the gradient of the whole sequence on every rank, like without sequence
parallelism.

``identity`` sums the gradient over the ranks in backward, so the replicated A
(column) and d get the complete gradient on every rank; after the row-parallel
all-reduce every rank holds the same ``u`` and output gradient, so B, d and b
get identical complete gradients without communication.  Replicated
parameters therefore stay equal across ranks as long as every rank starts
equal: the row-parallel A is drawn whole from the global generator (fleet
seeds it the same on every model-parallel rank) and each rank keeps its rows,
so a tensor-parallel model starts from exactly the adapter a single-device
model with the same seed would draw.  Split parameters carry
``is_distributed`` / ``split_axis`` as Paddle's own do (fleet's gradient
clipping and parameter broadcast read them).

Checkpoints are always complete: :meth:`ParallelAdapterMixin.full_adapter_state`
gathers the split tensors (a collective: every rank calls it), and loading a
complete adapter slices this rank's part.  Refused under tensor parallelism
(:func:`check_parallel_target`): PiSSA (an SVD of each whole weight), LoKr (a
Kronecker factorization of the whole weight), and PaddleNLP's fused
``qkv_proj`` / ``gate_up_fused_proj`` (a rank's shard interleaves its parts of
the fused outputs, so joined shards are not the checkpoint's layout).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import paddle
import paddle.nn as nn

from .base import AdapterError, to_numpy_f32
from .config import AdapterConfig
from .lora import LoRALinear
from .methods import TABLE, load_object
from .vera import VeRALinear
from ..parallel.collectives import Collectives, collectives_for, scale_grad
from ..parallel.shard import COLUMN, ROW, local_product, output_bias, shard_spec


def refusal(config: AdapterConfig) -> Optional[str]:
    """Why ``config``'s adapters cannot run on tensor-parallel linears (None: they can)."""
    if config.layer_type == "pissa":
        return ("PiSSA is not supported with tensor parallelism: its initialisation is an SVD of each whole "
                "weight, which no rank holds; train PiSSA with tensor_parallel_degree=1 (or use LoRA)")  # fmt: skip
    row = config.row  # adapters.methods: the row names its tensor-parallel class or why it has none
    if row.tp_layer is None:
        why = row.refusals.get("tensor_parallel_layer", "it has no tensor-parallel layer class")
        others = " / ".join(r.title for r in TABLE.values() if r.tp_layer is not None)
        return (
            f"{row.title} is not supported with tensor parallelism: {why}; use tensor_parallel_degree=1 (or {others})"
        )
    return None


#: PaddleNLP's fused projections (``fuse_attention_qkv`` / ``fuse_attention_ffn``): under tensor parallelism
#: each rank's column shard is [q_i | k_i | v_i] (or [gate_i | up_i]), so the ranks' shards joined are not
#: the single-device [q | k | v] layout a complete adapter checkpoint must have.
FUSED_PARALLEL_LINEARS = {"qkv_proj": "fuse_attention_qkv", "gate_up_fused_proj": "fuse_attention_ffn"}


def check_parallel_target(config: AdapterConfig, name: str, layer: nn.Layer) -> None:
    """Raise NotImplementedError naming ``name`` if ``layer`` cannot get ``config``'s adapter."""
    why = refusal(config)
    spec = getattr(layer, "tp_spec", None)
    segmented = bool(getattr(spec, "segments", ()))  # our decoder's fused projections: shards kept per segment
    key = None if segmented else FUSED_PARALLEL_LINEARS.get(name.rsplit(".", 1)[-1])
    if why is None and segmented and config.layer_type != "lora":
        why = (
            f"{config.layer_type} on a fused projection is not supported with tensor parallelism (its shared "
            "projections are sliced contiguously, not per fused segment); use LoRA or tensor_parallel_degree=1"
        )
    if why is None and key is not None:
        why = (f"a fused projection ({key}=true): each rank's shard interleaves its own parts of the fused "
               f"outputs, so a complete adapter would not be in the checkpoint's layout; set {key}=false "
               "with tensor_parallel_degree > 1")  # fmt: skip
    if why is None:
        try:
            shard_spec(layer)
        except NotImplementedError as e:
            why = str(e)
    if why is not None:
        raise NotImplementedError(f"target module {name!r} is a tensor-parallel {type(layer).__name__}: {why}")


def parallel_layer_class(config: AdapterConfig) -> type:
    why = refusal(config)
    if why is not None:
        raise NotImplementedError(why)
    return load_object(config.row.tp_layer)


class ParallelAdapterMixin:
    """The tensor-parallel forward and shard bookkeeping shared by the layers below.

    Subclasses define ``SPLIT_AXES[kind] = {suffix: axis of the full tensor or None (replicated)}``
    and the three parts of the adapter branch: ``_branch_in`` (this rank's input -> ``[..., r]``,
    before the collective), ``_branch_mid`` (replicated ``[..., r] -> [..., r]``) and
    ``_branch_out`` (``[..., r] -> [..., local_out]``).
    """

    tensor_parallel = True
    SPLIT_AXES: Dict[str, Dict[str, Optional[int]]] = {}

    def _base_dims(self, base_layer: nn.Layer) -> Tuple[int, int]:
        self.shard = shard_spec(base_layer)
        return self.shard.local_in, self.shard.local_out

    def _init_parallel(self, collectives: Optional[Collectives]) -> None:
        comm = collectives if collectives is not None else collectives_for(self.base_layer.model_parallel_group)
        if (comm.rank, comm.world_size) != (self.shard.rank, self.shard.world_size):
            raise ValueError(
                f"collectives are rank {comm.rank} of {comm.world_size}, the base layer is rank {self.shard.rank} "
                f"of {self.shard.world_size}"
            )
        self.collectives = comm
        for suffix, axis in self.split_axes().items():
            p = getattr(self, suffix)
            p.is_distributed = axis is not None
            if axis is not None:
                p.split_axis = axis

    def split_axes(self) -> Dict[str, Optional[int]]:
        return self.SPLIT_AXES[self.shard.kind]

    # ---------------------------------------------------------------- forward
    def _branch_mid(self, u: paddle.Tensor) -> paddle.Tensor:
        return u

    def _adapter_input(self, x: paddle.Tensor) -> paddle.Tensor:
        h = x if x.dtype == self._param_dtype else x.astype(self._param_dtype)
        return self.dropout(h)

    def _add(self, out: paddle.Tensor, delta: paddle.Tensor) -> paddle.Tensor:
        return out + (delta if delta.dtype == out.dtype else delta.astype(out.dtype))

    def _sequence_parallel_forward(self, x: paddle.Tensor, active: bool) -> paddle.Tensor:
        spec, comm, base = self.shard, self.collectives, self.base_layer
        if spec.kind == COLUMN:
            x_g = comm.seq_all_gather(x)  # [S / N, ..., in] -> [S, ..., in]
            out = local_product(base, x_g)  # [S, ..., out / N]
            if active:
                h = scale_grad(x_g, 1.0 / comm.world_size)  # the branch's input gradient is complete on every rank
                u = self._branch_mid(self._branch_in(self._adapter_input(h)))  # [S, ..., r], same on every rank
                out = self._add(out, self._branch_out(comm.identity(u)))  # [S, ..., out / N]
            return out
        out = comm.seq_reduce_scatter(local_product(base, x))  # [S, ..., in / N] -> [S / N, ..., out]
        if active:
            u = self._branch_mid(comm.all_reduce(self._branch_in(self._adapter_input(x))))  # [S, ..., r]
            out = self._add(out, comm.seq_scatter(self._branch_out(u)))  # [S, ..., out] -> [S / N, ..., out]
        bias = output_bias(base)
        return out + bias.astype(out.dtype) if bias is not None else out

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        spec, comm, base = self.shard, self.collectives, self.base_layer
        active = not (self.merged or self.disabled)
        if spec.sequence_parallel:
            return self._sequence_parallel_forward(x, active)
        if spec.kind == COLUMN:
            out = local_product(base, comm.identity(x))  # [..., in] -> [..., out / N]
            if active:
                u = self._branch_mid(self._branch_in(self._adapter_input(x)))  # [..., r], same on every rank
                delta = self._branch_out(comm.identity(u))  # [..., out / N]
                out = out + (delta if delta.dtype == out.dtype else delta.astype(out.dtype))
            return comm.all_gather(out) if spec.gather_output else out  # [..., out] or [..., out / N]
        x_mp = x if spec.input_is_parallel else comm.split(x)  # [..., in / N]
        out = comm.all_reduce(local_product(base, x_mp))  # partial [..., out] summed over ranks
        if active:
            u = self._branch_mid(comm.all_reduce(self._branch_in(self._adapter_input(x_mp))))  # [..., r]
            delta = self._branch_out(u)  # [..., out]
            out = out + (delta if delta.dtype == out.dtype else delta.astype(out.dtype))
        bias = output_bias(base)
        return out + bias.astype(out.dtype) if bias is not None else out

    # ------------------------------------------------------------ checkpoints
    def full_shape(self, suffix: str) -> List[int]:
        """Shape of ``suffix`` in a complete (unsharded) checkpoint."""
        shape = [int(s) for s in getattr(self, suffix).shape]
        axis = self.split_axes()[suffix]
        if axis is not None:
            shape[axis] *= self.shard.world_size
        return shape

    def saved_shapes(self) -> Dict[str, List[int]]:
        return {s: self.full_shape(s) for s in self.state_suffixes}

    def full_adapter_state(self) -> Dict[str, paddle.Tensor]:
        """The complete tensors of this layer (split ones all-gathered): a collective, every rank calls it."""
        axes, n = self.split_axes(), self.shard.world_size
        out = {}
        for s, t in self.adapter_state_dict().items():
            if axes[s] is None:
                out[s] = t
                continue
            full = self.collectives.gather_tensor(t.detach(), axes[s])  # rank parts, concatenated in rank order
            out[s] = self.shard.join(paddle.split(full, n, axis=axes[s]), axes[s]) if self.shard.segments else full
        return out

    @paddle.no_grad()
    def load_adapter_state_dict(self, d: Mapping[str, Any]) -> None:
        """Load complete tensors (this rank's part is sliced out) or this rank's shards."""
        if self.merged:
            raise AdapterError("load_adapter_state_dict() on a merged layer; call unmerge() first")
        axes, local = self.split_axes(), self.adapter_state_dict()
        if set(d) != set(local):
            raise AdapterError(f"{self.method} adapter state mismatch: got {sorted(d)}, expected {sorted(local)}")
        for s, ref in local.items():
            shape = [int(v) for v in d[s].shape]
            value = to_numpy_f32(d[s])
            if shape == self.full_shape(s) and axes[s] is not None:
                value = self.shard.take(value, axes[s])
            elif shape != [int(v) for v in ref.shape]:
                raise AdapterError(
                    f"{self.method} adapter tensor {s!r}: shape {shape} is neither the complete "
                    f"{self.full_shape(s)} nor this rank's shard {list(ref.shape)}"
                )
            ref.set_value(paddle.to_tensor(value).astype(ref.dtype))

    def extra_repr(self) -> str:
        s = self.shard
        return super().extra_repr() + f", {s.kind} parallel rank {s.rank}/{s.world_size}"


class ParallelLoRALinear(ParallelAdapterMixin, LoRALinear):
    """LoRA / rsLoRA / LoRA+ on a Column/RowParallelLinear (see the module docstring)."""

    SPLIT_AXES = {COLUMN: {"lora_A": None, "lora_B": 1}, ROW: {"lora_A": 0, "lora_B": None}}

    def __init__(self, base_layer: nn.Layer, config: AdapterConfig, *, init_weights: bool = True, shared: Any = None,
                 collectives: Optional[Collectives] = None):  # fmt: skip
        if refusal(config) is not None:
            raise NotImplementedError(refusal(config))
        super().__init__(base_layer, config, init_weights=init_weights, shared=shared)
        self._init_parallel(collectives)

    def _create_lora_A(self) -> paddle.Tensor:
        if self.shard.kind == COLUMN:
            return super()._create_lora_A()  # [in, r], replicated
        full = self._new_lora_A(self.shard.in_features)  # [in, r]: the single-device draw
        a = self.create_parameter(
            shape=[self.in_features, self.r],
            dtype=self._param_dtype,
            attr=paddle.ParamAttr(initializer=nn.initializer.Constant(0.0), learning_rate=1.0),
            is_bias=False,
        )
        a.set_value(self.shard.take(full, 0))  # [in / N, r]: this rank's rows
        return a

    def _branch_in(self, h: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(h, self.lora_A)  # [..., local_in] -> [..., r]

    def _branch_out(self, u: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(u, self.lora_B) * self.scaling  # [..., r] -> [..., local_out]


class ParallelVeRALinear(ParallelAdapterMixin, VeRALinear):
    """VeRA on a Column/RowParallelLinear: the shared projections are sliced like the weight."""

    SPLIT_AXES = {COLUMN: {"vera_d": None, "vera_b": 0}, ROW: {"vera_d": None, "vera_b": None}}

    def __init__(self, base_layer: nn.Layer, config: AdapterConfig, *, init_weights: bool = True, shared: Any = None,
                 collectives: Optional[Collectives] = None):  # fmt: skip
        super().__init__(base_layer, config, init_weights=init_weights, shared=shared)
        self._init_parallel(collectives)

    def _factors(self, dtype) -> Tuple[paddle.Tensor, paddle.Tensor]:
        s = self.shard
        rows = s.bounds(s.in_features) if s.kind == ROW else None
        cols = s.bounds(s.out_features) if s.kind == COLUMN else None
        return self.vera_shared.slices(s.in_features, s.out_features, dtype, rows, cols)  # [in_l, r], [r, out_l]

    def _branch_in(self, h: paddle.Tensor) -> paddle.Tensor:
        at, _ = self._factors(self._param_dtype)
        return paddle.matmul(h, at)  # [..., local_in] -> [..., r]

    def _branch_mid(self, u: paddle.Tensor) -> paddle.Tensor:
        return u * self.vera_d  # replicated d: applied where u is the same on every rank

    def _branch_out(self, u: paddle.Tensor) -> paddle.Tensor:
        _, bt = self._factors(self._param_dtype)
        return paddle.matmul(u, bt) * self.vera_b  # [..., r] -> [..., local_out]


#: method -> tensor-parallel layer class (``refusal`` explains the others)
PARALLEL_METHODS: Dict[str, type] = {"lora": ParallelLoRALinear, "vera": ParallelVeRALinear}
