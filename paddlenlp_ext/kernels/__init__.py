"""Attention kernels written with ordinary Paddle ops (no PaddleNLP, no private Paddle API).

This package owns the CPU block-sparse ``flashmask_attention``, a drop-in for
``paddle.nn.functional.flashmask_attention`` (same signature and semantics),
which Paddle ships only as a CUDA/XPU kernel.  How PaddleNLP models are routed
to it lives in ``paddlenlp_ext.integrations.flashmask``, not here.

* :mod:`.flashmask`   -- the public functions and Paddle's argument checks.
* :mod:`.bounds`      -- ``startend_row_indices`` / ``window_size`` -> two masked
  row intervals per key column; the equivalent dense mask.
* :mod:`.schedule`    -- the tile schedule: skipped / unmasked / partial tiles,
  per-tile masks, call statistics.
* :mod:`.blocksparse` -- FlashAttention-2 forward/backward over the schedule
  (a ``PyLayer``).
* :mod:`.varlen`     -- packed documents (causal, one start row per column):
  plain causal attention per document.
* :mod:`.reference`   -- dense O(seq^2) reference for tests and benchmarks;
  deliberately not re-exported here.
"""

from .bounds import dense_mask_from_startend
from .flashmask import flashmask_attention, tiled_flashmask_attention
from .schedule import BLOCK_SIZE, KV_MERGE, flashmask_stats

__all__ = [
    "BLOCK_SIZE",
    "KV_MERGE",
    "flashmask_attention",
    "tiled_flashmask_attention",
    "dense_mask_from_startend",
    "flashmask_stats",
]
