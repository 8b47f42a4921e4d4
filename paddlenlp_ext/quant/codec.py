"""Numpy quantize / dequantize of one Linear weight into the formats of :mod:`.formats`.

Owns :func:`quantize` (argument checks, the result dict, 8-bit double
quantization of the block scales), the inverse (:func:`dequantize`, the format
definition's plain decoder), the stored size (:func:`structure_nbytes`) and
the analytic error bound (:func:`max_abs_error_bound`).  The per-weight work
of :func:`quantize` -- absmax scales, rounding, nearest code, packing -- is
done by the vectorized encoders of :mod:`.encode`.  Layouts and the format
table are defined in :mod:`.formats`; nothing here imports paddle.
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

from . import encode as E
from .formats import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DOUBLE_QUANT_BLOCK_SIZE,
    check_shape,
    get_format,
)
from .formats import unpack_nibbles  # noqa: F401  (the doctests below use it)

__all__ = ["quantize", "dequantize", "block_scales", "structure_nbytes", "max_abs_error_bound"]

_DQ_QMAX = 127


def _max_half_gap(code: np.ndarray) -> float:
    """Half of the largest gap between consecutive (sorted, distinct) code values."""
    s = np.unique(code.astype(np.float64))
    return float(np.max(np.diff(s)) / 2.0)


def _to_numpy_2d(weight) -> np.ndarray:
    if hasattr(weight, "numpy") and not isinstance(weight, np.ndarray):  # paddle tensor
        if "bfloat16" in str(getattr(weight, "dtype", "")) or "float16" in str(getattr(weight, "dtype", "")):
            weight = weight.astype("float32")
        place = getattr(weight, "place", None)
        # a CPU tensor is read in place through DLPack (.numpy() would copy the whole fp32 weight once more)
        on_cpu = place is not None and hasattr(weight, "__dlpack__") and place.is_cpu_place()
        weight = np.from_dlpack(weight.detach()) if on_cpu else weight.numpy()
    w = np.asarray(weight)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D Linear weight [in_features, out_features], got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"quantize expects a floating point weight, got dtype {w.dtype}")
    return w.astype(np.float32, copy=False)


def _double_quantize(scales: np.ndarray, block: int):
    """8-bit double quantization of f32 block scales (mean removed, int8 absmax per ``block``)."""
    flat = scales.reshape(-1).astype(np.float32)
    offset = np.float32(flat.mean())
    centred = flat - offset
    n = centred.size
    nb2 = -(-n // block)
    padded = np.zeros(nb2 * block, dtype=np.float32)
    padded[:n] = centred
    padded = padded.reshape(nb2, block)
    dq_scale = (np.abs(padded).max(axis=1) / _DQ_QMAX).astype(np.float32)
    safe = np.where(dq_scale > 0, dq_scale, np.float32(1.0))
    q = np.clip(np.rint(padded / safe[:, None]), -_DQ_QMAX, _DQ_QMAX).astype(np.int8)
    return q.reshape(-1)[:n].reshape(scales.shape), dq_scale, np.array(offset, dtype=np.float32)


def _double_dequantize(qscale: np.ndarray, dq_scale: np.ndarray, offset, block: int) -> np.ndarray:
    flat = qscale.reshape(-1).astype(np.float32)
    per_elem = np.repeat(dq_scale.astype(np.float32), block)[: flat.size]
    return (flat * per_elem + np.float32(offset)).reshape(qscale.shape).astype(np.float32)


def quantize(
    weight,
    algo: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    double_quant: bool = False,
    double_quant_block_size: int = DEFAULT_DOUBLE_QUANT_BLOCK_SIZE,
) -> Dict[str, Any]:
    """Quantize a Linear weight ``[in_features, out_features]``.

    Args:
        weight: numpy array or paddle tensor ``[in, out]`` (any float dtype).
        algo: one of :data:`SUPPORTED_ALGOS`.
        block_size: nf4/fp4 block length along ``in_features`` (ignored for int8/int4).
        double_quant: nf4/fp4 only: 8-bit quantize the block scales.
        double_quant_block_size: block length of the double quantization.

    Returns a dict with the metadata keys ``algo``, ``in_features``,
    ``out_features``, ``block_size`` (``None`` for int algos), ``double_quant``,
    ``double_quant_block_size``, ``layout`` (``"out_in"``) and the numpy arrays
    described in the module docstring (``quant_weight`` plus ``quant_scale`` or
    ``qquant_scale``/``double_quant_scale``/``quant_scale_offset``).

    Worked example (int8, one output column with absmax 2.54 -> scale 0.02):

    >>> w = np.array([[2.54], [-1.0], [0.011]], dtype=np.float32)   # [in=3, out=1]
    >>> s = quantize(w, "weight_only_int8")
    >>> s["quant_weight"].tolist(), round(float(s["quant_scale"][0]), 6)
    ([[127, -50, 1]], 0.02)
    >>> np.round(dequantize(s).astype(np.float64), 4).ravel().tolist()
    [2.54, -1.0, 0.02]

    nf4, block of 4 inputs with absmax 2.0; w / absmax = [1, -0.5, 0.1, 0]
    -> nearest NF4 codes 15, 2 (-0.525), 8 (0.0796), 7 (0.0):

    >>> w = np.array([[2.0], [-1.0], [0.2], [0.0]], dtype=np.float32)
    >>> s = quantize(w, "nf4", block_size=4)
    >>> unpack_nibbles(s["quant_weight"]).tolist(), s["quant_scale"].tolist()
    ([[15, 2, 8, 7]], [[2.0]])
    >>> np.round(dequantize(s).astype(np.float64), 4).ravel().tolist()
    [2.0, -1.0501, 0.1592, 0.0]
    """
    fmt = get_format(algo)
    w = _to_numpy_2d(weight)
    in_f, out_f = w.shape
    check_shape(in_f, out_f, algo, block_size)
    if double_quant and not fmt.blockwise:
        raise ValueError(
            f"weight_double_quant is only defined for nf4/fp4 (block scales); {algo} has one scale per output "
            f"channel. Set weight_double_quant=False."
        )
    if double_quant and (int(double_quant_block_size) <= 0):
        raise ValueError(f"weight_double_quant_block_size must be positive, got {double_quant_block_size}")

    meta: Dict[str, Any] = {
        "algo": algo,
        "in_features": int(in_f),
        "out_features": int(out_f),
        "block_size": int(block_size) if fmt.blockwise else None,
        "double_quant": bool(double_quant),
        "double_quant_block_size": int(double_quant_block_size) if double_quant else None,
        "layout": "out_in",
    }
    if not fmt.blockwise:
        meta["quant_weight"], meta["quant_scale"] = E.quantize_per_channel(fmt, w)
        return meta

    meta["quant_weight"], absmax = E.quantize_blockwise(fmt, w, block_size)
    if double_quant:
        qs, dqs, off = _double_quantize(absmax, int(double_quant_block_size))
        meta["qquant_scale"] = qs
        meta["double_quant_scale"] = dqs
        meta["quant_scale_offset"] = off
    else:
        meta["quant_scale"] = absmax
    return meta


def block_scales(structure: Dict[str, Any]) -> np.ndarray:
    """The f32 scales used at dequantization time (after undoing double quant).

    Shape ``[out]`` for int algos, ``[out, ceil(in / block_size)]`` for nf4/fp4.
    """
    if structure.get("double_quant"):
        return _double_dequantize(
            structure["qquant_scale"],
            structure["double_quant_scale"],
            structure["quant_scale_offset"],
            int(structure["double_quant_block_size"]),
        )
    return np.asarray(structure["quant_scale"], dtype=np.float32)


def dequantize(structure: Dict[str, Any]) -> np.ndarray:
    """Rebuild the float32 weight ``[in_features, out_features]`` from :func:`quantize`'s output.

    >>> w = np.array([[0.5, -3.0], [-0.3, 1.6]], dtype=np.float32)  # [in=2, out=2]
    >>> s = quantize(w, "weight_only_int4")
    >>> s["quant_scale"].tolist()            # absmax / 7 per output column
    [0.0714285746216774, 0.4285714328289032]
    >>> unpack_nibbles(s["quant_weight"]).tolist()   # 7, -4 (=12) | -7 (=9), 4
    [[7, 12], [9, 4]]
    >>> np.round(dequantize(s).astype(np.float64), 4).tolist()
    [[0.5, -3.0], [-0.2857, 1.7143]]
    """
    fmt = get_format(structure.get("algo"))
    if structure.get("layout", "out_in") != "out_in":
        raise ValueError(
            f"dequantize only understands the portable 'out_in' layout, got {structure.get('layout')!r} "
            "(GPU kernel layouts are dequantized by QuantizedLinear.dequantize_weight)"
        )
    bs = int(structure["block_size"]) if fmt.blockwise else None
    wt = fmt.dequant(np.asarray(structure["quant_weight"]), block_scales(structure), int(structure["in_features"]), bs)
    return np.ascontiguousarray(wt.T.astype(np.float32))  # [out, in] -> [in, out]


def structure_nbytes(structure: Dict[str, Any]) -> int:
    """Bytes of the stored arrays (codes + scales) of a :func:`quantize` result.

    >>> structure_nbytes(quantize(np.ones((64, 8), np.float32), "nf4"))  # 256 B codes + 8 f32 scales
    288
    """
    return int(sum(v.nbytes for v in structure.values() if isinstance(v, np.ndarray)))


def max_abs_error_bound(structure: Dict[str, Any]) -> np.ndarray:
    """Per-element bound on ``|w - dequantize(quantize(w))|`` as ``[in, out]``.

    * int8/int4: ``scale / 2`` (round to nearest; absmax maps exactly to +-qmax).
    * nf4/fp4: ``half_max_gap(code) * absmax_block`` plus, with double
      quantization, the scale error ``double_quant_scale / 2`` (``|code| <= 1``).
      The half max gap is 0.1519 for NF4 and 0.1667 for FP4.
    """
    fmt = get_format(structure["algo"])
    in_f, out_f = int(structure["in_features"]), int(structure["out_features"])
    if not fmt.blockwise:
        return np.broadcast_to(np.asarray(structure["quant_scale"], np.float32)[None, :] / 2.0, (in_f, out_f))
    bs = int(structure["block_size"])
    hg = _max_half_gap(fmt.code)
    if structure.get("double_quant"):
        true_absmax = block_scales(structure)
        n = true_absmax.size
        blk = int(structure["double_quant_block_size"])
        extra = (np.repeat(structure["double_quant_scale"], blk)[:n] / 2.0).reshape(true_absmax.shape)
        # codes were chosen with the exact absmax a; |a - a_dq| <= extra, so
        # |w - c*a_dq| <= hg*a + extra <= hg*(a_dq + extra) + extra
        bound = hg * (np.abs(true_absmax) + extra) + extra
    else:
        bound = hg * np.asarray(structure["quant_scale"], np.float32)
    return np.ascontiguousarray(np.repeat(bound, bs, axis=1)[:, :in_f].T)  # [out, nblk] -> [in, out]
