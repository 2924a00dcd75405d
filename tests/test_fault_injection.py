"""SIGKILL expert training at seeded random moments: every rerun resumes and the result stays whole.

A fast subset of bench/fault_injection.py (which kills 20+ times): three kills, early enough in the
run that each one interrupts training rather than the final write.
"""

import importlib.util
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fault_injection", ROOT / "bench" / "fault_injection.py")
fi = importlib.util.module_from_spec(_spec)
sys.modules["fault_injection"] = fi  # dataclasses look their module up while the class is made
_spec.loader.exec_module(fi)


def test_three_sigkills_resume_to_the_uninterrupted_result(trained_pico_dir, tmp_path):
    spec = fi.write_spec(tmp_path / "count.yaml", trained_pico_dir, steps=8)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPD_CACHE": str(tmp_path / "cache")}
    ref_t = fi.Trainer(spec, tmp_path / "ref" / "count", env)
    ref_t.out.parent.mkdir()
    _, ref_s, _ = ref_t.run()
    ref = fi.summary(ref_t.out)

    t = fi.Trainer(spec, tmp_path / "killed" / "count", env)
    t.out.parent.mkdir()
    ep = fi.kill_episode(t, random.Random(0), (1.0, 0.5 * ref_s), max_kills=3, log=lambda *_: None)

    assert ep["kills"] >= 2, ep  # a rerun may outrun its delay once it has little left to do
    assert not ep["problems"], ep["problems"]
    assert not ep["leftovers"], ep["leftovers"]
    last = ep["ckpt_steps"][-1]
    assert ep["resumed_at"] == ([last] if last else []), ep  # the last rerun continued from the checkpoint
    assert ep["steps"] == ref["steps"] == 8 and ep["version"] == 1
    assert ep["n"] == ref["n"] == 300
    # Weights need not be identical: lm-eval reseeds torch's global RNG when it scores but not on a
    # cache hit, so a resumed run can draw other minibatch orders. Scores agree within noise.
    se = (ref["test"] * (1 - ref["test"]) / ref["n"]) ** 0.5
    assert abs(ep["test"] - ref["test"]) <= 3 * max(se, 0.01) * 2**0.5, (ep["test"], ref["test"])
    assert not t.ckpt.parent.exists()
