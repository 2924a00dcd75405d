"""How often would a student with exactly its experts' skill meet a retention target on this test split?

    python scripts/retention_noise.py runs/merge/lab12_noverifier/results.json [--target 0.95] [--gain 0.80]

Reads a merge run's test matrix (`results.json`: each capability's items `n`, base and expert scores)
and the capabilities its headline counts (those whose expert beats the base by 2 stderr on test). A student whose accuracy
on every counted capability is its expert's measured test accuracy scores Binomial(n, p) / n on each,
independently; over --draws such students it prints the chance that the minimum retention (student /
expert) reaches --target and that the minimum gain kept ((student - base) / (expert - base)) reaches
--gain, with the median minimum and each capability's own chance. A target that a perfect copy meets
only by luck cannot tell a good consolidation from a bad one on these splits.

The model of the noise is opd.merge.noise's (whose range the report's headline prints): independent items,
which overstate the spread a little, as a copy errs where its expert errs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from opd.merge.headline import capability_rows
from opd.merge.noise import Split, copy_draws


def copy_chances(rows: list[dict], target: float, gain: float, draws: int, seed: int = 0) -> dict:
    """rows: per counted capability {capability, n, base, reference}. Returns the chances that a student
    of the experts' own accuracy meets each target, the median minima, and per-capability chances."""
    splits = [Split(r["capability"], r["n"], r["base"], r["reference"]) for r in rows]
    retention, gain_kept = copy_draws(splits, draws, seed)
    return {
        "p_retention": float((retention.min(1) >= target).mean()),
        "p_gain": float((gain_kept.min(1) >= gain).mean()),
        "median_min_retention": float(np.median(retention.min(1))),
        "median_min_gain": float(np.median(gain_kept.min(1))),
        "per_capability": {r["capability"]: float((retention[:, i] >= target).mean()) for i, r in enumerate(rows)},
    }


def counted_rows(results: dict) -> list[dict]:
    """The test rows of the capabilities the report's headline counts (their expert beats the base by
    2 stderr on test: `opd.merge.headline`), with their items `n`, base and expert scores."""
    cells = results["matrix"]["test"]
    expert_of = {cap: f"expert {owner}" for cap, owner in results["owners"].items()}
    return [{"capability": r.capability, "n": r.n, "base": r.base, "reference": r.expert}
            for r in capability_rows(cells, results["best"], expert_of) if r.gain_kept is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a merge run's results.json")
    ap.add_argument("--target", type=float, default=0.95, help="min retention target (default 0.95)")
    ap.add_argument("--gain", type=float, default=0.80, help="min gain kept target (default 0.80)")
    ap.add_argument("--draws", type=int, default=20000)
    args = ap.parse_args(argv)
    try:
        results = json.loads(args.results.read_text())
        rows = counted_rows(results)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.results}: not a merge run's results.json with a test matrix ({e}): pass "
              "runs/merge/<name>/results.json of a finished run", file=sys.stderr)
        return 2
    if not rows or any(r["n"] is None for r in rows):
        print(f"error: {args.results}: no counted capability with its items (n) in its test matrix: pass the "
              "results.json of a run whose matrix records n (runs/merge/<name>/results.json)", file=sys.stderr)
        return 2
    out = copy_chances(rows, args.target, args.gain, args.draws)
    print(f"{len(rows)} counted capabilities, a student with exactly its experts' test accuracy, {args.draws} draws:")
    print(f"  P(min retention >= {args.target}) = {out['p_retention']:.2f}   median min retention "
          f"{out['median_min_retention']:.2f}")
    print(f"  P(min gain kept >= {args.gain}) = {out['p_gain']:.2f}   median min gain kept {out['median_min_gain']:.2f}")
    print("  per capability, P(retention >= target): " + ", ".join(
        f"{c} {v:.2f} (n {r['n']}, expert {r['reference']:.3f})"
        for (c, v), r in zip(out["per_capability"].items(), rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
