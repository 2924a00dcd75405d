"""Build (or resume) the tiny lab's base model (same as `opd base`).

    python scripts/build_base.py [--spec opd/lab/base.yaml] [--out runs/base] [key=value ...]
"""

import sys

from opd.lab.cli import base_main

if __name__ == "__main__":
    sys.exit(base_main(prog="python scripts/build_base.py"))
