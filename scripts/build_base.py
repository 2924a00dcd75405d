"""Build (or resume) the tiny lab's base model and print its per-capability lm-eval scores.

    python scripts/build_base.py [--spec opd/lab/base.yaml] [--out runs/base] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys

from opd.config import parse_overrides
from opd.console import add_verbose_flag, quiet_third_party
from opd.errors import cli_main


@cli_main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=None, help="base spec YAML (default: opd/lab/base.yaml)")
    ap.add_argument("--out", default="runs/base", help="output HF model directory")
    ap.add_argument("--force", action="store_true", help="rebuild even if the output exists")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=200 threads=1")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    quiet_third_party(args.verbose)

    from opd.lab.run import build_and_report

    overrides = parse_overrides(args.overrides)
    build_and_report(args.spec, args.out, force=args.force, overrides=overrides)


if __name__ == "__main__":
    sys.exit(main())
