"""scripts/opd_kl_retention.py: per-capability KL against retention from a run's history, by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from opd_kl_retention import capability_kl, report, spearman, trajectories  # noqa: E402


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    hist = []
    for step in range(1, 5):  # a's KL falls and its retention rises; b's KL stays high, its retention flat
        rec = {"step": step, "loss": 1.0, "kl/ta": 2.0 / step, "kl/tb1": 1.0, "kl/tb2": 3.0}
        if step % 2 == 0:
            rec.update({"min_retention": 0.5, "retention/a": 0.4 + 0.2 * step, "retention/b": 0.5})
        hist.append(rec)
    (run / "history.json").write_text(json.dumps(hist))
    (run / "manifest.json").write_text(json.dumps({"routes": {"a": {"ta": 1.0}, "b": {"tb1": 0.5, "tb2": 0.5}}}))
    return run


def test_trajectories_and_table_by_hand(tmp_path):
    run = _run(tmp_path)
    hist = json.loads((run / "history.json").read_text())
    routes = json.loads((run / "manifest.json").read_text())["routes"]
    assert capability_kl(hist[0], "b", routes) == pytest.approx(2.0)  # the teachers' weighted mean
    traj = trajectories(hist, routes, window=2)
    # checks at steps 2 and 4; a's KL over steps 1-2 = (2 + 1) / 2, over 3-4 = (2/3 + 1/2) / 2
    assert traj["a"] == [(2, pytest.approx(1.5), pytest.approx(0.8)), (4, pytest.approx(7 / 12), pytest.approx(1.2))]
    assert traj["b"] == [(2, 2.0, 0.5), (4, 2.0, 0.5)]
    text, _ = report(run, window=2)
    assert "| b | 2.000 | 2.000 | 0% | 0.50 / 0.50 |" in text
    assert "| a | 1.500 | 0.583 | 61% | 0.80 / 1.20 | 1.20 | 1.20 |" in text
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0) and spearman([1, 2, 3], [1, 2, 3]) == pytest.approx(1.0)


def test_missing_history_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "opd_kl_retention.py"), str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "no history.json" in out.stderr and "Traceback" not in out.stderr
    plot = tmp_path / "kl.png"
    ok = subprocess.run([sys.executable, str(ROOT / "scripts" / "opd_kl_retention.py"), str(_run(tmp_path)),
                         "--window", "2", "--plot", str(plot)], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and plot.stat().st_size > 0 and "| a |" in ok.stdout
