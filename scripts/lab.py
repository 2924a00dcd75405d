"""The tiny lab end to end: base -> GSPO experts -> merge search -> report.

    python scripts/lab.py [--recipe merge_recipes/lab.yaml] [--stages base,experts,merge]

Every stage is cached or resumable: rerunning recomputes only what changed.
"""

from __future__ import annotations

import argparse
import sys

from opd.errors import cli_main


@cli_main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="merge_recipes/lab.yaml", help="merge recipe whose experts the lab trains")
    ap.add_argument("--stages", default="base,experts,merge", help="comma-separated subset of base,experts,merge")
    args = ap.parse_args(argv)

    from opd.lab.pipeline import run_lab

    run_lab(args.recipe, [s.strip() for s in args.stages.split(",") if s.strip()])


if __name__ == "__main__":
    sys.exit(main())
