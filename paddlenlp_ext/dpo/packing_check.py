"""Check that packing preference pairs leaves every pair's log-probs unchanged.

The reference runs each answer the plain way: ``prompt + chosen`` and
``prompt + rejected`` as two separate sequences, one per forward, no mask, no
position tricks, log-probs from a plain softmax cross-entropy.  The packed path runs
the same pairs the way training does: one sequence ``prompt + chosen +
rejected`` per pair, several pairs per row (``PreferenceDataset``), the
contract's masks and positions (``PreferenceCollator``), ``pair_logps``.  Per
pair, chosen and rejected log-probs must agree (fp32: <= 1e-5 relative to
max(1, |log-prob|)).  A difference
points at a mask, position-id or scoring-index bug.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import numpy as np
import paddle
import paddle.nn.functional as F

from .logps import pair_logps, scored_logits
from .pair_rows import PreferenceCollator, PreferenceDataset


def _answer_logp(model, prompt: Sequence[int], answer: Sequence[int]) -> float:
    """sum_k log p(answer[k] | prompt, answer[:k]) from one plain forward of prompt + answer."""
    ids = paddle.to_tensor([list(prompt) + list(answer)], dtype="int64")  # [1, P + A]
    logits = model(input_ids=ids, return_dict=True).logits.astype("float32")  # [1, P + A, V]
    p = len(prompt)
    rows = logits[0, p - 1 : p - 1 + len(answer)]  # [A, V]: answer[k] is predicted at p - 1 + k
    # -cross_entropy = log_softmax gathered at the token (Paddle's CPU log_softmax kernel is very slow)
    ce = F.cross_entropy(rows, paddle.to_tensor(list(answer), dtype="int64").unsqueeze(-1), reduction="none")
    return -float(ce.sum())


def check_pair_packing(
    model, pairs: Sequence[Mapping], max_length: int, pad_token_id: int, flash_mask: bool, greedy: bool = True
) -> Dict:
    """Per-pair chosen/rejected log-probs: each answer alone vs packed rows.

    Returns pairs, rows, max_abs_diff and max_rel_diff (over all 2N log-probs; relative to
    max(1, |log-prob|)), the worst pair's origin and both values.
    """
    model.eval()  # no dropout: both paths must compute the same function
    pairs = list(pairs)
    with paddle.no_grad():
        ref = np.array(
            [
                [_answer_logp(model, p["prompt"], p["chosen"]), _answer_logp(model, p["prompt"], p["rejected"])]
                for p in pairs
            ]
        )  # [N, 2]
        ds = PreferenceDataset(
            pairs, max_length, packing="greedy" if greedy else "in_order", pad_token_id=pad_token_id, shuffle=False
        )
        rows: List = [ds[i] for i in range(len(ds))]
        batch = PreferenceCollator(pad_token_id, flash_mask, max_length)(rows)
        inputs = {k: paddle.to_tensor(batch[k]) for k in ("input_ids", "position_ids")}
        mask_key = "attn_mask_startend_row_indices" if flash_mask else "attention_mask"
        inputs[mask_key] = paddle.to_tensor(batch[mask_key])
        # as training scores them: lm_head at the scored rows only where the family allows it
        logits, index = scored_logits(model, inputs, paddle.to_tensor(batch["logp_index"]))  # [1, T, V] or [rows, S, V]
        chosen, rejected, _, _ = pair_logps(
            logits,
            index,
            paddle.to_tensor(batch["logp_token"]),
            paddle.to_tensor(batch["logp_segment"]),
            int(batch["num_pairs"]),
        )
    # which pair each packed log-prob belongs to: the packer reorders pairs, the segments follow the packs
    order = [i for pack in ds.packs for i in pack]
    packed = np.zeros_like(ref)
    packed[order, 0] = chosen.numpy()
    packed[order, 1] = rejected.numpy()
    diff = np.abs(packed - ref)  # [N, 2]
    # a summed log-prob of a few hundred tokens is a few hundred nats: fp32 sums in another order differ in
    # the 1e-4 place, so the verdict uses the difference relative to max(1, |log-prob|)
    rel = diff / np.maximum(1.0, np.abs(ref))
    worst = int(rel.max(axis=1).argmax())
    return {
        "pairs": len(pairs),
        "rows": len(rows),
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": float(rel.max()),
        "worst_pair": pairs[worst].get("origin", str(worst)),
        "worst_unpacked": ref[worst].tolist(),
        "worst_packed": packed[worst].tolist(),
    }
