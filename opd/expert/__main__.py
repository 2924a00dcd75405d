"""`python -m opd.expert SPEC [key=value ...] [--out DIR] [--fresh]`: train one capability expert with GSPO
(the same as `opd train-expert` and `python scripts/train_expert.py`). The lab starts its expert processes
this way, so it needs no checkout's scripts/ directory."""

import sys

from opd.expert.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main(prog="python -m opd.expert"))
