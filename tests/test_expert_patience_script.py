"""scripts/expert_patience.py: what a patience would have kept, read off an expert's screenings."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from expert_patience import with_patience  # noqa: E402


def test_stop_and_kept_step_follow_the_loop():
    screens = [(10, 0.1), (20, 0.3), (30, 0.2), (40, 0.25), (50, 0.5)]
    assert with_patience(0.0, screens, None) == (50, 50, 0.5)
    assert with_patience(0.0, screens, 2) == (40, 20, 0.3)  # two screenings after step 20 without a better one
    assert with_patience(0.0, screens, 3) == (50, 50, 0.5)
    assert with_patience(0.4, screens, 1) == (10, 0, 0.4)  # step 0's screen is the one to beat


def test_table_and_missing_experts(tmp_path):
    e = tmp_path / "experts" / "add"
    e.mkdir(parents=True)
    hist = [{"step": s, "val": v} for s, v in [(10, 0.1), (20, 0.3), (30, 0.2), (40, 0.25), (50, 0.5)]]
    (e / "manifest.json").write_text(json.dumps({"name": "add", "train": {"steps": 50, "history": hist}}))
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "add.log").write_text("step 0: val add = 0.050\n")
    run = [sys.executable, str(ROOT / "scripts" / "expert_patience.py"), str(e.parent), "--patience", "2",
           "--logs", str(logs)]
    out = subprocess.run(run, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| add | 50 | 50 (0.500) | 40 / 20 (0.300) * |" in out.stdout
    assert "patience 2: 40 of 50 steps (0.80); kept step changed on 1 of 1: add 0.300<0.500" in out.stdout
    (logs / "add.log").unlink()
    out = subprocess.run(run, capture_output=True, text=True)
    assert out.returncode == 2 and "step 0's val screen" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(run[:2] + [str(tmp_path / "none")], capture_output=True, text=True)
    assert out.returncode == 2 and "no expert manifests" in out.stderr
