"""Mixtures of several datasets: which source each example of the mixed train set comes from.

``dataset_name_or_path`` may name several sources separated by commas (directories or files);
``dataset_weights`` gives their proportions and ``mix_strategy`` how they are combined:

* ``concat``: every example of source 1, then of source 2, ... (weights not used);
* ``interleave_under``: examples are drawn by the weights until the first source runs out
  (undersampling the others);
* ``interleave_over``: drawn by the weights until every source has been used whole; a source that
  runs out starts again from its first example (oversampling).

Draws are not random coin flips but a deficit rule: the next example comes from the source furthest
below its share (``weight * (n + 1) - taken``), ties broken in a seeded random order, so every prefix of
the mixture is within one example of the weights (0.7 / 0.3 over 1,000 examples is 700 / 300) and the
order is a pure function of (sizes, weights, strategy, seed): a resumed run skips the same batches of
the same sequence.  Each source's own examples keep their order (the trainer's sampler shuffles rows).
"""

from typing import List, Optional, Sequence, Tuple

import numpy as np

STRATEGIES = ("concat", "interleave_under", "interleave_over")


def split_sources(path: str) -> List[str]:
    """``"a/, b.json"`` -> ``["a/", "b.json"]`` (one source -> a list of one)."""
    return [p.strip() for p in path.split(",") if p.strip()]


def normalized(weights: Optional[Sequence[float]], n: int) -> List[float]:
    """Weights -> proportions summing to 1 (None: equal).  ``[7, 3]`` -> ``[0.7, 0.3]``."""
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    total = sum(w)
    return [x / total for x in w]


def mixture_order(
    sizes: Sequence[int], weights: Optional[Sequence[float]], strategy: str, seed: int
) -> List[Tuple[int, int]]:
    """``(source, index in source)`` for every example of the mixture.

    >>> mixture_order([2, 3], None, "concat", 0)
    [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    >>> [s for s, _ in mixture_order([7, 3], [0.7, 0.3], "interleave_under", 0)]
    [0, 1, 0, 0, 1, 0, 0, 0, 1, 0]
    >>> mixture_order([1, 3], [0.5, 0.5], "interleave_over", 0)
    [(1, 0), (0, 0), (1, 1), (0, 0), (1, 2)]
    """
    if strategy == "concat":
        return [(s, i) for s, n in enumerate(sizes) for i in range(n)]
    if strategy not in STRATEGIES:
        raise ValueError(f"mix_strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    w = np.asarray(normalized(weights, len(sizes)))
    tie_order = np.random.RandomState(seed).permutation(len(sizes))  # the seed only orders ties
    taken = np.zeros(len(sizes), dtype=np.int64)
    out: List[Tuple[int, int]] = []
    active = w > 0
    while True:
        deficit = np.where(active, w * (len(out) + 1) - taken, -np.inf)
        best = max(tie_order, key=lambda s: deficit[s])  # the first of equals in the seeded order
        if strategy == "interleave_under" and taken[best] >= sizes[best]:
            return out
        out.append((int(best), int(taken[best] % sizes[best])))
        taken[best] += 1
        if strategy == "interleave_over" and all(taken[s] >= sizes[s] for s in range(len(sizes)) if active[s]):
            return out
