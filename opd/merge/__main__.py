"""`python -m opd.merge --recipe merge_recipes/lab.yaml [--fresh] [--worker | --workers N --ray [ADDRESS]] [key=value ...]`
or `python -m opd.merge export <run dir> <trial> [--out DIR]` (one candidate as mergekit YAML + model)
or `python -m opd.merge report <run dir>` (render a finished run's report again).

Rerunning the same command continues a killed or unfinished study (as an expert run does); --fresh
deletes the study and starts over."""

from __future__ import annotations

import argparse
import sys

from opd.console import add_verbose_flag, quiet_third_party
from opd.errors import cli_main, naming_file
from opd.merge import load_recipe, run_recipe
from opd.merge.cluster import search_on_ray
from opd.merge.export import export_trial
from opd.merge.report import rewrite_report


@cli_main
def main(argv: list[str] | None = None, prog: str = "python -m opd.merge") -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:], prog=f"{prog} export")
    if argv[:1] == ["report"]:
        return report_main(argv[1:], prog=f"{prog} report")
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.add_argument("--recipe", required=True, help="merge recipe YAML (see merge_recipes/)")
    ap.add_argument("--fresh", action="store_true",
                    help="delete the recipe's study (and its OPD students) and start over; by default a rerun "
                    "continues the study where it stopped")
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for scripts
    ap.add_argument("--worker", action="store_true", help="join a shared study (RDB storage) as one more worker")
    ap.add_argument("--workers", type=int, default=None, metavar="N", help="with --ray: start N search workers "
                    "as Ray tasks sharing the study, then re-score the finalists and write the report here")
    ap.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                    help="the Ray cluster of --workers ('auto': the one `ray start` made here; ray://host:port or "
                    "host:port); see docs/cluster.md")
    ap.add_argument("--no-live", action="store_true", help="no live progress table")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. budget.n_trials=20")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    quiet_third_party(args.verbose)

    recipe = load_recipe(args.recipe, args.overrides)
    if args.fresh and args.worker:
        ap.error("--fresh deletes the shared study: start it over from one process, then add --worker ones")
    if (args.workers is None) != (args.ray is None) or args.worker and args.ray is not None:
        ap.error("--workers N and --ray [ADDRESS] go together (N workers as Ray tasks), without --worker")
    if args.workers is not None and args.workers < 1:
        ap.error("--workers: give 1 or more")
    if args.ray is not None:  # the workers search on the cluster; this process then writes the report

        if args.fresh:
            ap.error("--fresh with --workers: start the study over on this machine first (--fresh alone)")
        naming_file(args.recipe, search_on_ray, args.recipe, args.overrides, recipe, args.workers, args.ray)
    naming_file(args.recipe, run_recipe, recipe, resume=not args.fresh, worker=args.worker, live=not args.no_live,
                fresh=args.fresh)


@cli_main
def export_main(argv: list[str] | None = None, prog: str = "python -m opd.merge export") -> None:
    ap = argparse.ArgumentParser(prog=prog,
                                 description="Write a searched candidate's mergekit YAML and rebuild it with "
                                 "mergekit's run_merge, checked tensor for tensor against the search's merge.")
    ap.add_argument("run", help="a merge run's out directory (runs/merge/<name>)")
    ap.add_argument("trial", type=int, help="trial number (report.md lists them)")
    ap.add_argument("--out", help="output directory (default: <run>/export/trial-<n>)")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    quiet_third_party(args.verbose)

    export_trial(args.run, args.trial, args.out)


@cli_main
def report_main(argv: list[str] | None = None, prog: str = "opd report") -> None:
    ap = argparse.ArgumentParser(prog=prog, description="Render a finished merge run's report (report.md, "
                                 "report.html, plots) again from its results.json and print its headline; "
                                 "scores and trains nothing.")
    ap.add_argument("run", help="a merge run's out directory (runs/merge/<name>)")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    quiet_third_party(args.verbose)

    print(f"report: {rewrite_report(args.run)}")


if __name__ == "__main__":
    main()
