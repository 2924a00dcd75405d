"""bench/bench_opd_trl.py and bench/bench_gspo_trl.py on their smallest paths: TRL 1.16 and opd on pico
models, interleaved, with the quality table and the `ratio:` last line. TRL is the `bench` extra."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason='TRL is the bench extra: pip install "torch==2.13.0" "trl==1.16.*"')

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run(script: str, *args: str) -> list[str]:
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_opd_against_trl_quick_one_teacher_two_seeds():
    lines = run("bench_opd_trl.py", "--quick", "--teachers", "1", "--seeds", "2", "--tokens", "300", "--grid", "150",
                "--eval-limit", "4")
    # interleaved: opd, trl, then trl, opd
    order = [m[1] + m[2] for line in lines if (m := re.match(r"(opd|trl) seed (\d):", line))]
    assert order == ["opd0", "trl0", "trl1", "opd1"]
    for line in lines:
        if re.match(r"(opd|trl) seed", line):
            assert int(re.search(r"(\d+) student tokens", line)[1]) > 0 and "tokens/s" in line
    assert any(line.startswith("settings that differ:") for line in lines)
    table = lines[lines.index(next(line for line in lines if line.strip().startswith("tokens "))) + 1:]
    assert [int(row.split()[0]) for row in table[:2]] == [150, 300]  # the same grid for both sides
    assert any(re.search(r"cores \[[\d, ]+\]: trl \d+ thread", line) for line in lines)
    assert re.fullmatch(r"ratio: \d+\.\d\d", lines[-1])


def test_gspo_against_trl_smallest():
    lines = run("bench_gspo_trl.py", "--base", "no-such-dir", "--steps", "1", "--repeats", "2", "--val", "0",
                "--pretrain-steps", "5", "--prompts", "2", "--group", "4", "--updates", "2")
    assert any("from experts/count.yaml" in line for line in lines)  # the shipped spec's lr and clip
    assert sum(line.startswith(("opd:", "trl:")) for line in lines) == 4
    assert re.fullmatch(r"ratio: \d+\.\d\d", lines[-1])
