"""Train one capability expert with GSPO and register it in experts/<name>/ (same as `opd train-expert`).

    python scripts/train_expert.py experts/count.yaml [key=value ...] [--out DIR]

Kill it at any point: the same command resumes from the last checkpoint.
"""

import sys

from opd.expert.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main(prog="python scripts/train_expert.py"))
