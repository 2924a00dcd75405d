"""The lab from scratch, an earlier commit's code against this tree's, back to back on one machine:
wall minutes per stage for both, then `ratio:` (this tree / the earlier commit, below 1: faster).

    python bench/bench_lab_wall.py --before 49db288                      # lab10, seed 0: ~45 min idle
    python bench/bench_lab_wall.py --before 49db288 --seed 2
    python bench/bench_lab_wall.py --before 49db288 --recipe merge_recipes/lab.yaml --order after,before

Each side is a full copy of the project's tracked files at its revision (`git archive`; this tree's
side is `git stash create`, so uncommitted edits count, or HEAD when there are none) unpacked in a
temp directory, and runs `scripts/lab.py --recipe R [--seed S]` there with an empty `OPD_CACHE`,
`PYTHONPATH` set to that copy (so its own opd/ and kernels/ load, not the installed ones), its own
runs/ and experts/: nothing is shared between the sides or with this checkout. Minutes per stage are
the ones the lab records (its `lab_stages.json` and the merge's results.json `stages`), wall and CPU
seconds of the whole command beside them; the min retention and min gain kept on test come from the
same results.json, as the report's headline computes them: a faster lab only counts with the
targets met.
`uptime` is printed before and after each side: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tree_of(rev: str, into: Path) -> Path:
    """The project's tracked files as of `rev`, unpacked under `into`."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True)
    into.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(into, filter="data")
    return into


def this_tree() -> str:
    """A commit of the working tree (`git stash create`), or HEAD when nothing is uncommitted."""
    out = subprocess.run(["git", "-C", str(ROOT), "stash", "create"], capture_output=True, text=True, check=True)
    return out.stdout.strip() or "HEAD"


def headline(results: dict) -> dict:
    """Min retention and min gain kept on test of the lab's final model, from its results.json, as the
    report's headline computes them (opd.merge.headline)."""
    from opd.merge.headline import capability_rows, minima  # lazy: opd.merge loads torch
    from opd.merge.report import expert_rows  # lazy: as above

    m = minima(capability_rows(results["matrix"]["test"], results["best"], expert_rows(results)))
    return {k: "?" if m.get(k) is None else f"{m[k]:.2f}" for k in ("min_retention", "min_gain_kept")}


def run_side(name: str, code: Path, args) -> dict:
    """One lab run in `code`; its minutes per stage, wall and CPU seconds, and test headline."""
    env = {**os.environ, "PYTHONPATH": f"{code}:{code / 'kernels'}", "OPD_CACHE": str(code / ".cache-opd")}
    cmd = [sys.executable, "scripts/lab.py", "--recipe", args.recipe, *(["--seed", str(args.seed)] if args.seed is not None else [])]
    print(f"{name}: {' '.join(cmd[1:])} in {code}\n  uptime before: {os.getloadavg()}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.time()
    with open(code / "lab.log", "wb") as log:
        rc = subprocess.run(cmd, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"  uptime after: {os.getloadavg()}; exit {rc}; log {code / 'lab.log'}", flush=True)
    if rc != 0:
        raise SystemExit(f"{name}: the lab failed (exit {rc}); see {code / 'lab.log'}")
    from opd.merge import load_recipe  # lazy: opd.merge loads torch

    results = json.loads((code / load_recipe(code / args.recipe).out_dir / "results.json").read_text())
    return {"stages": results.get("stages", {}), "wall_min": wall / 60, "cpu_s": cpu, **headline(results)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the earlier commit (e.g. the main this work started from)")
    ap.add_argument("--recipe", default="merge_recipes/lab10.yaml")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--order", default="before,after", help="which side runs first (before,after or after,before)")
    ap.add_argument("--keep", action="store_true", help="keep the two copies (their runs, experts and logs)")
    args = ap.parse_args()
    order = args.order.split(",")
    if sorted(order) != ["after", "before"]:
        ap.error("--order: before,after or after,before")
    revs = {"before": args.before, "after": this_tree()}
    tmp = Path(tempfile.mkdtemp(prefix="opd-lab-wall-"))
    print(f"torch threads: as the lab sets them (the base spec's and the recipe's `threads` for the base and the "
          f"merge, each expert spec's for its process); os.cpu_count() {os.cpu_count()}; copies under {tmp}", flush=True)
    res = {side: run_side(side, tree_of(revs[side], tmp / side), args) for side in order}
    stages = list(dict.fromkeys(k for side in order for k in res[side]["stages"]))
    print(f"\n{'stage':<20}" + "".join(f"{s:>14}" for s in ("before", "after", "after/before")))
    for k in stages:
        b, a = res["before"]["stages"].get(k), res["after"]["stages"].get(k)
        r = f"{a / b:.2f}" if a is not None and b else "-"
        print(f"{k:<20}{b if b is None else f'{b:.1f}':>14}{a if a is None else f'{a:.1f}':>14}{r:>14}")
    for k in ("wall_min", "cpu_s"):
        b, a = res["before"][k], res["after"][k]
        print(f"{k:<20}{b:>14.1f}{a:>14.1f}{a / b:>14.2f}")
    for k in ("min_retention", "min_gain_kept"):
        print(f"{k + ' (test)':<20}{res['before'][k]:>14}{res['after'][k]:>14}")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"ratio: {res['after']['wall_min'] / res['before']['wall_min']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
