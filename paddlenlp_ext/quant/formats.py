"""Weight quantization formats for frozen QLoRA base layers (pure numpy).

Owns the format table (:data:`FORMATS`: one :class:`QuantFormat` per
``weight_quantize_algo`` -- storage, bits, blockwise or per-channel, default
block size, code book, numpy decoder, GPU kernel), the code books, nibble
packing and the shape check.  The rest of ``quant/`` looks format properties
up here instead of comparing algo names.  :mod:`.codec` quantizes and
dequantizes with these formats (numpy); ``linear.py`` holds the paddle-side
(forward-time) dequantization that mirrors :func:`.codec.dequantize`.

Weight convention
-----------------
Paddle's ``nn.Linear`` stores ``weight`` as ``[in_features, out_features]``
and computes ``y = x @ W + b``.  :func:`.codec.quantize` takes that ``[in, out]``
array and :func:`.codec.dequantize` gives it back in the same ``[in, out]`` shape.

Storage layout ("out_in")
-------------------------
All formats store the *transposed* weight, i.e. row ``o`` of every stored
array belongs to output channel ``o`` and walks along the input dimension
(the same orientation ``paddle.nn.quant.weight_quantize`` returns, and the
orientation bitsandbytes gets from torch's ``[out, in]`` weights):

==================  ===============================  ======================================
algo                ``quant_weight``                 scales (``nblk = ceil(in / bs)``)
==================  ===============================  ======================================
weight_only_int8    int8  ``[out, in]``              ``quant_scale`` f32 ``[out]``
weight_only_int4    uint8 ``[out, in // 2]``         ``quant_scale`` f32 ``[out]``
nf4 / fp4           uint8 ``[out, ceil(in / 2)]``    ``quant_scale`` f32 ``[out, nblk]``
nf4 / fp4 + dq      uint8 ``[out, ceil(in / 2)]``    ``qquant_scale`` int8 ``[out, nblk]``,
                                                     ``double_quant_scale`` f32 ``[ceil(out * nblk / 256)]``,
                                                     ``quant_scale_offset`` f32 ``[]``
==================  ===============================  ======================================

* int8 / int4: symmetric per-output-channel absmax.  ``scale = absmax / 127``
  (int8) or ``absmax / 7`` (int4), ``q = clip(rint(w / scale), -qmax, qmax)``.
  The int4 codes are 4-bit two's complement nibbles (``-7..7``).
* nf4 / fp4: blockwise absmax.  For each output channel the input dimension is
  cut into consecutive blocks of ``block_size`` elements; each block stores
  ``absmax`` (f32) and every element stores the index of the nearest code-book
  entry to ``w / absmax`` (a tie goes to the smaller code value).  When
  ``block_size`` divides ``in``, flattened row-major, block ``k`` covers stored
  elements ``[k*bs, (k+1)*bs)`` -- exactly the flat layout bitsandbytes and the
  PaddleSlim ``dequant_blockwise`` kernel expect, applied to ``W^T``.
* Any shape works for nf4 / fp4: when ``block_size`` does not divide ``in``,
  the last block of every output channel is short (``in % bs`` elements; its
  absmax is over those), and an odd ``in`` leaves one padding nibble at the end
  of each row (the code of 0.0).  Like bitsandbytes' padded last block, only
  cut per channel, so the rows stay aligned: the cost is one more scale per
  channel (nf4, ``in = 176``, ``bs = 64``: 0.568 instead of 0.5625 bytes/param).
  PaddleSlim's flat-block kernel does not decode this, so such layers take the
  portable path on GPU too.
* Packing: two 4-bit codes per byte; element ``2j`` goes to the *high* nibble
  and element ``2j + 1`` to the low nibble (bitsandbytes / PaddleSlim order).
* Double quantization (QLoRA paper, section 3): the f32 block absmax values
  ``c`` (one per block) are centred by their mean (``offset``), cut into blocks
  of ``double_quant_block_size`` (default 256) and quantized to 8 bit with a
  symmetric absmax scale per block (``int8``, ``scale2 = absmax(c - offset) / 127``).
  bitsandbytes uses its 8-bit "dynamic" float code instead of linear int8; the
  memory cost is identical (8 bit per block scale + one f32 per 256 blocks).

Unsupported shapes raise ``ValueError``: int4 needs an even ``in_features``
(two codes per byte along ``in``; int8 takes any shape).

Bytes per parameter (codes + scales, bias not counted), for ``in = out = 4096``:
int8 ~1.001, int4 ~0.501, nf4 0.5625, nf4 + double quant ~0.516.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import numpy as np

__all__ = [
    "QuantFormat",
    "FORMATS",
    "get_format",
    "SUPPORTED_ALGOS",
    "INT_ALGOS",
    "BLOCK_ALGOS",
    "NF4_CODE",
    "FP4_CODE",
    "INT4_CODE",
    "KERNEL_WEIGHT_ONLY",
    "KERNEL_DEQUANT_BLOCKWISE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DOUBLE_QUANT_BLOCK_SIZE",
    "code_book",
    "pack_nibbles",
    "unpack_nibbles",
    "check_shape",
    "check_target_shape",
]

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

# weight_only_int4: nibble i decodes as 4-bit two's complement (0..7, -8..-1); -8 is never produced.
INT4_CODE = np.array([i if i < 8 else i - 16 for i in range(16)], dtype=np.float32)

# storage kinds of ``quant_weight`` (QuantFormat.storage)
STORAGE_INT8 = "int8"  # one int8 code per weight
STORAGE_INT4 = "packed_int4"  # two 4-bit two's complement codes per uint8
STORAGE_NF4 = "nf4_codes"  # two NF4 code-book indices per uint8
STORAGE_FP4 = "fp4_codes"  # two FP4 code-book indices per uint8

# GPU kernels a format can use (QuantFormat.gpu_kernel)
KERNEL_WEIGHT_ONLY = "weight_only_linear"  # paddle.nn.quant fused weight-only GEMM (its own layout)
KERNEL_DEQUANT_BLOCKWISE = "dequant_blockwise"  # PaddleSlim custom op, decodes our portable layout


def _dequant_per_channel(fmt: "QuantFormat", qw: np.ndarray, scale: np.ndarray, in_f: int, bs) -> np.ndarray:
    """Stored codes ``[out, in * bits / 8]`` and scales ``[out]`` -> weight ``[out, in]``."""
    vals = qw.astype(np.float32) if fmt.code is None else fmt.code[unpack_nibbles(qw)]  # [out, in]
    return vals * scale[:, None]


def _dequant_blockwise(fmt: "QuantFormat", qw: np.ndarray, scale: np.ndarray, in_f: int, bs: int) -> np.ndarray:
    """Packed codes ``[out, ceil(in / 2)]`` and block scales ``[out, ceil(in / bs)]`` -> weight ``[out, in]``."""
    vals = fmt.code[unpack_nibbles(qw)][:, :in_f]  # [out, in] (an odd in drops its padding nibble)
    return vals * np.repeat(scale, bs, axis=1)[:, :in_f]  # block k scales inputs [k*bs, (k+1)*bs)


@dataclass(frozen=True)
class QuantFormat:
    """Everything ``quant/`` needs to know about one ``weight_quantize_algo``."""

    name: str
    #: what ``quant_weight`` holds (``STORAGE_*``)
    storage: str
    #: bits per weight code; 4-bit codes are packed two per byte (high nibble first)
    bits: int
    #: True: one absmax per block of ``block_size`` inputs; False: one scale per output channel
    blockwise: bool
    #: block size when the caller gives none (None for per-channel formats)
    default_block_size: Optional[int]
    #: 16-entry float32 decoding table of a 4-bit format; None for int8 (the code is the value)
    code: Optional[np.ndarray] = field(repr=False, compare=False)
    #: largest integer code of a per-channel format (``scale = absmax / qmax``); None for blockwise
    qmax: Optional[int]
    #: numpy ``(fmt, quant_weight, scales, in_features, block_size) -> [out, in]``
    dequant_fn: Callable[..., np.ndarray] = field(repr=False, compare=False)
    #: ``KERNEL_WEIGHT_ONLY`` or ``KERNEL_DEQUANT_BLOCKWISE``
    gpu_kernel: str
    #: ``weight_dtype`` argument of ``weight_only_linear`` (None for PaddleSlim formats)
    kernel_weight_dtype: Optional[str]

    @property
    def code_dtype(self) -> type:
        """numpy dtype of the portable ``quant_weight``: int8 codes, or uint8 bytes of two nibbles."""
        return np.int8 if self.bits == 8 else np.uint8

    def packed_in(self, in_features: int) -> int:
        """Bytes per output row of the portable ``quant_weight`` (``[out, ceil(in * bits / 8)]``)."""
        return -(-in_features * self.bits // 8)

    def num_blocks(self, in_features: int, block_size: int) -> int:
        """Scales per output channel of a blockwise format: ``ceil(in / bs)`` (the last block may be short)."""
        return -(-int(in_features) // int(block_size))

    def dequant(self, qw: np.ndarray, scale: np.ndarray, in_features: int, block_size: Optional[int]) -> np.ndarray:
        """Stored codes + f32 scales -> the float32 weight ``[out, in]`` (see :func:`.codec.dequantize`)."""
        return self.dequant_fn(self, qw, scale, in_features, block_size)


#: weight_quantize_algo -> format; the order is the order of SUPPORTED_ALGOS
FORMATS: Dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat(name="weight_only_int8", storage=STORAGE_INT8, bits=8, blockwise=False,
                    default_block_size=None, code=None, qmax=127, dequant_fn=_dequant_per_channel,
                    gpu_kernel=KERNEL_WEIGHT_ONLY, kernel_weight_dtype="int8"),
        QuantFormat(name="weight_only_int4", storage=STORAGE_INT4, bits=4, blockwise=False,
                    default_block_size=None, code=INT4_CODE, qmax=7, dequant_fn=_dequant_per_channel,
                    gpu_kernel=KERNEL_WEIGHT_ONLY, kernel_weight_dtype="int4"),
        QuantFormat(name="nf4", storage=STORAGE_NF4, bits=4, blockwise=True,
                    default_block_size=DEFAULT_BLOCK_SIZE, code=NF4_CODE, qmax=None, dequant_fn=_dequant_blockwise,
                    gpu_kernel=KERNEL_DEQUANT_BLOCKWISE, kernel_weight_dtype=None),
        QuantFormat(name="fp4", storage=STORAGE_FP4, bits=4, blockwise=True,
                    default_block_size=DEFAULT_BLOCK_SIZE, code=FP4_CODE, qmax=None, dequant_fn=_dequant_blockwise,
                    gpu_kernel=KERNEL_DEQUANT_BLOCKWISE, kernel_weight_dtype=None),
    )
}  # fmt: skip

# derived names (imported by tests, docs and error messages)
SUPPORTED_ALGOS = tuple(FORMATS)
INT_ALGOS = tuple(n for n, f in FORMATS.items() if not f.blockwise)
BLOCK_ALGOS = tuple(n for n, f in FORMATS.items() if f.blockwise)


def get_format(algo: str) -> QuantFormat:
    """The :class:`QuantFormat` of ``algo``; ``ValueError`` naming the supported algos otherwise.

    >>> get_format("nf4").blockwise, get_format("weight_only_int4").kernel_weight_dtype
    (True, 'int4')
    """
    fmt = FORMATS.get(algo) if isinstance(algo, str) else None
    if fmt is None:
        raise ValueError(f"unknown weight_quantize_algo {algo!r}; supported: {list(SUPPORTED_ALGOS)}")
    return fmt


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
    fmt = FORMATS.get(algo) if isinstance(algo, str) else None
    if fmt is None or fmt.code is None:
        raise ValueError(f"code_book: {algo!r} has no 4-bit code book (use 'nf4', 'fp4' or 'weight_only_int4')")
    return fmt.code.copy()


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


def check_shape(in_features: int, out_features: int, algo: str, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Raise ``ValueError`` if a ``[in_features, out_features]`` weight cannot use ``algo``.

    nf4/fp4 take any shape (a short last block per channel, see the module
    docstring); int4 needs an even ``in_features``.

    >>> check_shape(176, 64, "nf4", 64)
    >>> check_shape(175, 64, "weight_only_int4")
    Traceback (most recent call last):
    ...
    ValueError: weight_only_int4 cannot quantize a Linear layer of shape [in_features=175, out_features=64]: two int4 codes are packed per byte along in_features, so in_features must be even. Use weight_only_int8 for this layer, or leave it out via target_modules.
    """
    fmt = get_format(algo)
    shape = f"[in_features={in_features}, out_features={out_features}]"
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"{algo} cannot quantize an empty Linear layer of shape {shape}")
    if fmt.bits == 4 and not fmt.blockwise and in_features % 2:  # blockwise: a padding nibble per row
        raise ValueError(
            f"{algo} cannot quantize a Linear layer of shape {shape}: two int4 codes are packed per byte along "
            f"in_features, so in_features must be even. Use weight_only_int8 for this layer, or leave it out via "
            f"target_modules."
        )
    if fmt.blockwise:
        # even: a block starts on a byte boundary of every row, as in bitsandbytes / PaddleSlim
        if not isinstance(block_size, (int, np.integer)) or block_size <= 0 or block_size % 2:
            raise ValueError(f"weight_blocksize must be a positive even integer for {algo}, got {block_size!r}")


def check_target_shape(
    name: str, in_features: int, out_features: int, algo: str, block_size: int = DEFAULT_BLOCK_SIZE
) -> None:
    """:func:`check_shape` for the layer called ``name``: the ``ValueError`` starts with ``layer '<name>': ``.

    What :func:`~paddlenlp_ext.models.quantize.quantize_model` runs on every target
    before it replaces anything; a checkpoint loader that quantizes while it
    streams calls it on every target first, so a bad layer fails before any work.

    >>> check_target_shape("layers.0.mlp.down_proj", 176, 64, "nf4", 64)
    >>> check_target_shape("layers.0.mlp.down_proj", 7, 64, "weight_only_int4")
    Traceback (most recent call last):
    ...
    ValueError: layer 'layers.0.mlp.down_proj': weight_only_int4 cannot quantize a Linear layer of shape [in_features=7, out_features=64]: two int4 codes are packed per byte along in_features, so in_features must be even. Use weight_only_int8 for this layer, or leave it out via target_modules.
    """
    try:
        check_shape(in_features, out_features, algo, block_size)
    except ValueError as e:
        raise ValueError(f"layer '{name}': {e}") from None
