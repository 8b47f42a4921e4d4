"""The portable dequantization of ``QuantizedLinear`` and the matmul that frees its weight (paddle).

Owns

* :func:`decode_portable`: the float32 weight ``[out, in]`` of the portable
  layout -- on CPU by the numpy decoder of :mod:`.decode` handed to Paddle
  without a copy (DLPack; Paddle's CPU gather/cast/multiply kernels are 4-8x
  slower on this job), on other devices by Paddle ops with the byte -> two
  values table cached as a buffer of the layer;
* :func:`block_scales`: the f32 scales with double quantization undone (paddle ops);
* :class:`DequantMatmul`: ``y = x @ W`` whose forward dequantizes, multiplies
  and drops ``W``, and whose backward dequantizes again for ``dx = dy @ W^T``.
  Nothing float of the size of ``W`` is saved for backward (no
  ``save_for_backward`` at all: ``dx`` needs only ``W``, which is rebuilt from
  the quantized buffers the layer holds anyway), so a training step holds one
  layer's float weight at a time instead of every layer's.  The frozen
  quantized weight gets no gradient; the bias is added outside (ordinary
  autograd, so a bias made trainable gets its gradient).
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle.autograd import PyLayer
from paddle.utils import dlpack

from . import codec as C
from .decode import decode_out_in


def build_lut(code: np.ndarray) -> np.ndarray:
    """[256, 2] float32: byte -> (value of high nibble, value of low nibble) of a 4-bit code book."""
    b = np.arange(256)
    return np.stack([code[b >> 4], code[b & 0x0F]], axis=1).astype(np.float32)


def _np(t: paddle.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor (read only here)."""
    return np.from_dlpack(t)


def _np_f32(t: paddle.Tensor) -> np.ndarray:
    """float32 numpy view of a scale buffer (cast first if an O2 decorate without
    :func:`~.model.amp_excluded_layers` made it bf16/fp16: numpy has no bf16)."""
    return _np(t if t.dtype == paddle.float32 else t.astype("float32"))


def block_scales(layer) -> paddle.Tensor:
    """f32 scales used for decoding ([out] or [out, ceil(in / bs)]), double quant undone (paddle ops)."""
    if not layer.double_quant:
        return layer.quant_scale.astype("float32")
    q = layer.qquant_scale.astype("float32").reshape([-1])  # [out * nblk]
    n = q.shape[0]
    blk = layer.double_quant_block_size
    pad = (-n) % blk
    if pad:  # the last double-quant block is short
        q = paddle.concat([q, paddle.zeros([pad], dtype="float32")])
    s = (q.reshape([-1, blk]) * layer.double_quant_scale.astype("float32").unsqueeze(1)).reshape([-1])[:n]
    return (s + layer.quant_scale_offset.astype("float32")).reshape(layer.qquant_scale.shape)


def _numpy_scales(layer) -> np.ndarray:
    """:func:`block_scales` in numpy (the CPU decoder's input), via :func:`.codec.block_scales`."""
    if not layer.double_quant:
        return _np_f32(layer.quant_scale)
    s = {
        "qquant_scale": _np(layer.qquant_scale),
        "double_quant_scale": _np_f32(layer.double_quant_scale),
        "quant_scale_offset": _np_f32(layer.quant_scale_offset),
    }
    return C.block_scales(dict(s, double_quant=True, double_quant_block_size=layer.double_quant_block_size))


def decode_cpu(layer) -> paddle.Tensor:
    """[out, in] float32 weight of a portable layer whose buffers are on the CPU (numpy decoder, no copy)."""
    w = decode_out_in(layer.format, _np(layer.quant_weight), _numpy_scales(layer), layer.in_features,
                      layer.block_size)  # fmt: skip
    return dlpack.from_dlpack(w)  # the tensor owns the array now


def decode_paddle(layer) -> paddle.Tensor:
    """[out, in] float32 weight of a portable layer with Paddle ops (any device)."""
    out_f, in_f, fmt = layer.out_features, layer.in_features, layer.format
    if fmt.code is None:  # int8: the code is the value
        return layer.quant_weight.astype("float32") * layer.quant_scale.astype("float32").unsqueeze(1)
    half = int(layer.quant_weight.shape[1])
    idx = layer.quant_weight.astype("int32").reshape([-1])  # [out * half] bytes
    vals = paddle.gather(layer._lut, idx, axis=0).reshape([out_f, 2 * half])  # two values per byte
    scales = block_scales(layer)
    if not fmt.blockwise:
        return vals * scales.unsqueeze(1)  # [out, in] * [out, 1]
    bs = layer.block_size
    nblk = int(scales.shape[1])
    if nblk * bs != 2 * half:  # short last block / odd in: pad to whole blocks, cut after scaling
        vals = paddle.concat([vals, paddle.zeros([out_f, nblk * bs - 2 * half], dtype="float32")], axis=1)
    w = vals.reshape([out_f, nblk, bs]) * scales.unsqueeze(2)  # [out, nblk, bs] * [out, nblk, 1]
    w = w.reshape([out_f, nblk * bs])
    return w if nblk * bs == in_f else w[:, :in_f]


def decode_portable(layer) -> paddle.Tensor:
    """[out, in] float32 weight of a portable layer, by the fastest decoder for its device."""
    if layer.quant_weight.place.is_cpu_place():
        return decode_cpu(layer)
    return decode_paddle(layer)


class DequantMatmul(PyLayer):
    """``y = x @ W`` with ``W`` dequantized in forward, dropped, and dequantized again in backward.

    ``layer._dequant(path, kwargs)`` returns ``(w, out_in)``: ``w`` is ``[out, in]``
    if ``out_in`` else ``[in, out]``.  Only ``x`` receives a gradient.
    """

    @staticmethod
    def forward(ctx, x, layer, path, kwargs):
        ctx.layer, ctx.path, ctx.kwargs, ctx.x_dtype = layer, path, kwargs, x.dtype
        w, out_in = layer._dequant(path, kwargs)
        y = paddle.matmul(x, _as(w, x.dtype), transpose_y=out_in)  # [..., in] @ W -> [..., out]
        del w  # the only reference: freed here, not kept until backward
        return y

    @staticmethod
    def backward(ctx, dy):
        w, out_in = ctx.layer._dequant(ctx.path, ctx.kwargs)
        # dx = dy @ W^T ; W^T is the stored [out, in] matrix itself
        dx = paddle.matmul(dy, _as(w, dy.dtype), transpose_y=not out_in)  # [..., out] -> [..., in]
        return _as(dx, ctx.x_dtype)


def _as(t: paddle.Tensor, dtype) -> paddle.Tensor:
    return t if t.dtype == dtype else t.astype(dtype)
