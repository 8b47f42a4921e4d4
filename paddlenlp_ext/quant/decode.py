"""Fast numpy dequantization of the portable layout (no paddle import).

Owns the decoder a CPU forward and backward of ``QuantizedLinear`` run every
step (Paddle's CPU ``gather``/``cast``/``multiply`` kernels are 4-8x slower
than numpy on this job; the layer hands the result to Paddle without a copy
through DLPack).  It produces exactly the values of the format definition in
:mod:`.formats` (``QuantFormat.dequant``: code value times its f32 scale, one
float32 multiply each), only faster:

* one table lookup per *byte*: a 256-entry table of ``uint64`` holds the two
  float32 values of a byte's high and low nibble, so decoding two weights is
  one 8-byte gather (no unpacking of nibbles);
* row tiles of about 64K weights: the scale multiply runs while the decoded
  tile is still in cache.
"""

from __future__ import annotations

import functools

import numpy as np

from .formats import QuantFormat

__all__ = ["decode_out_in"]

#: weights per row tile
_TILE_ELEMS = 1 << 16
#: byte alignment of the result: MKL picks its GEMM kernels by alignment too, so a fixed one keeps
#: the matmul that consumes the weight reproducible from run to run (Paddle's allocator aligns to 64)
_ALIGN = 64


def _aligned_empty(shape, dtype) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off : off + nbytes].view(dtype).reshape(shape)


@functools.lru_cache(maxsize=8)
def _pair_table(code_bytes: bytes) -> np.ndarray:
    """uint64 [256]: byte -> (value of its high nibble, value of its low nibble) as two float32."""
    code = np.frombuffer(code_bytes, dtype=np.float32)
    b = np.arange(256)
    pairs = np.stack([code[b >> 4], code[b & 0x0F]], axis=1).astype(np.float32)  # [256, 2]
    return np.ascontiguousarray(pairs).view(np.uint64).reshape(256)


def decode_out_in(fmt: QuantFormat, qw: np.ndarray, scales: np.ndarray, in_features: int, block_size) -> np.ndarray:
    """Stored codes + f32 scales -> float32 weight ``[out, in]`` (the stored orientation).

    ``qw``: ``[out, in]`` int8 or ``[out, ceil(in / 2)]`` uint8; ``scales``:
    ``[out]`` (per channel) or ``[out, ceil(in / bs)]`` (blockwise, last block
    of a row may be short).
    """
    out_f, in_f = qw.shape[0], int(in_features)
    res = _aligned_empty((out_f, in_f), np.float32)  # [out, in]
    if fmt.code is None:  # int8: the code is the value
        return np.multiply(qw, scales[:, None], out=res, dtype=np.float32)
    table = _pair_table(np.ascontiguousarray(fmt.code, np.float32).tobytes())
    half = qw.shape[1]
    rows = max(1, _TILE_ELEMS // max(1, 2 * half))
    direct = 2 * half == in_f  # even in: a tile decodes straight into the result
    tmp = None if direct else np.empty((rows, 2 * half), np.float32)
    bs = int(block_size) if fmt.blockwise else None
    nfull = in_f // bs if bs else 0
    for o0 in range(0, out_f, rows):
        o1 = min(out_f, o0 + rows)
        v = res[o0:o1] if direct else tmp[: o1 - o0]  # [rows, 2 * half]
        np.take(table, qw[o0:o1], mode="clip", out=v.view(np.uint64))  # two float32 per byte
        s = scales[o0:o1]
        if bs is None:  # per channel: [rows, in] * [rows, 1]
            np.multiply(v, s[:, None], out=v)
        else:
            full = v[:, : nfull * bs].reshape(o1 - o0, nfull, bs)  # [rows, nfull, bs]
            np.multiply(full, s[:, :nfull, None], out=full)
            if nfull * bs < in_f:  # the short last block of every row
                np.multiply(v[:, nfull * bs :], s[:, nfull : nfull + 1], out=v[:, nfull * bs :])
        if not direct:
            res[o0:o1] = v[:, :in_f]  # drop the padding nibble of an odd `in`
    return res
