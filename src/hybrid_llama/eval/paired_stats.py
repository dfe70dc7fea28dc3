"""Tests for two models scored on the same examples: McNemar's exact test and the paired bootstrap.

Both read only the per-example differences, so they are as tight as the pairing makes them: where
the two models agree on most examples, the interval of the difference is far narrower than either
accuracy's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["mcnemar_exact", "bootstrap_mean_ci"]


def mcnemar_exact(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: under "no difference" each of the ``gained + lost`` discordant
    examples (right for exactly one model) is a fair coin, so the p-value is the binomial tail of the
    rarer side, doubled (at most 1)."""
    n, k = gained + lost, min(gained, lost)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def bootstrap_mean_ci(groups: Sequence[Sequence[float]], *, level: float = 0.95, resamples: int = 2000,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``mean over groups of (mean of the group's differences)``, resampling the
    examples of each group with replacement, each group on its own (a stratified paired bootstrap: a
    suite average of tasks of different sizes weighs each task equally, as the papers' average
    does). One group gives the interval of a single task's mean difference. Seeded: the same
    differences give the same interval."""
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    for g in groups:
        d = np.asarray(g, dtype=np.float64)
        if d.size == 0:
            raise ValueError("a group without examples")
        total += d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    total /= len(groups)
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(total, [tail, 100 - tail])
    return float(lo), float(hi)
