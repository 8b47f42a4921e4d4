"""The merge arithmetic: ``weight += compute_delta(...)`` in place, in fp32, in row blocks.

Owns: adding one adapted module's delta to its freshly read base weight
(``add_delta_inplace``), the cast back to the checkpoint dtype (one rounding
for bf16/fp16), the threading of row blocks and the BLAS thread limit, and the
dtype that decides the default verification tolerance (``merge_dtype``).
The delta formulas themselves live in ``paddlenlp_ext.adapters`` (``compute_delta``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Mapping, Optional

import numpy as np

from ..adapters.config import AdapterConfig
from .dtypes import FLOAT_TAGS, from_f32, to_f32
from .reader import TensorEntry

#: elements of the delta computed per compute_delta call (~1 MiB of fp32 per block, cache-sized)
CHUNK_ELEMENTS = 2**18
#: threads that merge row blocks of one weight in parallel (numpy releases the GIL)
MERGE_THREADS = max(1, min(4, os.cpu_count() or 1))


def merge_dtype(targets: Mapping[str, TensorEntry]) -> str:
    """The loosest float dtype among the merged weights (decides the default tolerance)."""
    kinds = {FLOAT_TAGS[e.dtype] for e in targets.values()}
    for k in ("bfloat16", "float16", "float32", "float64"):
        if k in kinds:
            return k
    return "float32"


def _apply_block(block: np.ndarray, delta: np.ndarray, tag: str) -> None:
    """block[...] = cast(float32(block) + delta); ``delta`` (fp32) may be clobbered.

    block: [rows, out] raw storage of tag ``tag`` (uint16 for bf16); delta: [rows, out] float32."""
    if tag == "F32":
        block += delta
    elif tag == "F64":
        block += delta.astype(np.float64)
    else:  # fp16 / bf16: fp32 arithmetic, one rounding
        delta += to_f32(block, tag)
        block[...] = from_f32(delta, tag)


def add_delta_inplace(
    arr: np.ndarray,
    tag: str,
    cfg: AdapterConfig,
    tensors: Mapping[str, np.ndarray],
    compute_delta: Callable[..., np.ndarray],
    executor=None,
    workers: int = 1,
) -> None:
    """``arr[...] = cast(float32(arr) + compute_delta(...))`` for one [in, out] base weight,
    in place in the freshly read buffer.

    For LoRA / rsLoRA / LoRA+ / PiSSA, row i of the delta only depends on row i of A
    (and A0), so the delta is computed in blocks of rows with ``compute_delta`` on the
    row slices (same formula, same fp32 arithmetic): each block stays in cache and
    no full-size delta is ever allocated.  VeRA's delta slices a shared projection by
    ``in_features`` and LoKr's is a Kronecker product (a row block of it is not a
    LoKr delta of fewer rows), so those are computed whole and then applied block by block.  With an
    ``executor`` the rows are split into ``workers`` contiguous ranges merged in
    parallel (disjoint rows; numpy releases the GIL), which matters for bf16/fp16
    where the casts are CPU-bound.
    """
    in_f, out_f = arr.shape  # arr: [in, out]
    kind = cfg.layer_type
    step = max(1, CHUNK_ELEMENTS // max(out_f, 1))  # rows per block
    whole: Optional[np.ndarray] = None
    if kind not in ("lora", "pissa"):
        whole = compute_delta(kind, cfg, tensors, in_f, out_f)  # [in, out] float32

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi, step):
            j = min(hi, i + step)
            if whole is not None:
                delta = whole[i:j]  # [j - i, out]
            else:
                # lora_A / pissa_A0: [in, r] -> rows [i:j]; lora_B / pissa_B0: [r, out] whole
                part = {k: (v[i:j] if k in ("lora_A", "pissa_A0") else v) for k, v in tensors.items()}
                delta = compute_delta(kind, cfg, part, j - i, out_f)  # [j - i, out]
            _apply_block(arr[i:j], delta, tag)

    n = workers if executor is not None else 1
    if n <= 1 or in_f < 2 * step:
        run(0, in_f)
        return
    bounds = [in_f * k // n for k in range(n + 1)]
    futures = [executor.submit(run, bounds[k], bounds[k + 1]) for k in range(n) if bounds[k] < bounds[k + 1]]
    for f in futures:
        f.result()


def single_threaded_blas() -> contextlib.AbstractContextManager:
    """Context (already entered) limiting numpy's BLAS to one thread: the rank-r matmuls of a
    merge are tiny, and OpenBLAS's thread hand-off costs more than it saves, especially
    while our own threads run blocks in parallel (measured 2x on the bf16 benchmark).
    A no-op without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional dependency: merging works without it, only slower
        ctx = contextlib.nullcontext()
    else:
        ctx = threadpool_limits(limits=1, user_api="blas")
    ctx.__enter__()
    return ctx
