"""The tiny lab end to end: base -> GSPO experts -> merge search -> report (same as `opd lab`).

    python scripts/lab.py [--recipe merge_recipes/lab.yaml] [--stages base,experts,merge] [--jobs N]
"""

import sys

from opd.lab.cli import lab_main

if __name__ == "__main__":
    sys.exit(lab_main(prog="python scripts/lab.py"))
