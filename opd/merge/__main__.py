"""`python -m opd.merge --recipe merge_recipes/lab.yaml [--resume] [--worker] [key=value ...]`."""

from __future__ import annotations

import argparse

from opd.console import add_verbose_flag, quiet_third_party
from opd.errors import cli_main


@cli_main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m opd.merge", description=__doc__)
    ap.add_argument("--recipe", required=True, help="merge recipe YAML (see merge_recipes/)")
    ap.add_argument("--resume", action="store_true", help="continue the recipe's study where it stopped")
    ap.add_argument("--worker", action="store_true", help="join a shared study (RDB storage) as one more worker")
    ap.add_argument("--no-live", action="store_true", help="no live progress table")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. budget.n_trials=20")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    quiet_third_party(args.verbose)

    from opd.errors import naming_file
    from opd.merge import load_recipe, run_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    naming_file(args.recipe, run_recipe, recipe, resume=args.resume, worker=args.worker, live=not args.no_live)


if __name__ == "__main__":
    main()
