"""NEFTune: noisy embedding fine-tuning (Jain et al., 2023, arXiv:2310.05914).

During training only, the input embeddings get
``Uniform(-1, 1) * alpha / sqrt(L * d)`` added, where ``d`` is the hidden size
and ``L`` the length of the example the token belongs to (for packed rows each
example's own length, not the row length).  Padding positions get no noise.
No noise in eval (``model.training`` False) or under ``paddle.no_grad()``
(generation).

Usage (the caller owns the batch)::

    hook = attach_neftune(model, alpha=5.0)
    ...
    hook.set_token_lengths(token_lengths_from_batch(**batch_inputs))  # every step
    loss = model(**batch_inputs)
    ...
    hook.remove()

Lengths are consumed by the next training forward: a training forward without
freshly set lengths raises instead of guessing ``L``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import paddle
import paddle.nn as nn

__all__ = ["NEFTuneHook", "attach_neftune", "token_lengths_from_batch"]


def _np(x: Any) -> Optional[np.ndarray]:
    if x is None:
        return None
    if isinstance(x, paddle.Tensor):
        if x.dtype == paddle.bool:
            return x.numpy()
        if x.dtype in (paddle.bfloat16, paddle.float16):
            x = x.astype(paddle.float32)
        return x.numpy()
    return np.asarray(x)


def _as_2d(name: str, a: np.ndarray) -> np.ndarray:
    if a.ndim == 1:
        return a[None, :]
    if a.ndim != 2:
        raise ValueError(f"token_lengths_from_batch: {name} must be [batch, seq] or [seq], got shape {list(a.shape)}")
    return a


def _run_lengths(seg_start: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per-token count of valid tokens in its segment; 0 on invalid tokens.
    ``seg_start`` [B, S] bool marks the first token of every segment."""
    bsz, seq = valid.shape
    out = np.zeros((bsz, seq), dtype=np.float32)
    for i in range(bsz):
        seg_id = np.cumsum(seg_start[i].astype(np.int64))  # 1-based segment ids
        counts = np.bincount(seg_id, weights=valid[i].astype(np.float64), minlength=int(seg_id.max()) + 1)
        out[i] = np.where(valid[i], counts[seg_id], 0.0)
    return out


def token_lengths_from_batch(
    position_ids=None,
    attention_mask=None,
    startend_row_indices=None,
    labels=None,
    input_ids=None,
    pad_token_id=None,
) -> paddle.Tensor:
    """Per-token example length ``L`` as a float32 ``[batch, seq]`` tensor, 0 on
    padding.

    Real (non-padding) tokens, first source available:
      * ``attention_mask`` 2-D ``[B, S]``: nonzero entries; 3-D ``[B, S, S]`` /
        4-D ``[B, 1, S, S]``: nonzero diagonal (PaddleNLP zero-padding pads rows
        and columns with 0);
      * ``startend_row_indices`` (FlashMask, ``[B, S]``, ``[B, 1, S]`` or
        ``[B, 1, S, k]``; column 0 = row where masking starts, i.e. the end of
        the token's example): real tokens have ``value > position`` (padding is
        filled with 0 by PaddleNLP);
      * ``input_ids != pad_token_id`` (beware of tokenizers whose pad token is
        also their EOS: real EOS tokens would be treated as padding);
      * otherwise every position.
    Example boundaries, first source available:
      * ``startend_row_indices``: runs of equal end index;
      * 3-D/4-D ``attention_mask``: block structure (|row ∪ column| of the mask);
      * ``position_ids``: a new example starts where the position restarts
        (``pos[t] != pos[t-1] + 1``, e.g. back to 0);
      * otherwise one example per row (L = number of real tokens in the row).
    ``labels`` are only used for the shape when nothing else is given: ignored
    labels (-100) also mark prompt tokens, which are real tokens.
    """
    pos = _np(position_ids)
    mask = _np(attention_mask)
    se = _np(startend_row_indices)
    ids = _np(input_ids)
    lab = _np(labels)

    shape = None
    for name, a in (("position_ids", pos), ("input_ids", ids), ("labels", lab)):
        if a is not None:
            shape = _as_2d(name, a).shape
            break
    if se is not None:
        if se.ndim == 4:
            se = se[:, 0, :, 0]
        elif se.ndim == 3:
            se = se[:, 0, :]
        se = _as_2d("startend_row_indices", se)
        shape = shape or se.shape
    mask2 = None
    if mask is not None:
        if mask.ndim == 4:
            if mask.shape[1] != 1:
                mask = mask[:, :1]
            mask = mask[:, 0]
        if mask.ndim == 3:
            mask2 = mask != 0  # [B, S, S]
            shape = shape or mask2.shape[:2]
        else:
            mask = _as_2d("attention_mask", mask)
            shape = shape or mask.shape
    if shape is None:
        raise ValueError(
            "token_lengths_from_batch: need at least one of position_ids, attention_mask, "
            "startend_row_indices, input_ids or labels"
        )
    bsz, seq = int(shape[0]), int(shape[1])

    def fit(name, a):
        if a.shape[0] == 1 and bsz > 1:
            a = np.broadcast_to(a, (bsz,) + a.shape[1:])
        if tuple(a.shape[:2]) != (bsz, seq):
            raise ValueError(
                f"token_lengths_from_batch: {name} has shape {list(a.shape)}, expected [{bsz}, {seq}, ...]"
            )
        return a

    # ---- which positions are real tokens
    if mask2 is not None:
        mask2 = fit("attention_mask", mask2)
        valid = np.diagonal(mask2, axis1=1, axis2=2).copy()
    elif mask is not None:
        valid = fit("attention_mask", mask) != 0
    elif se is not None:
        se = fit("startend_row_indices", se)
        valid = se > np.arange(seq)[None, :]
    elif ids is not None and pad_token_id is not None:
        valid = fit("input_ids", _as_2d("input_ids", ids)) != pad_token_id
    else:
        valid = np.ones((bsz, seq), dtype=bool)

    # ---- example boundaries
    if se is not None:
        se = fit("startend_row_indices", se)
        start = np.ones((bsz, seq), dtype=bool)
        start[:, 1:] = se[:, 1:] != se[:, :-1]
        return paddle.to_tensor(_run_lengths(start, valid))
    if mask2 is not None:
        sym = mask2 | np.transpose(mask2, (0, 2, 1))
        lengths = sym.sum(axis=-1).astype(np.float32)
        return paddle.to_tensor(np.where(valid, lengths, 0.0).astype(np.float32))
    if pos is not None:
        pos = fit("position_ids", _as_2d("position_ids", pos)).astype(np.int64)
        start = np.ones((bsz, seq), dtype=bool)
        start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        return paddle.to_tensor(_run_lengths(start, valid))
    lengths = valid.sum(axis=1, keepdims=True).astype(np.float32)
    return paddle.to_tensor(np.where(valid, lengths, 0.0).astype(np.float32))


class NEFTuneHook:
    """Forward post-hook on the input-embedding layer adding NEFTune noise."""

    def __init__(self, model: nn.Layer, embedding: nn.Layer, alpha: float):
        if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0):
            raise ValueError(f"neftune alpha must be a number > 0, got {alpha!r}")
        self.alpha = float(alpha)
        self.model = model
        self.embedding = embedding
        self._lengths: Optional[paddle.Tensor] = None
        self._handle = embedding.register_forward_post_hook(self._hook)

    def set_token_lengths(self, lengths) -> None:
        """Per-token example length ``[batch, seq]`` (0 on padding) for the next
        training forward (see ``token_lengths_from_batch``)."""
        t = lengths if isinstance(lengths, paddle.Tensor) else paddle.to_tensor(np.asarray(lengths, dtype=np.float32))
        if t.ndim != 2:
            raise ValueError(f"NEFTune token lengths must be [batch, seq], got shape {list(t.shape)}")
        self._lengths = t.astype(paddle.float32)

    def clear(self) -> None:
        self._lengths = None

    @property
    def active(self) -> bool:
        return bool(self.model.training) and paddle.is_grad_enabled()

    def _hook(self, layer, inputs, output):
        if not self.active:
            return None
        lengths = self._lengths
        if lengths is None:
            raise RuntimeError(
                "NEFTune is attached and the model is training, but no token lengths were set for this forward: "
                "call hook.set_token_lengths(token_lengths_from_batch(...)) before every training forward"
            )
        self._lengths = None  # one forward per set: stale lengths are never reused
        if list(lengths.shape) != list(output.shape[:2]):
            raise ValueError(
                f"NEFTune token lengths have shape {list(lengths.shape)} but the embeddings are "
                f"{list(output.shape)} (expected [batch, seq] = {list(output.shape[:2])})"
            )
        hidden = int(output.shape[-1])
        real = (lengths > 0).astype(paddle.float32)
        scale = self.alpha * real / paddle.sqrt(paddle.clip(lengths, min=1.0) * float(hidden))
        noise = paddle.uniform(output.shape, dtype=paddle.float32, min=-1.0, max=1.0)
        noise = noise * scale.unsqueeze(-1)
        return output + noise.astype(output.dtype)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if getattr(self.model, "_neftune_hook", None) is self:
            self.model._neftune_hook = None


def _find_input_embeddings(model: nn.Layer) -> nn.Layer:
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
        except (NotImplementedError, AttributeError):
            emb = None
        if emb is not None:
            return emb
    for _, layer in model.named_sublayers():
        if isinstance(layer, nn.Embedding):
            return layer
    raise ValueError(f"could not find the input embedding layer of {type(model).__name__}")


def attach_neftune(model: nn.Layer, alpha: float, embedding: Optional[nn.Layer] = None) -> NEFTuneHook:
    """Attach NEFTune noise to ``model``'s input embeddings; returns the hook
    (``hook.set_token_lengths(...)`` per step, ``hook.remove()`` to detach)."""
    if getattr(model, "_neftune_hook", None) is not None:
        raise RuntimeError("NEFTune is already attached to this model; remove() the existing hook first")
    hook = NEFTuneHook(model, embedding if embedding is not None else _find_input_embeddings(model), alpha)
    model._neftune_hook = hook
    return hook
