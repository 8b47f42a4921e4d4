"""Vectorized numpy encoders behind :func:`.codec.quantize` (no paddle import).

Owns the hot loops of quantization: per-channel absmax + rounding (int8/int4),
blockwise absmax + nearest code-book entry (nf4/fp4) and the nibble packing.
:mod:`.codec` owns the format semantics, double quantization and the public
API; the results here are bit-identical to the straightforward definitions
written there (``tests/test_quant.py`` checks against such a reference).

Why it looks the way it does (a 0.85B model must quantize in seconds):

* The weight is read in Paddle's own ``[in, out]`` orientation, in tiles of
  about 64K elements whose float32 temporaries stay in the L2 cache; each
  tile's *codes* (1 or 0.5 byte per weight) are stored transposed into the
  ``[out, in]`` result, so the float32 weight is never transposed or copied.  A block of
  ``block_size`` inputs of one output channel is a column segment of a tile,
  so its absmax is a max over tile rows.
* Nearest code without distances or ``searchsorted``: the high 16 bits of a
  float32 (sign, exponent, 7 mantissa bits) name one of 65536 buckets of
  consecutive floats.  A bucket table gives the number of code-book midpoints
  below the bucket (``lo``) and the one midpoint that can fall inside it
  (``thr``, +inf if none), so ``index = lo + (v > thr)``: two table lookups and
  one compare per weight, exact for every float32 (ties at a midpoint go to
  the smaller code value, NaN to the largest, as ``searchsorted(side="left")``).
* Blocks are cut per output channel; a short last block (``in % block_size``)
  and an odd ``in`` are handled by zero-padding the last row tile: zeros do not
  change an absmax, and the padded positions are not stored (an odd ``in``
  keeps one padding nibble per channel, the code of 0.0).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .formats import QuantFormat

__all__ = ["quantize_per_channel", "quantize_blockwise", "nearest_code", "nearest_code_tables"]

#: elements per tile: every float32 temporary of a tile is 256 KiB (L2-sized on current x86)
_TILE_ELEMS = 1 << 16
#: rows per tile (rounded up to whole blocks): square-ish tiles make the transposed store of the codes cheap
_MIN_ROWS = 256


class CodeTables(NamedTuple):
    """Bucket tables of one 4-bit code book (see the module docstring)."""

    #: uint8 [65536]: midpoints below each bucket of float32 high halves
    lo: np.ndarray
    #: float32 [65536]: the midpoint inside the bucket, rounded down to float32 (+inf if none)
    thr: np.ndarray
    #: uint8 [256]: packed byte of two sorted-order indices -> packed byte of code indices; None if sorted
    byte_perm: Optional[np.ndarray]


def _sorted_code(code: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(distinct code values ascending as float64, their code indices); a duplicate (fp4's -0) keeps its first index."""
    order = np.argsort(code, kind="stable")
    vals = code[order].astype(np.float64)
    keep = np.concatenate([[True], np.diff(vals) > 0])
    return vals[keep], order[keep]


@functools.lru_cache(maxsize=8)
def _tables(code_bytes: bytes) -> CodeTables:
    code = np.frombuffer(code_bytes, dtype=np.float32)
    vals, order = _sorted_code(code)
    mids = (vals[:-1] + vals[1:]) / 2.0  # float64, exact for float32 neighbours
    # float32 v:  mid < v  <=>  v > t  where t = mid rounded down to float32 (t == mid if representable)
    t = mids.astype(np.float32)
    t = np.where(t.astype(np.float64) > mids, np.nextafter(t, np.float32(-np.inf)), t).astype(np.float32)

    hi = np.arange(1 << 16, dtype=np.uint32)
    first = (hi << 16).view(np.float32)  # bit pattern xxxx0000 of each bucket
    last = ((hi << 16) | 0xFFFF).view(np.float32)  # xxxxFFFF
    neg = hi >= 0x8000  # negative floats: larger bit patterns are smaller values
    vmin, vmax = np.where(neg, last, first), np.where(neg, first, last)  # value range of each bucket
    nan = np.isnan(vmin) | np.isnan(vmax)  # NaN buckets (and +-inf's, which a normalized weight never is)
    with np.errstate(invalid="ignore"):
        lo = np.searchsorted(mids, vmin.astype(np.float64), side="left")  # midpoints < vmin
        lo_max = np.searchsorted(mids, vmax.astype(np.float64), side="left")  # midpoints < vmax
    inside = lo_max - lo  # midpoints m with vmin <= m < vmax: decided per element
    if np.any(inside[~nan] > 1):  # cannot happen for 16 codes spread over [-1, 1]; guards a new code book
        raise ValueError("code book too dense for 16-bit bucket tables")
    thr = np.full(1 << 16, np.inf, dtype=np.float32)
    one = (inside == 1) & ~nan
    thr[one] = t[lo[one]]
    lo = np.where(nan, len(mids), lo).astype(np.uint8)  # NaN sorts last, as in searchsorted

    byte_perm = None
    if not np.array_equal(order, np.arange(len(order))):
        b = np.arange(256)
        o = np.concatenate([order, np.zeros(16 - len(order), order.dtype)]).astype(np.uint8)  # pad: unused slots
        byte_perm = ((o[b >> 4] << 4) | o[b & 0x0F]).astype(np.uint8)
    return CodeTables(lo, thr, byte_perm)


def nearest_code_tables(code: np.ndarray) -> CodeTables:
    """The (cached) bucket tables of a 16-entry float32 code book."""
    return _tables(np.ascontiguousarray(code, dtype=np.float32).tobytes())


def nearest_code(values: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Index (into ``code``) of the nearest code value of each float32 element; ties -> smaller value.

    >>> nearest_code(np.array([-1.0, 0.03, 0.04, 0.9], np.float32), np.array(
    ...     [-1.0, 0.0, 0.08, 1.0] + [2.0] * 12, np.float32)).tolist()   # midpoint 0.04 ties down
    [0, 1, 1, 3]
    """
    tb = nearest_code_tables(code)
    v = np.ascontiguousarray(values, dtype=np.float32)
    key = (v.view(np.uint32) >> 16).astype(np.intp)  # [...] bucket of each value
    idx = np.take(tb.lo, key) + (v > np.take(tb.thr, key))  # sorted-order index
    _, order = _sorted_code(np.asarray(code, np.float32))
    return order[idx].astype(np.uint8)


def _row_tiles(in_f: int, rows: int):
    """(r0, r1) row ranges of ``rows`` rows; the last one may be short."""
    return [(r0, min(in_f, r0 + rows)) for r0 in range(0, in_f, rows)]


def _tile_shape(in_f: int, out_f: int, unit: int) -> Tuple[int, int]:
    """Rows (a multiple of ``unit``) and columns of a tile of about ``_TILE_ELEMS`` elements."""
    rows = unit * max(1, -(-_MIN_ROWS // unit))
    rows = min(rows, unit * -(-in_f // unit))
    cols = max(1, min(out_f, _TILE_ELEMS // rows))
    return rows, cols


def _padded(w: np.ndarray, r0: int, r1: int, c0: int, c1: int, prows: int, buf: np.ndarray) -> np.ndarray:
    """Tile ``w[r0:r1, c0:c1]`` with ``prows`` rows: a view, or a zero-padded copy in ``buf``."""
    if r1 - r0 == prows:
        return w[r0:r1, c0:c1]
    t = buf[: prows * (c1 - c0)].reshape(prows, c1 - c0)
    t[r1 - r0 :] = 0.0
    t[: r1 - r0] = w[r0:r1, c0:c1]
    return t


def _pack_rows(idx: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Codes ``[2k, n]`` (uint8 0..15) -> bytes ``[k, n]``: row ``2j`` in the high nibble, ``2j + 1`` low."""
    np.left_shift(idx[0::2], 4, out=out)
    np.bitwise_or(out, idx[1::2], out=out)
    return out


def quantize_blockwise(fmt: QuantFormat, w: np.ndarray, block_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """``w`` float32 ``[in, out]`` -> (codes uint8 ``[out, ceil(in / 2)]``, absmax f32 ``[out, ceil(in / bs)]``).

    Per output channel, block ``k`` covers inputs ``[k * bs, (k + 1) * bs)`` (the
    last block may be short); codes are nearest code-book indices of ``w / absmax``.
    """
    in_f, out_f = w.shape
    bs = int(block_size)
    tb = nearest_code_tables(fmt.code)
    nblk, half = -(-in_f // bs), -(-in_f // 2)
    rows, cols = _tile_shape(in_f, out_f, bs)
    codes = np.empty((out_f, half), np.uint8)  # [out, ceil(in / 2)]
    scales_t = np.empty((nblk, out_f), np.float32)  # [nblk, out], transposed at the end (1/bs of the weight)
    n = rows * cols
    f_v, f_tmp, f_pad = (np.empty(n, np.float32) for _ in range(3))  # f_tmp: |x|, then the thresholds
    i_key = np.empty(n, np.intp)
    u_lo, u_pk, b_gt = np.empty(n, np.uint8), np.empty(n // 2, np.uint8), np.empty(n, np.bool_)
    for r0, r1 in _row_tiles(in_f, rows):
        prows = bs * -(-(r1 - r0) // bs)  # whole blocks (even: bs is even)
        kb = prows // bs
        for c0 in range(0, out_f, cols):
            c1 = min(out_f, c0 + cols)
            nc, m = c1 - c0, prows * (c1 - c0)
            x = _padded(w, r0, r1, c0, c1, prows, f_pad)  # [prows, nc]
            amax = np.abs(x, out=f_tmp[:m].reshape(prows, nc)).reshape(kb, bs, nc).max(axis=1)  # [kb, nc]
            scales_t[r0 // bs : r0 // bs + kb, c0:c1] = amax
            amax[~(amax > 0)] = 1.0  # divisor: an all-zero block gets codes of 0 and keeps scale 0
            v = np.divide(x.reshape(kb, bs, nc), amax[:, None, :], out=f_v[:m].reshape(kb, bs, nc))  # [kb, bs, nc]
            v = v.reshape(prows, nc)
            key = np.right_shift(v.view(np.uint32), 16, out=i_key[:m].reshape(prows, nc), casting="unsafe")
            lo = np.take(tb.lo, key, mode="clip", out=u_lo[:m].reshape(prows, nc))  # [prows, nc] sorted index
            th = np.take(tb.thr, key, mode="clip", out=f_tmp[:m].reshape(prows, nc))
            lo += np.greater(v, th, out=b_gt[:m].reshape(prows, nc)).view(np.uint8)
            pk = _pack_rows(lo, u_pk[: m // 2].reshape(prows // 2, nc))  # [prows / 2, nc]
            if tb.byte_perm is not None:  # sorted order -> code indices, two at a time
                np.take(tb.byte_perm, pk, mode="clip", out=pk)
            keep = -(-(r1 - r0) // 2)  # an odd `in` keeps one padding nibble (the code of 0.0)
            codes[c0:c1, r0 // 2 : r0 // 2 + keep] = pk[:keep].T
    return codes, np.ascontiguousarray(scales_t.T)


def quantize_per_channel(fmt: QuantFormat, w: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``w`` float32 ``[in, out]`` -> (codes ``[out, in * bits / 8]``, scales f32 ``[out]``), symmetric absmax.

    ``scale = absmax / qmax``; ``q = clip(rint(w / scale), -qmax, qmax)``; int4
    codes are 4-bit two's complement nibbles packed along ``in``.
    """
    in_f, out_f = w.shape
    rows, cols = _tile_shape(in_f, out_f, 2 if fmt.bits == 4 else 1)
    colmax = np.zeros(out_f, np.float32)
    for r0, r1 in _row_tiles(in_f, 64):  # pass 1: absmax of every output channel (64 rows: bounded temporary)
        np.maximum(colmax, np.abs(w[r0:r1]).max(axis=0), out=colmax)
    scale = (colmax / fmt.qmax).astype(np.float32)  # [out]
    safe = np.where(scale > 0, scale, np.float32(1.0))  # all-zero channel: codes 0, scale 0
    codes = np.empty((out_f, fmt.packed_in(in_f)), fmt.code_dtype)  # [out, in * bits / 8]
    n = rows * cols
    f_q, i_q, u_pk = np.empty(n, np.float32), np.empty(n, np.int8), np.empty(n // 2, np.uint8)
    for r0, r1 in _row_tiles(in_f, rows):  # pass 2: codes
        for c0 in range(0, out_f, cols):
            c1 = min(out_f, c0 + cols)
            shape, m = (r1 - r0, c1 - c0), (r1 - r0) * (c1 - c0)
            q = np.divide(w[r0:r1, c0:c1], safe[c0:c1], out=f_q[:m].reshape(shape))  # [rows, nc]
            np.rint(q, out=q)
            np.clip(q, -fmt.qmax, fmt.qmax, out=q)
            qi = i_q[:m].reshape(shape)
            np.copyto(qi, q, casting="unsafe")
            if fmt.bits == 8:
                codes[c0:c1, r0:r1] = qi.T
            else:  # two's complement nibbles: the low 4 bits of the int8 code
                nib = np.bitwise_and(qi, 0x0F, out=qi).view(np.uint8)
                pk = _pack_rows(nib, u_pk[: m // 2].reshape(shape[0] // 2, shape[1]))  # [rows / 2, nc]
                codes[c0:c1, r0 // 2 : r1 // 2] = pk.T
    return codes, scale
