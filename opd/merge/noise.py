"""What a test split's noise alone does to the headline's minima: a student with exactly its experts'
accuracy on every counted capability scores Binomial(n, expert accuracy) / n on each split,
independently. Its minima over the capabilities, drawn many times, say how low a perfect copy lands on
these splits: a candidate's minimum inside that range cannot be told from a copy of its experts, and a
retention target above it is one that a copy meets only by luck (`scripts/retention_noise.py` prints the
chance for a given target).

Independent item noise overstates the spread a little: the student and its expert answer the same
items, and a student that copies its expert errs where the expert errs (as the headline's unpaired
stderr is an upper bound)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Split:
    capability: str
    n: int  # test items
    base: float  # the base's accuracy
    expert: float  # the expert's accuracy, the copy's own


def copy_draws(splits: list[Split], draws: int = 4000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(retention, gain kept) of `draws` perfect copies on each split: two (draws, capabilities) arrays.
    Seeded: the same splits give the same draws."""
    rng = np.random.default_rng(seed)
    n = np.array([s.n for s in splits])
    p = np.array([s.expert for s in splits], dtype=float)
    base = np.array([s.base for s in splits], dtype=float)
    student = rng.binomial(n, p, size=(draws, len(splits))) / n
    return student / p, (student - base) / (p - base)


def copy_minima(splits: list[Split], draws: int = 4000, seed: int = 0) -> dict[str, float]:
    """The median and the 5th-95th percentiles of a perfect copy's min retention and min gain kept."""
    retention, gain = copy_draws(splits, draws, seed)
    out = {}
    for name, x in (("retention", retention.min(1)), ("gain_kept", gain.min(1))):
        lo, med, hi = np.percentile(x, [5, 50, 95])
        out |= {f"{name}_lo": float(lo), f"{name}_median": float(med), f"{name}_hi": float(hi)}
    return out
