"""Faster rotary embeddings for PaddleNLP's Llama and Qwen2 on CPU, bit-identical to theirs.

PaddleNLP 3.0.0b4's ``apply_rotary_pos_emb`` (llama/modeling.py, qwen2/modeling.py) computes
``q * cos + rotate_half(q) * sin`` with ``rotate_half(x) = concat([-x2, x1])``: two slices, a
negation and a concat per tensor, whose backward (two slice-grads that each zero-fill a
full-size tensor, a concat-grad, a negation) costs more than the forward on Paddle's CPU
kernels.  :func:`apply_rotary_pos_emb` moves the sign onto ``sin`` instead (a ``[b, s, 1, d]``
tensor, ``heads`` times smaller than q) and rotates with one ``paddle.roll``:

    rotate_half(x) * sin = concat([-x2, x1]) * concat([s1, s2])
                         = concat([x2, x1]) * concat([-s1, s2])      ((-a) * b == a * (-b) in IEEE)
                         = roll(x, d/2, axis=-1) * sin_signed

so every element is the same product and sum as before: outputs and gradients are bitwise
equal (``tests/test_rotary.py``).  Two more things make it cheap on Paddle's CPU kernels
(:class:`_Rotate`): cos/sin are expanded to q's shape before multiplying (a multiply whose operand
broadcasts over the heads, and its gradient, is ~60x slower than on one shape), and the backward
is written by hand, keeping only cos/sin instead of q, roll(q) and the expanded tables (less
activation memory per layer).  docs/benchmarks.md, "Training step speed", has the numbers.

:func:`fast_rotary` swaps the function both modeling modules look up at call time (their
module global, read by ``LlamaAttention.forward`` / ``Qwen2Attention.forward`` when
``use_fused_rope`` is off) for the block and restores it on exit.  Models that imported the
function by name (our Qwen3) keep theirs.
"""

from __future__ import annotations

import contextlib

import paddle
from paddle.autograd import PyLayer

from .versions import check_versions

check_versions()

__all__ = ["apply_rotary_pos_emb", "fast_rotary", "is_installed"]

#: (module, attribute[, signature]) this module patches (tests/test_integrations.py).
RELIED_ON = [
    ("paddlenlp.transformers.llama.modeling", "apply_rotary_pos_emb", ("q", "k", "cos", "sin", "position_ids")),
    ("paddlenlp.transformers.llama.modeling", "rotate_half", ("x",)),
    ("paddlenlp.transformers.qwen2.modeling", "apply_rotary_pos_emb", ("q", "k", "cos", "sin", "position_ids")),
    ("paddlenlp.transformers.qwen2.modeling", "rotate_half", ("x",)),
]

_MODULES = ("paddlenlp.transformers.llama.modeling", "paddlenlp.transformers.qwen2.modeling")


def _select(cos, sin, seq_len: int, position_ids):
    """PaddleNLP's selection of the cached cos/sin: [bs or 1, seq, 1, d] each."""
    if position_ids is None:  # pipeline pretraining: positions 0..seq-1
        return cos[:, :seq_len, :, :], sin[:, :seq_len, :, :]
    cos = cos.squeeze(axis=[0, 2])  # [max_pos, d]
    sin = sin.squeeze(axis=[0, 2])  # [max_pos, d]
    return cos[position_ids].unsqueeze(2), sin[position_ids].unsqueeze(2)  # [bs, seq, 1, d]


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    """``(q_embed, k_embed)`` as PaddleNLP's function, bit for bit.  q: [bs, seq, heads, d],
    k: [bs, seq, kv_heads, d]; cos/sin: the model's cache [1, max_pos, 1, d]."""
    cos, sin = _select(cos, sin, q.shape[1], position_ids)  # [bs, seq, 1, d]
    half = q.shape[-1] // 2
    sin_signed = paddle.concat([-sin[..., :half], sin[..., half:]], axis=-1)  # [bs, seq, 1, d]
    return _rotate(q, cos, sin_signed, half), _rotate(k, cos, sin_signed, half)


class _Rotate(PyLayer):
    """``x * cos + roll(x, d/2) * sin_signed``, with cos/sin expanded to x's shape inside (forward and back).

    x: [bs, seq, heads, d]; cos, sin_signed: [bs or 1, seq, 1, d], constants.  Paddle's CPU multiply (and
    its gradient) is ~60x slower when one operand broadcasts over the heads than on two tensors of one
    shape; expanding copies the same values, so every product is PaddleNLP's.  Only the small cos/sin are
    kept for the backward (autograd would keep x, roll(x) and both expanded tables per call)::

        dL/dx = g * cos + roll(g * sin_signed, -d/2)
    """

    @staticmethod
    def forward(ctx, x, cos, sin_signed):
        half = x.shape[-1] // 2
        ctx.save_for_backward(cos, sin_signed)
        shape = list(x.shape)
        return (x * cos.expand(shape)) + (paddle.roll(x, shifts=half, axis=-1) * sin_signed.expand(shape))

    @staticmethod
    def backward(ctx, g):
        cos, sin_signed = ctx.saved_tensor()
        shape = list(g.shape)
        return g * cos.expand(shape) + paddle.roll(g * sin_signed.expand(shape), shifts=-(shape[-1] // 2), axis=-1)


def _rotate(x, cos, sin_signed, half: int):
    """One rotated tensor; the autograd form when cos/sin would need a gradient (never in PaddleNLP's models)."""
    if cos.stop_gradient and sin_signed.stop_gradient:
        return _Rotate.apply(x, cos, sin_signed)
    return (x * cos) + (paddle.roll(x, shifts=half, axis=-1) * sin_signed)


def _modules():
    import importlib

    return [importlib.import_module(name) for name in _MODULES]


def is_installed() -> bool:
    return all(m.apply_rotary_pos_emb is apply_rotary_pos_emb for m in _modules())


@contextlib.contextmanager
def fast_rotary():
    """``with fast_rotary(): ...``: Llama/Qwen2 use :func:`apply_rotary_pos_emb` in the block.
    Nests: only what this block installed is restored on exit."""
    mine = []
    for mod in _modules():
        if mod.apply_rotary_pos_emb is not apply_rotary_pos_emb:
            mine.append((mod, mod.apply_rotary_pos_emb))
            mod.apply_rotary_pos_emb = apply_rotary_pos_emb
    try:
        yield
    finally:
        for mod, original in mine:
            mod.apply_rotary_pos_emb = original
