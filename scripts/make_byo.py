"""Write the bring-your-own test bed that merge_recipes/byo.yaml merges (seeded, no download):

    python scripts/build_base.py            # the lab base, runs/base (once)
    python scripts/make_byo.py [--base runs/base] [--out runs/byo] [--steps 300] [--train 2000] [--test 400]

- out/data/byo_arith_{train,test}.jsonl: a GSM8K-format task (word problem, "a+b=c #### c");
  out/tasks/byo_arith.yaml: evals/byo/byo_arith.yaml with absolute data paths;
- out/experts/arith and out/experts/sort: the base fine-tuned with plain transformers `Trainer`
  on byo_arith and on opd's `sort`, saved as plain HF directories (no opd manifest).
"""

import argparse
import json
import sys
from pathlib import Path

from opd.errors import cli_main


@cli_main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/make_byo.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="runs/base", help="the base model directory (scripts/build_base.py)")
    ap.add_argument("--out", default="runs/byo", help="where the task data and experts go")
    ap.add_argument("--train", type=int, default=2000, help="training docs (and fine-tuning examples)")
    ap.add_argument("--test", type=int, default=400, help="test docs (opd hash-splits them into val/test)")
    ap.add_argument("--steps", type=int, default=300, help="Trainer steps per expert (batch 32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from opd.lab.byo import make_byo
    from opd.paths import require_model_dir

    base = require_model_dir(args.base, "base", "build it with python scripts/build_base.py or pass --base")
    out = make_byo(base, Path(args.out), args.train, args.test, args.steps, args.seed)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
