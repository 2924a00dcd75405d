"""scripts/retention_noise.py: how often a student with exactly its experts' skill meets a retention
target on a run's test split, from the run's own results.json."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from retention_noise import copy_chances, counted_rows  # noqa: E402


def _results(n: int, expert: float = 0.3, base: float = 0.1, z_expert: bool = True) -> dict:
    se = lambda p: (p * (1 - p) / n) ** 0.5  # noqa: E731
    cells = []
    for cap in ("a", "b"):
        cells += [{"candidate": "base", "capability": cap, "score": base, "stderr": se(base), "n": n, "retention": 1},
                  {"candidate": f"expert {cap}", "capability": cap, "score": expert, "stderr": se(expert), "n": n,
                   "retention": 1.0},
                  {"candidate": "#1 opd", "capability": cap, "score": expert, "stderr": se(expert), "n": n,
                   "retention": 1.0}]
    # a third capability whose expert does not beat the base: not counted, however small its split
    cells += [{"candidate": c, "capability": "c", "score": 0.1, "stderr": se(0.1), "n": 5, "retention": 1.0}
              for c in ("base", "expert c", "#1 opd")]
    return {"best": "#1 opd", "owners": {"a": "a", "b": "b", "c": "c"}, "matrix": {"test": cells}}


def test_counted_rows_are_the_headlines_capabilities():
    rows = counted_rows(_results(300))
    assert [r["capability"] for r in rows] == ["a", "b"] and rows[0]["n"] == 300 and rows[0]["reference"] == 0.3


def test_a_copy_meets_the_target_on_large_splits_and_rarely_on_small_ones():
    big = copy_chances(counted_rows(_results(200_000)), 0.95, 0.80, 4000)
    assert big["p_retention"] > 0.99 and big["p_gain"] > 0.99
    small = copy_chances(counted_rows(_results(125)), 0.95, 0.80, 4000)
    # one capability: P(Bin(125, 0.3) >= 0.95 * 37.5) is about 0.6, two independent ones about 0.4
    assert 0.25 < small["p_retention"] < 0.55
    assert small["median_min_retention"] < 0.95
    assert set(small["per_capability"]) == {"a", "b"}


def test_bad_results_file_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"best": "#1"}))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "retention_noise.py"), str(bad)],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "results.json" in proc.stderr and "Traceback" not in proc.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_results(300)))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "retention_noise.py"), str(good), "--draws", "500"],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0 and "P(min retention >= 0.95)" in proc.stdout
