"""The lab pipeline's parallel experts stage: bounded concurrency, per-expert logs, clear failures."""

from __future__ import annotations

import sys

import pytest

from opd.errors import OpdError
from opd.lab.pipeline import run_lab, run_parallel

# Each command marks itself running, records how many are running, then unmarks itself.
PROBE = """
import os, sys, time
d, name = sys.argv[1], sys.argv[2]
open(os.path.join(d, name + '.running'), 'w').close()
n = len([f for f in os.listdir(d) if f.endswith('.running')])
open(os.path.join(d, name + '.seen'), 'w').write(str(n))
time.sleep(0.5)
os.remove(os.path.join(d, name + '.running'))
print('trained', name)
"""


def test_run_parallel_bounds_concurrency_and_logs(tmp_path):
    names = ["a", "b", "c", "d"]
    run_parallel({n: [sys.executable, "-c", PROBE, str(tmp_path), n] for n in names}, 2, tmp_path / "logs")
    seen = [int((tmp_path / f"{n}.seen").read_text()) for n in names]
    assert max(seen) <= 2
    assert all((tmp_path / "logs" / f"{n}.log").read_text().strip() == f"trained {n}" for n in names)


def test_run_parallel_names_the_failed_runs(tmp_path):
    cmds = {"ok": [sys.executable, "-c", "print('fine')"],
            "bad": [sys.executable, "-c", "import sys; print('spec broken: steps must be > 0'); sys.exit(2)"]}
    with pytest.raises(OpdError, match=r"1 of 2 expert runs failed \(bad: spec broken: steps must be > 0\)"):
        run_parallel(cmds, 2, tmp_path / "logs")


def test_unknown_stage_is_refused():
    with pytest.raises(OpdError, match="unknown stage"):
        run_lab("merge_recipes/lab.yaml", ["experts", "distil"])
