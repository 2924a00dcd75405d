"""bench/bench_opd_throughput.py --quick: its three runs on pico teachers, the tuned one on two CPU ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_opd_throughput.py"


def test_quick_runs_the_tuned_loop_on_two_ranks():
    # the smallest tuned steps (64 x 3 in 3 updates) and no stacked run (the loop's code with the default teacher bank,
    # which tests/test_distill*.py cover), to keep CI short
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--ranks", "2", "--runs", "loop,tuned", "--prompts",
                          "64", "--updates", "3", "--tokens", "600", "--grid", "300"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    tuned = next(line for line in lines if line.startswith("tuned "))
    assert "threads 1 x 2 ranks" in tuned
    # both ranks' tokens counted, and rank 0 ran the checks on the same grid as the one-process runs
    tokens = {line.split()[0]: int(re.search(r"(\d+) student tokens", line)[1]) for line in lines
              if re.match(r"(loop|stacked|tuned) +seed 0 threads", line)}
    assert set(tokens) == {"loop", "tuned"} and min(tokens.values()) >= 600
    assert tuned.count(":") >= 2 and "300:" in tuned
    assert re.fullmatch(r"ratio: \d+\.\d\d", lines[-1])


def test_ranks_must_divide_the_prompts():
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--ranks", "5"], capture_output=True, text=True)
    assert out.returncode == 2 and "--ranks 5: must be >= 1 and divide --prompts 128" in out.stderr


def test_runs_must_name_known_runs():
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--runs", "loop,fast"], capture_output=True, text=True)
    assert out.returncode == 2 and "--runs loop,fast: a comma-separated subset of loop,stacked,tuned" in out.stderr


def test_seeds_interleave_loop_and_tuned_and_pool_them():
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--runs", "loop,tuned", "--seeds", "2", "--tokens",
                          "600", "--grid", "300", "--sample-ahead", "1", "--inference-dtype", "bfloat16",
                          "--prompts", "64", "--updates", "3"],  # small steps: two grid points in 600 tokens
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    runs = [(m[1], int(m[2])) for line in lines if (m := re.match(r"(loop|tuned) +seed (\d+) ", line))]
    assert runs == [("loop", 0), ("tuned", 0), ("loop", 1), ("tuned", 1)]  # interleaved: both meet the same load
    pooled = {line.split()[0]: line for line in lines if re.match(r"(loop|tuned) +over 2 seeds: ", line)}
    assert set(pooled) == {"loop", "tuned"} and "300:" in pooled["tuned"] and "600:" in pooled["tuned"]
    assert "sampling ahead in a process, bfloat16 sampling and teacher scoring" in out.stdout
    assert re.search(r"tuned / loop: \d+\.\d\dx student tokens/s \(per seed: \d+\.\d\dx, \d+\.\d\dx\)", out.stdout)
    assert re.fullmatch(r"ratio: \d+\.\d\d", lines[-1])
