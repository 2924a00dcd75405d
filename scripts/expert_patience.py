"""What an expert `patience` would have done to trained experts, read off their manifests' val screenings.

    python scripts/expert_patience.py experts/lab10 [--patience 3 5 8 10 15] [--logs runs/lab/logs]

For each expert (a directory with an opd manifest) and each patience P: the step the run would have
stopped at, the step it would have kept, that step's val screen against the full run's best, and the
share of the run's steps it would have skipped. A run with patience is the full run's prefix (seeded),
so this reads exactly what it would have kept; the seconds saved are roughly the steps saved.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def screenings(history: list[dict]) -> list[tuple[int, float]]:
    """(step, val) of every screening after step 0, in order."""
    return [(h["step"], h["val"]) for h in history if "val" in h and h["step"] > 0]


def step0(history: list[dict], log: Path) -> float | None:
    """Step 0's val screen: in the history (a learned-reward expert's), else the first in its log."""
    for h in history:
        if h.get("step") == 0 and "val" in h:
            return h["val"]
    if log.exists():
        found = re.search(r"step 0: val (?:\S+ = )?([0-9.]+)", log.read_text(errors="replace"))
        if found:
            return float(found.group(1))
    return None


def with_patience(first: float, screens: list[tuple[int, float]], patience: int | None,
                  eval_every: int = 10) -> tuple[int, int, float]:
    """(stop step, kept step, kept val) of the loop in opd.expert.trainer given its val screenings:
    `first` is step 0's screen; a screen counts as better only when strictly above the best so far,
    and the loop's own rule (opd.expert.trainer.out_of_patience) decides the stop."""
    from opd.expert.trainer import out_of_patience  # lazy: loads torch

    best_step, best = 0, first
    for step, val in screens:
        if val > best:
            best_step, best = step, val
        if out_of_patience(step, best_step, eval_every, patience):
            return step, best_step, best
    return (screens[-1][0] if screens else 0), best_step, best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experts", help="a directory of experts (each with manifest.json)")
    ap.add_argument("--patience", type=int, nargs="+", default=[3, 5, 8, 10, 15])
    ap.add_argument("--logs", default="runs/lab/logs", help="the lab's expert logs (<name>.log), for step 0's "
                    "screen when the manifest's history lacks it")
    args = ap.parse_args(argv)
    rows = []
    for mf in sorted(Path(args.experts).glob("*/manifest.json")):
        m = json.loads(mf.read_text())
        train = m.get("train") or {}
        if "history" not in train:
            continue
        hist = train["history"]
        first = step0(hist, Path(args.logs) / f"{m['name']}.log")
        if first is None:
            print(f"error: {mf}: step 0's val screen is neither in its history nor in {args.logs}/{m['name']}.log; "
                  "pass --logs DIR with the lab's expert logs", file=sys.stderr)
            return 2
        rows.append((m["name"], first, screenings(hist), train["steps"], (m.get("spec") or {}).get("eval_every", 10)))
    if not rows:
        print(f"error: {args.experts}: no expert manifests with a training history; train experts first "
              "(python scripts/lab.py --recipe merge_recipes/lab10.yaml)", file=sys.stderr)
        return 2
    print("| expert | steps | full run: kept step (val) | " + " | ".join(f"P={p}: stop / kept (val)" for p in args.patience) + " |")
    print("|---|---|---|" + "---|" * len(args.patience))
    total = {p: 0 for p in args.patience}
    steps_all = 0
    changed = {p: [] for p in args.patience}
    for name, first, screens, steps, every in rows:
        _, kept, val = with_patience(first, screens, None, every)
        cells = []
        for p in args.patience:
            stop, k, v = with_patience(first, screens, p, every)
            total[p] += stop
            if k != kept:
                changed[p].append(f"{name} {v:.3f}<{val:.3f}")
            cells.append(f"{stop} / {k} ({v:.3f})" + ("" if k == kept else " *"))
        steps_all += steps
        print(f"| {name} | {steps} | {kept} ({val:.3f}) | " + " | ".join(cells) + " |")
    print()
    for p in args.patience:
        print(f"patience {p}: {total[p]} of {steps_all} steps ({total[p] / steps_all:.2f}); "
              f"kept step changed on {len(changed[p])} of {len(rows)}" + (f": {', '.join(changed[p])}" if changed[p] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
