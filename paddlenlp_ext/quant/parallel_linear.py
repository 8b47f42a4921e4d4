"""QLoRA bases under tensor parallelism: each rank quantizes its own weight shard.

:class:`QuantizedParallelLinear` replaces a ``ColumnParallelLinear`` /
``RowParallelLinear`` (``models.quantize.quantize_model`` does this for tensor-parallel
targets): the local ``[local_in, local_out]`` weight shard becomes a frozen
:class:`~paddlenlp_ext.quant.QuantizedLinear` (``.local``) and the layer keeps
the collectives of the layer it replaced.  Column parallel: the bias shard goes
into ``.local``; row parallel: the replicated bias stays here and is added once,
after the all-reduce.

Per-shard quantization equals quantizing the whole weight whenever the
quantization groups do not straddle a shard boundary: always for column
parallel (int8/int4 scales are per output channel, nf4/fp4 blocks run along
the input dimension of one output channel), and for row parallel with nf4/fp4
when ``block_size`` divides ``in_features / N``.  Otherwise (row parallel
int8/int4: each shard's channel absmax is over its own rows) every shard is
quantized with its own, finer scales -- the dequantized weight differs from a
single-device QLoRA model's, by less than the quantization error.
"""

from __future__ import annotations

from typing import Optional

import paddle
import paddle.nn as nn

from . import formats as QF
from .linear import QuantizedLinear
from ..parallel.collectives import Collectives, collectives_for
from ..parallel.shard import COLUMN, ShardSpec, shard_spec


class QuantizedParallelLinear(nn.Layer):
    """A tensor-parallel linear whose weight shard is quantized (see the module docstring).

    ``in_features`` / ``out_features`` are the FULL layer's; :meth:`dequantize_weight`
    returns this rank's shard ``[local_in, local_out]``.
    """

    def __init__(self, spec: ShardSpec, local: QuantizedLinear, bias: Optional[paddle.Tensor], group,
                 collectives: Optional[Collectives] = None):  # fmt: skip
        super().__init__()
        if (local.in_features, local.out_features) != (spec.local_in, spec.local_out):
            raise ValueError(
                f"quantized shard is [{local.in_features}, {local.out_features}], the {spec.kind}-parallel spec "
                f"needs [{spec.local_in}, {spec.local_out}]"
            )
        if spec.kind == COLUMN and bias is not None:
            raise ValueError("column parallel: the bias shard belongs to the local QuantizedLinear")
        self.tp_spec = spec
        self.local = local
        self.bias = bias
        self.model_parallel_group = group
        self.collectives = collectives if collectives is not None else collectives_for(group)
        self.in_features, self.out_features = spec.in_features, spec.out_features
        self.compute_dtype = local.compute_dtype  # read by adapters.base.adapter_dtype

    @classmethod
    def from_parallel_linear(cls, layer: nn.Layer, algo: str, block_size: int = QF.DEFAULT_BLOCK_SIZE,
                             double_quant: bool = False,
                             double_quant_block_size: int = QF.DEFAULT_DOUBLE_QUANT_BLOCK_SIZE,
                             backend: str = "auto") -> "QuantizedParallelLinear":  # fmt: skip
        """Quantize ``layer``'s local weight shard (Paddle's Column/RowParallelLinear)."""
        spec = shard_spec(layer)
        column = spec.kind == COLUMN
        local = QuantizedLinear.from_weight(layer.weight, layer.bias if column else None, algo, block_size,
                                            double_quant, double_quant_block_size, backend=backend)  # fmt: skip
        bias = None if column else layer.bias
        if bias is not None:
            bias.stop_gradient = True
        return cls(spec, local, bias, layer.model_parallel_group)

    def dequantize_weight(self, dtype: Optional[str] = None) -> paddle.Tensor:
        """This rank's dequantized weight shard ``[local_in, local_out]``."""
        return self.local.dequantize_weight(dtype)

    def quantized_nbytes(self) -> int:
        """Bytes of this rank's quantized buffers (``models.quantize.quantize_model``'s stats)."""
        return self.local.quantized_nbytes()

    def planned_path(self) -> str:
        return self.local.planned_path()

    def local_product(self, x_local: paddle.Tensor) -> paddle.Tensor:
        return self.local(x_local)  # [..., local_in] -> [..., local_out] (+ column bias shard)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        spec, comm = self.tp_spec, self.collectives
        if spec.kind == COLUMN:
            y = self.local(comm.identity(x))  # [..., in] -> [..., out / N]
            return comm.all_gather(y) if spec.gather_output else y
        x_mp = x if spec.input_is_parallel else comm.split(x)  # [..., in / N]
        y = comm.all_reduce(self.local(x_mp))  # partial [..., out] summed over ranks
        return y + self.bias.astype(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        s = self.tp_spec
        return (
            f"{s.kind} parallel, rank {s.rank}/{s.world_size}, in_features={s.in_features}, "
            f"out_features={s.out_features}"
        )
