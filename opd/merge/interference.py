"""Interference: what each candidate keeps and loses per capability, against experts and base."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def retention(score: float, reference: float) -> float:
    """score / reference. A reference of 0 leaves nothing to lose, so any score retains it fully."""
    return score / reference if reference > 0 else 1.0


# An expert "beats the base" on a capability when its score exceeds the base's by this many standard
# errors of the difference. Only those capabilities count in min/mean retention objectives and in
# gain kept: retention against an expert that learnt nothing measures noise (1 item in 300).
MIN_GAIN_Z = 2.0


def gain_z(expert: float, expert_se: float, base: float, base_se: float) -> float:
    """(expert - base) / stderr of the difference."""
    se = math.sqrt(expert_se ** 2 + base_se ** 2)
    return (expert - base) / se if se > 0 else (math.inf if expert > base else 0.0)


def dominates(a: list[float], b: list[float]) -> bool:
    """a Pareto-dominates b when maximising every value."""
    return all(x >= y for x, y in zip(a, b, strict=True)) and any(x > y for x, y in zip(a, b, strict=True))


def pareto_front(points: dict[int, list[float]]) -> list[int]:
    """Keys of the non-dominated points (maximisation), in key order."""
    return [k for k, v in points.items() if not any(dominates(w, v) for j, w in points.items() if j != k)]


@dataclass(frozen=True)
class Cell:
    """One candidate on one capability."""

    candidate: str
    capability: str
    split: str
    score: float
    stderr: float
    n: int
    reference: float  # the expert's own score on this capability (the base's when no expert owns it)
    retention: float
    base: float
    delta_vs_base: float


def interference_matrix(scores: dict[str, dict], references: dict[str, float], base: dict[str, float],
                        split: str) -> list[Cell]:
    """Rows candidate x capability. `scores[candidate][cap]` is an `opd.evaluation.api.Score`."""
    cells = []
    for cand, per_cap in scores.items():
        for cap, s in per_cap.items():
            cells.append(Cell(cand, cap, split, s.score, s.stderr, s.n, references[cap],
                              retention(s.score, references[cap]), base[cap], s.score - base[cap]))
    return cells


def as_table(cells: list[Cell], field: str = "retention") -> tuple[list[str], list[str], list[list[float]]]:
    """(candidates, capabilities, values[candidate][capability]) for one field of the cells."""
    cands = list(dict.fromkeys(c.candidate for c in cells))
    caps = list(dict.fromkeys(c.capability for c in cells))
    lookup = {(c.candidate, c.capability): getattr(c, field) for c in cells}
    return cands, caps, [[lookup.get((a, b), float("nan")) for b in caps] for a in cands]


def to_records(cells: list[Cell]) -> list[dict]:
    return [asdict(c) for c in cells]
