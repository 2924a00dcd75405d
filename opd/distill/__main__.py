"""`python -m opd.distill RUN.yaml [key=value ...] [--fresh] [--no-eval]`: one on-policy distillation run.

Kill it at any point: the same command resumes from the last checkpoint. A run with `deepspeed:`
runs on N ranks under `deepspeed --num_gpus N --no_local_rank --module opd.distill RUN.yaml [...]`.
"""

from __future__ import annotations

import argparse
import sys

from opd.console import add_verbose_flag, quiet_third_party
from opd.distill.config import load_run
from opd.errors import cli_main, naming_file


@cli_main
def main(argv: list[str] | None = None, prog: str = "python -m opd.distill") -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.add_argument("run", help="distillation run YAML (fields: opd.distill.config.DistillRun)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. distill.steps=20")
    ap.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and start over")
    ap.add_argument("--no-eval", action="store_true", help="skip the lm-eval retention checks")
    add_verbose_flag(ap)
    args = ap.parse_intermixed_args(argv)
    quiet_third_party(args.verbose)
    # lazy: opd.distill.run adds mergekit and rich (~70 ms) that --help and a bad run YAML need not load
    from opd.distill.run import run_distill

    naming_file(args.run, run_distill, load_run(args.run, args.overrides),
                log=lambda m: print(m, file=sys.stderr, flush=True), fresh=args.fresh, evaluate=not args.no_eval)


if __name__ == "__main__":
    main()
