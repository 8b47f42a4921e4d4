"""Rewards: Python functions named in the config, a reward model, weighted together.

A reward function is ``f(prompts: list[str], completions: list[str], **columns) -> list[float]``
(TRL's and verl's convention): ``prompts[i]`` is the text of the last user turn that
``completions[i]`` answers, and every other field of the data records is passed as a keyword list
aligned with them (a prompt's G completions repeat its values).  Functions are named
``"package.module:function"`` in ``reward_funcs`` and imported at config time
(``config.grpo.resolve_reward_func``).  A reward model (``reward_model_name_or_path``) is scored
with ``paddlenlp_ext.reward.scorer.RewardScorer`` (imported only when configured).

The total reward is ``sum_k weight_k * reward_k`` (``reward_weights``, default 1 each).  A function
that returns the wrong number of values, or a value that is not a finite number, stops the run with
a ConfigError naming ``reward_funcs[k]`` (exit 2): never a silently dropped completion.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config.grpo import resolve_reward_func
from ..config.parse import ConfigError

__all__ = ["contains_keyword", "RewardSet"]


def contains_keyword(prompts: List[str], completions: List[str], keyword: Sequence[str], **_columns) -> List[float]:
    """1.0 when the completion contains the record's ``keyword`` (case-insensitive), else 0.0.

    >>> contains_keyword(["q", "q"], ["Great for the gym.", "A calm day."], keyword=["gym", "gym"])
    [1.0, 0.0]
    """
    return [1.0 if str(k).lower() in c.lower() else 0.0 for c, k in zip(completions, keyword)]


class RewardSet:
    """The configured rewards; ``__call__`` gives (total [n], {name: values [n]})."""

    def __init__(
        self, reward_funcs: Sequence[str], reward_model: Optional[str] = None, weights: Optional[Sequence[float]] = None
    ):
        self.funcs: List[Tuple[str, str, object]] = []  # (config key, display name, callable)
        for i, spec in enumerate(reward_funcs or []):
            func, name = resolve_reward_func(spec)
            self.funcs.append((f"reward_funcs[{i}] {spec!r}", name, func))
        self.scorer = None
        if reward_model:
            from ..reward.scorer import RewardScorer  # deferred: the scorer loads a model (paddle)

            self.scorer = RewardScorer.from_pretrained(reward_model)
            self.funcs.append((f"reward_model_name_or_path {reward_model!r}", "reward_model", None))
        n = len(self.funcs)
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * n
        if len(self.weights) != n:
            raise ConfigError([f"reward_weights has {len(self.weights)} value(s) for {n} reward(s)"])
        names = [name for _, name, _ in self.funcs]
        # two functions of one name are told apart in the logs by their position
        self.names = [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]

    def __call__(self, prompts: List[str], completions: List[str], columns: Dict[str, list]):
        n = len(completions)
        total = np.zeros([n], dtype=np.float64)  # [n]
        per: Dict[str, np.ndarray] = {}
        for (key, _, func), name, weight in zip(self.funcs, self.names, self.weights):
            if func is None:
                values = self.scorer.score_texts(prompts, completions)
            else:
                try:
                    values = func(prompts=list(prompts), completions=list(completions), **columns)
                except TypeError as e:  # the signature does not take these arguments: a config problem
                    raise ConfigError(
                        [
                            f"{key} cannot be called as f(prompts=, completions=, "
                            f"{''.join(c + '=, ' for c in sorted(columns))}...): {e}; the reward "
                            "columns are the data records' other fields"
                        ]
                    ) from e
            per[name] = _checked(values, n, key)
            total += weight * per[name]
        return total, per


def _checked(values, n: int, key: str) -> np.ndarray:
    """``values`` as float64 [n], or ConfigError naming ``key``."""
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise ConfigError(
            [f"{key} must return a list of {n} floats (one per completion); got {values!r:.200} ({e})"]
        ) from None
    if len(out) != n:
        raise ConfigError(
            [f"{key} returned {len(out)} reward(s) for {n} completions; return one float per completion, in order"]
        )
    bad = [i for i, v in enumerate(out) if not math.isfinite(v)]
    if bad:
        raise ConfigError([f"{key} returned a non-finite reward ({out[bad[0]]}) for completion {bad[0]}"])
    return np.asarray(out, dtype=np.float64)
