"""A cheaper dense-mask attention for PaddleNLP's Llama on CPU, bit-identical to its own.

Without ``use_flash_attention`` (and for packed rows without ``flash_mask``) PaddleNLP 3.0.0b4's
``llama.modeling.scaled_dot_product_attention`` runs, per layer, on ``[b, heads, q, kv]`` scores::

    w = matmul(q / sqrt(d), k^T) + mask          # mask [b, 1, q, kv]: broadcast over heads
    w = softmax(w.astype("float32") * 1)         # pre_divided_factor = 1 outside fp16
    out = matmul(w, v)

On Paddle's CPU kernels the broadcast add is ~2x slower than adding the mask expanded to the
scores' shape, and ``* 1`` is one more full pass over the scores forward and one backward: at
1024 tokens x 16 heads these cost as much as the two matmuls.  :func:`scaled_dot_product_attention`
adds the expanded mask and drops the ``* 1`` (``x * 1 == x`` and its gradient ``g * 1 == g``
exactly); everything else is the same op on the same operands, so outputs and gradients are
bitwise equal (``tests/test_dense_attention.py``).  It takes over only fp32 dygraph calls outside
autocast, with a mask and without alibi, segment resharding, context or sequence parallel;
every other call goes to PaddleNLP's function unchanged.

``LlamaAttention.__init__`` stores the module global in ``self.attn_func``, so
:func:`fast_dense_attention` must be entered before the model is built (``training/run.py``'s
``library_patches`` is).
"""

from __future__ import annotations

import contextlib
import math

import paddle
import paddle.nn.functional as F

from ..kernels.causal import causal_attention
from .versions import check_versions

check_versions()

__all__ = ["scaled_dot_product_attention", "fast_dense_attention", "is_installed"]

_SIGNATURE = (
    "query_states",
    "config",
    "key_states",
    "value_states",
    "attention_mask",
    "output_attentions",
    "alibi",
    "attn_mask_startend_row_indices",
    "sequence_parallel",
    "reshard_layer",
    "npu_is_casual",
    "skip_recompute",
)

#: (module, attribute[, signature]) this module patches or reads (tests/test_integrations.py).
RELIED_ON = [
    ("paddlenlp.transformers.llama.modeling", "scaled_dot_product_attention", _SIGNATURE),
    ("paddlenlp.transformers.llama.modeling", "flash_attention"),
]

_MODULE = "paddlenlp.transformers.llama.modeling"
#: unpadded causal rows at least this long take kernels/causal.py: there the [b, heads, s, s] probabilities
#: kept per layer are what sets the peak memory (31 MB per layer at 700 tokens x 16 heads), and its speed is
#: the dense path's; on shorter rows its recomputation costs ~1.5x the dense attention (docs/benchmarks.md)
CAUSAL_KERNEL_FROM = 512
#: PaddleNLP's function, kept for good: models built in the block keep calling ours after it ends
_STATE: dict = {}


def _modeling():
    import importlib

    return importlib.import_module(_MODULE)


def _handled(
    query_states,
    config,
    attention_mask,
    output_attentions,
    alibi,
    attn_mask_startend_row_indices,
    sequence_parallel,
    reshard_layer,
) -> bool:
    """The call takes PaddleNLP's plain dense branch with factor 1 and a given mask."""
    return (
        paddle.in_dynamic_mode()
        and query_states.dtype == paddle.float32
        and not paddle.amp.is_autocast_enabled()
        and not (config.use_flash_attention and _modeling().flash_attention)
        and int(getattr(config, "context_parallel_degree", 1) or 1) <= 1
        and attention_mask is not None
        and alibi is None
        and attn_mask_startend_row_indices is None
        and not sequence_parallel
        and reshard_layer is None
        and not output_attentions
    )


def scaled_dot_product_attention(
    query_states,
    config,
    key_states,
    value_states,
    attention_mask,
    output_attentions,
    alibi=None,
    attn_mask_startend_row_indices=None,
    sequence_parallel=False,
    reshard_layer=None,
    npu_is_casual=False,
    skip_recompute=False,
):
    """PaddleNLP's function, bit for bit; q/k/v [b, seq, heads, d], mask [b, 1, q, kv] -> [b, q, heads * d]."""
    if not _handled(
        query_states,
        config,
        attention_mask,
        output_attentions,
        alibi,
        attn_mask_startend_row_indices,
        sequence_parallel,
        reshard_layer,
    ):
        return _original()(
            query_states,
            config,
            key_states,
            value_states,
            attention_mask,
            output_attentions,
            alibi,
            attn_mask_startend_row_indices,
            sequence_parallel,
            reshard_layer,
            npu_is_casual,
            skip_recompute=skip_recompute,
        )
    bsz, q_len, num_heads, head_dim = query_states.shape
    kv_seq_len = value_states.shape[1]
    q = paddle.transpose(query_states, [0, 2, 1, 3])  # [b, heads, q, d]
    k = paddle.transpose(key_states, [0, 2, 1, 3])  # [b, heads, kv, d]
    v = paddle.transpose(value_states, [0, 2, 1, 3])  # [b, heads, kv, d]
    if q_len == kv_seq_len and q_len >= CAUSAL_KERNEL_FROM and is_plain_causal(attention_mask):
        # no padding, no packing: O(seq) memory for the backward instead of the [b, heads, q, kv] probabilities
        out = causal_attention(q, k, v, 1 / math.sqrt(head_dim)).transpose([0, 2, 1, 3])  # [b, q, heads, d]
        return out.reshape([bsz, q_len, head_dim * num_heads])
    scores = paddle.matmul(q * (1 / math.sqrt(head_dim)), k.transpose([0, 1, 3, 2]))  # [b, heads, q, kv]
    mask = attention_mask.reshape([bsz, 1, q_len, kv_seq_len]).expand([bsz, num_heads, q_len, kv_seq_len])
    weights = F.softmax(scores + mask, axis=-1)  # [b, heads, q, kv]
    out = paddle.matmul(weights, v).transpose([0, 2, 1, 3])  # [b, q, heads, d]
    return out.reshape([bsz, q_len, head_dim * num_heads])


def is_plain_causal(attention_mask) -> bool:
    """True if the additive mask [b, 1, s, s] is PaddleNLP's mask of unpadded causal rows (0 on and below the
    diagonal, the dtype's minimum above).  Every layer of a forward gets the same mask object: checked once."""
    last = _STATE.get("causal_check")
    if last is not None and last[0] is attention_mask:
        return last[1]
    shape = attention_mask.shape
    answer = False
    if len(shape) == 4 and shape[1] == 1 and shape[2] == shape[3] and attention_mask.dtype == paddle.float32:
        s = shape[-1]
        minimum = paddle.finfo(paddle.float32).min
        reference = paddle.triu(paddle.full([s, s], minimum, dtype=paddle.float32), diagonal=1)  # [s, s]
        answer = bool(paddle.equal_all(attention_mask, reference.expand(shape)))
    _STATE["causal_check"] = (attention_mask, answer)  # keeps the last mask alive until the next forward's
    return answer


def _original():
    return _STATE.setdefault("original", _modeling().scaled_dot_product_attention)


def is_installed() -> bool:
    return _modeling().scaled_dot_product_attention is scaled_dot_product_attention


@contextlib.contextmanager
def fast_dense_attention():
    """``with fast_dense_attention(): ...``: Llama models built in the block use
    :func:`scaled_dot_product_attention`.  Nests; restores what it installed on exit."""
    mod = _modeling()
    if mod.scaled_dot_product_attention is scaled_dot_product_attention:
        yield
        return
    original = _original()
    mod.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        mod.scaled_dot_product_attention = original
