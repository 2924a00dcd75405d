"""bench/bench_sort_cache.py on fake pico experts: it checks the two sorts agree and ends with its ratio."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_sort_cache.py"


def test_bench_compares_equal_sorts_and_prints_a_ratio():
    out = subprocess.run([sys.executable, str(BENCH), "--experts", "add", "rev", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("torch threads: 1;"))
    assert "task-vector tensors" in lines[head] and "identical values: True" in lines[head + 1]
    assert re.fullmatch(r"ratio: \d+\.\d\d", lines[-1])
