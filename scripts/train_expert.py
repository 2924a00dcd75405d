"""Train one capability expert with GSPO and register it in experts/<name>/.

    python scripts/train_expert.py experts/count.yaml [key=value ...] [--out DIR]

Kill it at any point: the same command resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opd.config import parse_overrides
from opd.console import add_verbose_flag, quiet_third_party
from opd.errors import cli_main, naming_file


@cli_main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", help="expert spec YAML (experts/<capability>.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. gspo.lr=1e-3 steps=50")
    ap.add_argument("--out", default=None, help="output directory (default: experts/<name>)")
    ap.add_argument("--fresh", action="store_true",
                    help="start over: ignore a checkpoint, and train a new version even if this spec's expert exists")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    quiet_third_party(args.verbose)

    from opd.expert.run import run_expert
    from opd.expert.spec import load_expert_spec

    overrides = parse_overrides(args.overrides)
    spec = load_expert_spec(args.spec, **overrides)
    naming_file(args.spec, run_expert, spec, out=Path(args.out) if args.out else None, fresh=args.fresh)


if __name__ == "__main__":
    sys.exit(main())
