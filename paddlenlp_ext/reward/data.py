"""Reward data: DPO's preference pairs and pair rows plus the index of every answer's last token.

The records are DPO's (every format :mod:`paddlenlp_ext.dpo.data` reads: PaddleNLP's
src/tgt/response/sort, and the chosen/rejected forms of ``dpo_en_demo.json``); they are
tokenized, truncated and packed by DPO's code (``prompt + chosen + rejected`` per pair, the
rejected answer sees the prompt but not the chosen one), so one row scores both answers
exactly as two separate sequences ``prompt + chosen`` and ``prompt + rejected`` would.

``score_index`` is the position of each answer's last token (its eos, when not truncated):
the reward model reads the hidden state there.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

import numpy as np

from ..dpo.data import PreferenceData, build_preference_datasets
from ..dpo.pair_rows import PreferenceCollator, PreferenceDataset

__all__ = ["last_token_positions", "RewardDataset", "RewardCollator", "build_reward_datasets"]


def last_token_positions(pairs: Sequence[Mapping]) -> np.ndarray:
    """Row-local positions ``[2N]`` of the last chosen and last rejected token of pairs laid out
    one after another (as :func:`~paddlenlp_ext.dpo.pair_rows.build_pair_row` lays them out).

    >>> last_token_positions([{"prompt": [11, 12, 13], "chosen": [21, 22], "rejected": [31, 32]},
    ...                       {"prompt": [41], "chosen": [51], "rejected": [61, 62]}]).tolist()
    [4, 6, 8, 10]
    """
    out: List[int] = []
    off = 0
    for p in pairs:
        P, C, R = len(p["prompt"]), len(p["chosen"]), len(p["rejected"])
        out += [off + P + C - 1, off + P + C + R - 1]
        off += P + C + R
    return np.asarray(out, dtype=np.int64)


class RewardDataset(PreferenceDataset):
    """:class:`~paddlenlp_ext.dpo.pair_rows.PreferenceDataset` rows plus ``score_index`` [2 * pairs of the row]."""

    def __getitem__(self, i: int) -> Dict:
        row = super().__getitem__(i)
        row["score_index"] = last_token_positions([self.pairs[j] for j in self.packs[i]])
        return row


class RewardCollator(PreferenceCollator):
    """:class:`~paddlenlp_ext.dpo.pair_rows.PreferenceCollator` plus ``score_index`` [2N]: row ``b``'s
    positions + ``b * S``, in pair order (chosen, rejected of pair 0, then pair 1, ...).

    >>> from paddlenlp_ext.dpo.pair_rows import build_pair_row
    >>> pairs = [{"prompt": [11, 12], "chosen": [21], "rejected": [31, 32]}, {"prompt": [41], "chosen": [51], "rejected": [61]}]
    >>> rows = []
    >>> for p in pairs:
    ...     r = build_pair_row([p]); r["score_index"] = last_token_positions([p]); rows.append(r)
    >>> RewardCollator(pad_token_id=0, flash_mask=True)(rows)["score_index"].tolist()
    [2, 4, 6, 7]
    """

    def __call__(self, rows):
        out = super().__call__(rows)
        S = out["input_ids"].shape[1]
        out["score_index"] = np.concatenate(
            [np.asarray(r["score_index"], dtype=np.int64) + b * S for b, r in enumerate(rows)]
        )
        return out


def build_reward_datasets(
    data_args: Any, tokenizer, *, do_train: bool, do_eval: bool, flash_mask: bool, seed: int = 0
) -> PreferenceData:
    """Datasets, collator and reports: :func:`~paddlenlp_ext.dpo.data.build_preference_datasets` with the
    reward rows and batches (``lazy`` is refused at config time)."""
    return build_preference_datasets(
        data_args,
        tokenizer,
        do_train=do_train,
        do_eval=do_eval,
        flash_mask=flash_mask,
        seed=seed,
        dataset_cls=RewardDataset,
        collator_cls=RewardCollator,
    )
