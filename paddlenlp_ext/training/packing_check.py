"""Check that packing does not change the loss or the gradients.

For a fixed model and examples, the token-mean loss over packed rows must
equal the token-mean loss over the same examples run one by one (fp32:
<= 1e-5), and so must every parameter gradient.  Differences point at a
mask, position-id or label-boundary bug in the packed path.
"""

from typing import Dict, List, Sequence

import numpy as np
import paddle
import paddle.nn.functional as F

from ..data.collate import PackedCollator
from ..data.packing import PackedDataset
from ..data.tokenize import IGNORE_INDEX
from .trainer import REAL_TOKENS_KEY


def _summed_loss(model, batch: Dict[str, np.ndarray]):
    """(sum of token cross-entropies over supervised labels, count)."""
    inputs = {k: paddle.to_tensor(v) for k, v in batch.items() if k not in ("labels", REAL_TOKENS_KEY)}
    out = model(**inputs, return_dict=True)
    logits = out.logits.astype("float32")  # [batch, seq, vocab]
    labels = paddle.to_tensor(batch["labels"])  # [batch, seq]
    ce = F.cross_entropy(logits, labels.unsqueeze(-1), ignore_index=IGNORE_INDEX, reduction="none").squeeze(-1)
    mask = (labels != IGNORE_INDEX).astype("float32")
    return (ce * mask).sum(), float(mask.sum())


def _grads(model) -> Dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def check_packing(
    model, features: Sequence[Dict], max_length: int, pad_token_id: int, flash_mask: bool, greedy: bool = True
) -> Dict:
    """Compare unpacked (one example per forward) and packed token-mean loss and gradients.

    Returns loss_unpacked, loss_packed, loss_abs_diff, grad_max_abs_diff,
    grad_max_rel_diff (relative to the largest gradient entry), examples, packs.
    """
    model.eval()  # no dropout: both paths must see the same function
    model.clear_gradients()
    total, count = None, 0.0
    for f in features:  # reference: each example alone, no padding, no mask
        batch = {
            "input_ids": np.asarray([f["input_ids"]], dtype="int64"),
            "labels": np.asarray([f["labels"]], dtype="int64"),
        }
        s, n = _summed_loss(model, batch)
        total = s if total is None else total + s
        count += n
    loss_ref = total / count
    loss_ref.backward()
    ref_grads = _grads(model)
    model.clear_gradients()

    ds = PackedDataset(list(features), max_length, pad_token_id, greedy=greedy, shuffle=False)
    rows: List = [ds[i] for i in range(len(ds))]
    batch = PackedCollator(flash_mask)(rows)
    s, n = _summed_loss(model, batch)
    loss_packed = s / n
    loss_packed.backward()
    packed_grads = _grads(model)
    model.clear_gradients()

    max_abs, scale = 0.0, 0.0
    for name, g in ref_grads.items():
        max_abs = max(max_abs, float(np.abs(g - packed_grads[name]).max()))
        scale = max(scale, float(np.abs(g).max()))
    return {
        "examples": len(features),
        "packs": len(rows),
        "supervised_tokens": int(count),
        "loss_unpacked": float(loss_ref),
        "loss_packed": float(loss_packed),
        "loss_abs_diff": abs(float(loss_ref) - float(loss_packed)),
        "grad_max_abs_diff": max_abs,
        "grad_max_rel_diff": max_abs / max(scale, 1e-30),
    }
