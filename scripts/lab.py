"""The tiny lab end to end: base -> GSPO experts -> merge search -> report.

    python scripts/lab.py [--recipe merge_recipes/lab.yaml] [--stages base,experts,merge] [--jobs N]

Every stage is cached or resumable: rerunning recomputes only what changed.
"""

from __future__ import annotations

import argparse
import sys

from opd.console import add_verbose_flag, quiet_third_party
from opd.errors import cli_main


@cli_main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="merge_recipes/lab.yaml", help="merge recipe whose experts the lab trains")
    ap.add_argument("--stages", default="base,experts,merge", help="comma-separated subset of base,experts,merge")
    ap.add_argument("--jobs", type=int, default=None, help="experts trained at once, one process each (default: "
                    "the recipe's train.jobs; their specs set the torch threads: on a 2-core machine --jobs 2 "
                    "with threads: 1 halves the experts stage)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the base's pre-training and of every expert "
                    "(default: the specs' own); another seed builds another lab, e.g. to check a result is not one "
                    "lucky draw")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        ap.error("--jobs: give 1 or more")
    quiet_third_party(args.verbose)  # the expert runs it starts follow (OPD_VERBOSE)

    from opd.lab.pipeline import run_lab

    run_lab(args.recipe, [s.strip() for s in args.stages.split(",") if s.strip()], jobs=args.jobs, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
