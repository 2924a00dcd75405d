"""Command lines of the tiny lab: `opd lab` / `python scripts/lab.py` (the whole pipeline) and
`opd base` / `python scripts/build_base.py` (its base model alone)."""

from __future__ import annotations

import argparse

from opd.config import parse_overrides
from opd.console import add_verbose_flag, quiet_third_party
from opd.errors import cli_main

LAB_DOC = """The tiny lab end to end: base -> GSPO experts -> merge search (merges, OPD) -> report.

    opd lab [--recipe merge_recipes/lab.yaml] [--stages base,experts,merge] [--jobs N] [--seed S] [--ray [ADDRESS]]

Every stage is cached or resumable: rerunning recomputes only what changed.
"""

BASE_DOC = """Build (or resume) the tiny lab's base model and print its per-capability lm-eval scores.

    opd base [--spec opd/lab/base.yaml] [--out runs/base] [key=value ...]
"""


@cli_main
def lab_main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=LAB_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="merge_recipes/lab.yaml", help="merge recipe whose experts the lab trains")
    ap.add_argument("--stages", default="base,experts,merge", help="comma-separated subset of base,experts,merge")
    ap.add_argument("--jobs", type=int, default=None, help="experts trained at once, one process each (default: "
                    "the recipe's train.jobs; their specs set the torch threads: on a 2-core machine --jobs 2 "
                    "with threads: 1 halves the experts stage)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the base's pre-training and of every expert "
                    "(default: the specs' own); another seed builds another lab, e.g. to check a result is not one "
                    "lucky draw")
    ap.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                    help="train the experts as Ray tasks on the cluster at ADDRESS (default 'auto': the one "
                    "`ray start` made on this machine; or ray://host:port, host:port); see docs/cluster.md")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        ap.error("--jobs: give 1 or more")
    quiet_third_party(args.verbose)  # the expert runs it starts follow (OPD_VERBOSE)
    from opd.lab.pipeline import run_lab  # lazy: keeps `opd lab --help` to argparse (it loads rich)

    run_lab(args.recipe, [s.strip() for s in args.stages.split(",") if s.strip()], jobs=args.jobs, seed=args.seed,
            ray=args.ray)


@cli_main
def base_main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=BASE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=None, help="base spec YAML (default: opd/lab/base.yaml)")
    ap.add_argument("--out", default="runs/base", help="output HF model directory")
    ap.add_argument("--force", action="store_true", help="rebuild even if the output exists")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=200 threads=1")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    quiet_third_party(args.verbose)
    from opd.lab.run import build_and_report  # lazy: opd.lab.run loads transformers and torch

    build_and_report(args.spec, args.out, force=args.force, overrides=parse_overrides(args.overrides))
