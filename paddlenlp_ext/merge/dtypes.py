"""safetensors dtype tags and the bfloat16 bit conversions of the merge.

Owns: the tag <-> numpy tables (``NP_OF_TAG``, ``TAG_OF_NP``), which tags hold
float weights an adapter delta can be added to (``FLOAT_TAGS``), and the exact
float32 <-> bfloat16-bits conversions (numpy has no bfloat16 dtype, so bf16
tensors travel as uint16 arrays).
"""

from __future__ import annotations

import numpy as np

# safetensors dtype tag -> numpy dtype used to hold the raw data
NP_OF_TAG = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8,
}
# (the excluded tags share a numpy holder with a genuine integer tag, which must win)
TAG_OF_NP = {np.dtype(v): k for k, v in NP_OF_TAG.items() if k not in ("BF16", "F8_E4M3", "F8_E5M2")}
#: tags that hold floating-point weights an adapter delta can be added to.  "U16" is
#: PaddleNLP's bfloat16: paddle's ``Tensor.numpy()`` returns bf16 as uint16, and
#: ``save_pretrained`` writes it with the safetensors tag U16 (paddle.to_tensor of
#: a uint16 array is bfloat16 again).
FLOAT_TAGS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "U16": "bfloat16"}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 -> float32 (exact); same shape as ``bits``."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even (as paddle's cast); NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    out = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        # rounding could carry a NaN's payload into the exponent (-> inf); force a quiet-NaN bit instead
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def to_f32(arr: np.ndarray, tag: str) -> np.ndarray:
    """Raw data of a float tensor with safetensors tag ``tag`` -> float32, same shape."""
    return bf16_bits_to_f32(arr) if FLOAT_TAGS.get(tag) == "bfloat16" else np.asarray(arr, dtype=np.float32)


def from_f32(x: np.ndarray, tag: str) -> np.ndarray:
    """float32 -> the raw storage of tag ``tag`` (uint16 bits for bfloat16), same shape."""
    kind = FLOAT_TAGS[tag]
    if kind == "bfloat16":
        return f32_to_bf16_bits(x)
    return np.asarray(x, dtype=np.dtype(kind))
