"""`opd train-expert` / `python -m opd.expert` / `python scripts/train_expert.py`: train one capability
expert with GSPO."""

from __future__ import annotations

import argparse
from pathlib import Path

from opd.config import parse_overrides
from opd.console import add_verbose_flag, quiet_third_party
from opd.errors import cli_main, naming_file

DOC = """Train one capability expert with GSPO and register it in experts/<name>/.

    opd train-expert experts/count.yaml [key=value ...] [--out DIR] [--fresh]

Kill it at any point: the same command resumes from the last checkpoint.
"""


@cli_main
def train_main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", help="expert spec YAML (experts/<capability>.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. gspo.lr=1e-3 steps=50")
    ap.add_argument("--out", default=None, help="output directory (default: experts/<name>)")
    ap.add_argument("--fresh", action="store_true",
                    help="start over: ignore a checkpoint, and train a new version even if this spec's expert exists")
    add_verbose_flag(ap)
    args = ap.parse_args(argv)
    quiet_third_party(args.verbose)
    from opd.expert.run import run_expert  # lazy: opd.expert.run loads transformers and torch
    from opd.expert.spec import load_expert_spec  # lazy: opd.expert.spec loads torch and numpy

    spec = load_expert_spec(args.spec, **parse_overrides(args.overrides))
    naming_file(args.spec, run_expert, spec, out=Path(args.out) if args.out else None, fresh=args.fresh)
