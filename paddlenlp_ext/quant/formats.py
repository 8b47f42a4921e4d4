"""Weight quantization formats for frozen QLoRA base layers (pure numpy).

Everything here is a pure function over numpy arrays; ``linear.py`` holds the
paddle-side (forward-time) dequantization that mirrors :func:`dequantize`.

Weight convention
-----------------
Paddle's ``nn.Linear`` stores ``weight`` as ``[in_features, out_features]``
and computes ``y = x @ W + b``.  :func:`quantize` takes that ``[in, out]``
array and :func:`dequantize` gives it back in the same ``[in, out]`` shape.

Storage layout ("out_in")
-------------------------
All formats store the *transposed* weight, i.e. row ``o`` of every stored
array belongs to output channel ``o`` and walks along the input dimension
(the same orientation ``paddle.nn.quant.weight_quantize`` returns, and the
orientation bitsandbytes gets from torch's ``[out, in]`` weights):

==================  =========================  ===================================
algo                ``quant_weight``           scales
==================  =========================  ===================================
weight_only_int8    int8  ``[out, in]``        ``quant_scale`` f32 ``[out]``
weight_only_int4    uint8 ``[out, in // 2]``   ``quant_scale`` f32 ``[out]``
nf4 / fp4           uint8 ``[out, in // 2]``   ``quant_scale`` f32 ``[out, in // bs]``
nf4 / fp4 + dq      uint8 ``[out, in // 2]``   ``qquant_scale`` int8 ``[out, in // bs]``,
                                               ``double_quant_scale`` f32 ``[ceil(nb / 256)]``,
                                               ``quant_scale_offset`` f32 ``[]``
==================  =========================  ===================================

* int8 / int4: symmetric per-output-channel absmax.  ``scale = absmax / 127``
  (int8) or ``absmax / 7`` (int4), ``q = clip(rint(w / scale), -qmax, qmax)``.
  The int4 codes are 4-bit two's complement nibbles (``-7..7``).
* nf4 / fp4: blockwise absmax.  For each output channel the input dimension is
  cut into consecutive blocks of ``block_size`` elements; each block stores
  ``absmax`` (f32) and every element stores the index of the nearest code-book
  entry to ``w / absmax``.  Flattened row-major, block ``k`` covers stored
  elements ``[k*bs, (k+1)*bs)`` -- exactly the flat layout bitsandbytes and the
  PaddleSlim ``dequant_blockwise`` kernel expect, applied to ``W^T``.
* Packing: two 4-bit codes per byte; element ``2j`` goes to the *high* nibble
  and element ``2j + 1`` to the low nibble (bitsandbytes / PaddleSlim order).
* Double quantization (QLoRA paper, section 3): the f32 block absmax values
  ``c`` (one per block) are centred by their mean (``offset``), cut into blocks
  of ``double_quant_block_size`` (default 256) and quantized to 8 bit with a
  symmetric absmax scale per block (``int8``, ``scale2 = absmax(c - offset) / 127``).
  bitsandbytes uses its 8-bit "dynamic" float code instead of linear int8; the
  memory cost is identical (8 bit per block scale + one f32 per 256 blocks).

Unsupported shapes raise ``ValueError`` (no silent padding): nf4/fp4 need
``in_features % block_size == 0``; int4 needs an even ``in_features``.

Bytes per parameter (codes + scales, bias not counted), for ``in = out = 4096``:
int8 ~1.001, int4 ~0.501, nf4 0.5625, nf4 + double quant ~0.516.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import numpy as np

__all__ = [
    "SUPPORTED_ALGOS",
    "NF4_CODE",
    "FP4_CODE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DOUBLE_QUANT_BLOCK_SIZE",
    "code_book",
    "pack_nibbles",
    "unpack_nibbles",
    "quantize",
    "dequantize",
    "structure_nbytes",
    "check_shape",
    "max_abs_error_bound",
]

SUPPORTED_ALGOS = ("weight_only_int8", "weight_only_int4", "nf4", "fp4")
INT_ALGOS = ("weight_only_int8", "weight_only_int4")
BLOCK_ALGOS = ("nf4", "fp4")
DEFAULT_BLOCK_SIZE = 64
DEFAULT_DOUBLE_QUANT_BLOCK_SIZE = 256

# NF4 (QLoRA paper, appendix E / bitsandbytes ``get_4bit_type("nf4")``):
# quantiles of N(0, 1) normalised to [-1, 1]; 7 negative values, an exact zero
# and 8 positive values.  Index i is the 4-bit code i.
NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)

# FP4 (bitsandbytes ``get_4bit_type("fp4")``): E2M1 with bias 3 and no
# inf/nan.  Code bits are ``s e1 e0 m``; exponent 0 is subnormal (0 or 0.0625),
# otherwise value = 2**(4 - e) * (1 + m/2).  Raw values
# [0, 0.0625, 8, 12, 4, 6, 2, 3, -0, -0.0625, -8, -12, -4, -6, -2, -3]
# divided by their absmax (12).  Code 8 is "-0" (decodes to 0).
FP4_CODE = (
    np.array(
        [0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0],
        dtype=np.float64,
    )
    / 12.0
).astype(np.float32)

_INT_QMAX = {"weight_only_int8": 127, "weight_only_int4": 7}
_DQ_QMAX = 127
# elements processed per chunk while quantizing (bounds temporary memory)
_CHUNK_ELEMS = 1 << 22


def code_book(algo: str) -> np.ndarray:
    """Return the 16-entry float32 code book of a 4-bit format.

    ``nf4`` and ``fp4`` return :data:`NF4_CODE` / :data:`FP4_CODE`;
    ``weight_only_int4`` returns the two's complement nibble values
    ``[0, 1, ..., 7, -8, -7, ..., -1]`` (``-8`` is never produced).

    >>> code_book("nf4")[[0, 7, 15]].tolist()
    [-1.0, 0.0, 1.0]
    >>> [round(float(v) * 12, 4) for v in code_book("fp4")[:8]]
    [0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0]
    >>> code_book("weight_only_int4")[[7, 8, 15]].tolist()
    [7.0, -8.0, -1.0]
    """
    if algo == "nf4":
        return NF4_CODE.copy()
    if algo == "fp4":
        return FP4_CODE.copy()
    if algo == "weight_only_int4":
        return np.array([i if i < 8 else i - 16 for i in range(16)], dtype=np.float32)
    raise ValueError(f"code_book: {algo!r} has no 4-bit code book (use 'nf4', 'fp4' or 'weight_only_int4')")


def _max_half_gap(code: np.ndarray) -> float:
    """Half of the largest gap between consecutive (sorted, distinct) code values."""
    s = np.unique(code.astype(np.float64))
    return float(np.max(np.diff(s)) / 2.0)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes (values 0..15) two per byte along the last axis.

    Element ``2j`` goes to the high nibble, ``2j + 1`` to the low nibble.
    The last axis must have even length.

    >>> pack_nibbles(np.array([[1, 2, 15, 0]], dtype=np.uint8)).tolist()
    [[18, 240]]
    """
    codes = np.asarray(codes)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last axis must be even, got shape {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("pack_nibbles: codes must be in [0, 15]")
    c = codes.astype(np.uint8)
    return ((c[..., 0::2] << 4) | c[..., 1::2]).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., k]`` -> codes ``[..., 2k]``.

    >>> unpack_nibbles(np.array([[18, 240]], dtype=np.uint8)).tolist()
    [[1, 2, 15, 0]]
    """
    p = np.asarray(packed).astype(np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = p >> 4
    out[..., 1::2] = p & 0x0F
    return out


def _nearest_code(values: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Index (into ``code``) of the nearest code value for each element."""
    order = np.argsort(code, kind="stable")
    sorted_vals = code[order].astype(np.float64)
    keep = np.concatenate([[True], np.diff(sorted_vals) > 0])  # drop the duplicate -0 of fp4
    sorted_vals, order = sorted_vals[keep], order[keep]
    mids = (sorted_vals[:-1] + sorted_vals[1:]) / 2.0
    return order[np.searchsorted(mids, values.astype(np.float64), side="left")].astype(np.uint8)


def _to_numpy_2d(weight) -> np.ndarray:
    if hasattr(weight, "numpy") and not isinstance(weight, np.ndarray):  # paddle tensor
        if "bfloat16" in str(getattr(weight, "dtype", "")) or "float16" in str(getattr(weight, "dtype", "")):
            weight = weight.astype("float32")
        weight = weight.numpy()
    w = np.asarray(weight)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D Linear weight [in_features, out_features], got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"quantize expects a floating point weight, got dtype {w.dtype}")
    return w.astype(np.float32, copy=False)


def check_shape(in_features: int, out_features: int, algo: str, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Raise ``ValueError`` if a ``[in_features, out_features]`` weight cannot use ``algo``.

    >>> check_shape(128, 64, "nf4", 64)
    >>> check_shape(96, 64, "nf4", 64)
    Traceback (most recent call last):
    ...
    ValueError: nf4 cannot quantize a Linear layer of shape [in_features=96, out_features=64]: in_features must be divisible by weight_blocksize=64 (96 % 64 = 32). Use a weight_blocksize that divides 96 (e.g. 32), or leave this layer out via target_modules.
    """
    if algo not in SUPPORTED_ALGOS:
        raise ValueError(f"unknown weight_quantize_algo {algo!r}; supported: {list(SUPPORTED_ALGOS)}")
    shape = f"[in_features={in_features}, out_features={out_features}]"
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"{algo} cannot quantize an empty Linear layer of shape {shape}")
    if algo == "weight_only_int4" and in_features % 2:
        raise ValueError(
            f"{algo} cannot quantize a Linear layer of shape {shape}: two int4 codes are packed per byte along "
            f"in_features, so in_features must be even. Use weight_only_int8 for this layer, or leave it out via "
            f"target_modules."
        )
    if algo in BLOCK_ALGOS:
        if not isinstance(block_size, (int, np.integer)) or block_size <= 0 or block_size % 2:
            raise ValueError(f"weight_blocksize must be a positive even integer for {algo}, got {block_size!r}")
        if in_features % block_size:
            g = math.gcd(in_features, block_size)
            hint = f" (e.g. {g})" if g % 2 == 0 and g > 1 else ""
            raise ValueError(
                f"{algo} cannot quantize a Linear layer of shape {shape}: in_features must be divisible by "
                f"weight_blocksize={block_size} ({in_features} % {block_size} = {in_features % block_size}). "
                f"Use a weight_blocksize that divides {in_features}{hint}, or leave this layer out via target_modules."
            )


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
    if algo not in SUPPORTED_ALGOS:
        raise ValueError(f"unknown weight_quantize_algo {algo!r}; supported: {list(SUPPORTED_ALGOS)}")
    w = _to_numpy_2d(weight)
    in_f, out_f = w.shape
    check_shape(in_f, out_f, algo, block_size)
    if double_quant and algo not in BLOCK_ALGOS:
        raise ValueError(
            f"weight_double_quant is only defined for nf4/fp4 (block scales); {algo} has one scale per output "
            f"channel. Set weight_double_quant=False."
        )
    if double_quant and (int(double_quant_block_size) <= 0):
        raise ValueError(f"weight_double_quant_block_size must be positive, got {double_quant_block_size}")

    wt = np.ascontiguousarray(w.T)  # [out, in]
    meta: Dict[str, Any] = {
        "algo": algo,
        "in_features": int(in_f),
        "out_features": int(out_f),
        "block_size": int(block_size) if algo in BLOCK_ALGOS else None,
        "double_quant": bool(double_quant),
        "double_quant_block_size": int(double_quant_block_size) if double_quant else None,
        "layout": "out_in",
    }
    rows = max(1, _CHUNK_ELEMS // max(in_f, 1))

    if algo in INT_ALGOS:
        qmax = _INT_QMAX[algo]
        scale = (np.abs(wt).max(axis=1) / qmax).astype(np.float32)  # [out]
        safe = np.where(scale > 0, scale, np.float32(1.0))
        if algo == "weight_only_int8":
            q = np.empty((out_f, in_f), dtype=np.int8)
        else:
            q = np.empty((out_f, in_f // 2), dtype=np.uint8)
        for r0 in range(0, out_f, rows):
            r1 = min(out_f, r0 + rows)
            qi = np.clip(np.rint(wt[r0:r1] / safe[r0:r1, None]), -qmax, qmax).astype(np.int8)
            if algo == "weight_only_int8":
                q[r0:r1] = qi
            else:
                q[r0:r1] = pack_nibbles((qi.astype(np.int16) & 0x0F).astype(np.uint8))
        meta["quant_weight"] = q
        meta["quant_scale"] = scale
        return meta

    code = code_book(algo)
    nblk = in_f // block_size
    absmax = np.abs(wt.reshape(out_f, nblk, block_size)).max(axis=2).astype(np.float32)  # [out, nblk]
    safe = np.where(absmax > 0, absmax, np.float32(1.0))
    q = np.empty((out_f, in_f // 2), dtype=np.uint8)
    for r0 in range(0, out_f, rows):
        r1 = min(out_f, r0 + rows)
        normed = wt[r0:r1].reshape(r1 - r0, nblk, block_size) / safe[r0:r1, :, None]
        idx = _nearest_code(normed.reshape(r1 - r0, in_f), code)
        q[r0:r1] = pack_nibbles(idx)
    meta["quant_weight"] = q
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

    Shape ``[out]`` for int algos, ``[out, in // block_size]`` for nf4/fp4.
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
    algo = structure.get("algo")
    if algo not in SUPPORTED_ALGOS:
        raise ValueError(f"unknown weight_quantize_algo {algo!r}; supported: {list(SUPPORTED_ALGOS)}")
    if structure.get("layout", "out_in") != "out_in":
        raise ValueError(
            f"dequantize only understands the portable 'out_in' layout, got {structure.get('layout')!r} "
            "(GPU kernel layouts are dequantized by QuantizedLinear.dequantize_weight)"
        )
    in_f, out_f = int(structure["in_features"]), int(structure["out_features"])
    qw = np.asarray(structure["quant_weight"])
    scale = block_scales(structure)
    if algo == "weight_only_int8":
        wt = qw.astype(np.float32) * scale[:, None]
    elif algo == "weight_only_int4":
        wt = code_book(algo)[unpack_nibbles(qw)] * scale[:, None]
    else:
        bs = int(structure["block_size"])
        vals = code_book(algo)[unpack_nibbles(qw)].reshape(out_f, in_f // bs, bs)
        wt = (vals * scale[:, :, None]).reshape(out_f, in_f)
    return np.ascontiguousarray(wt.T.astype(np.float32))


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
    algo = structure["algo"]
    in_f, out_f = int(structure["in_features"]), int(structure["out_features"])
    if algo in INT_ALGOS:
        return np.broadcast_to(np.asarray(structure["quant_scale"], np.float32)[None, :] / 2.0, (in_f, out_f))
    bs = int(structure["block_size"])
    hg = _max_half_gap(code_book(algo))
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
    return np.repeat(bound, bs, axis=1).T.reshape(in_f, out_f)
