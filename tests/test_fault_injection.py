"""SIGKILL expert training, the merge search and OPD: every rerun resumes and the result stays whole.

A fast subset of bench/fault_injection.py (which kills the three jobs 20+ times at random moments),
with its jobs, checks and comparisons: per job, kills a moment after the run saved progress beyond
what it started from (a checkpoint, a finished trial, an OPD trial's checkpoint), so every rerun
has something to resume. To save interpreter start-ups, the reference and the last rerun run in
this process (the command's code, without its start-up); the killed runs are the command.
"""

import importlib.util
import random
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fault_injection", ROOT / "bench" / "fault_injection.py")
fi = importlib.util.module_from_spec(_spec)
sys.modules["fault_injection"] = fi  # dataclasses look their module up while the class is made
_spec.loader.exec_module(fi)


# size: steps (train, opd), enough for the kills to land before the end even on a fast machine; trials (search).
# tear: each kill's checkpoints are then truncated (GSPO falls back to its previous one or starts fresh).
@pytest.mark.parametrize("kind,size,kills,tear", [("train", 16, 3, False), ("opd", 12, 2, False),
                                                  ("search", 3, 2, False), ("train", 16, 3, True)],
                         ids=["train", "opd", "search", "train-torn"])
def test_sigkills_after_progress_resume_to_the_uninterrupted_result(trained_pico_dir, tmp_path, kind, size, kills,
                                                                    tear):
    lab = fi.build_lab(tmp_path / "lab", trained_pico_dir)
    ref_job = fi.make_job(kind, tmp_path / "ref", lab, size, opd_steps=4)  # the search's OPD trials: 4 steps
    ref_job.run_here()
    assert not fi.check_tree(ref_job.work)
    ref = ref_job.summary()

    job = fi.make_job(kind, tmp_path / "killed", lab, size, opd_steps=4)
    shutil.copytree(ref_job.work / "cache", job.work / "cache")  # scores the reference computed: a faster CI
    ep = fi.kill_episode(job, random.Random(0), (0.0, 0.1), max_kills=kills, log=lambda *_: None,
                         after_progress=True, finish_here=True, tear=tear)

    assert ep["kills"] == kills, ep  # the pico runs outlast their kills
    assert not ep["problems"], ep["problems"]
    assert not ep["leftovers"], ep["leftovers"]
    assert len(ep["resumed"]) == kills, ep["resumed"]  # every rerun said where it started, or kept the trials
    assert (ep["torn"] >= kills) if tear else not ep["torn"]  # a checkpoint after each kill (after_progress)
    assert not job.compare(ep["summary"], ref)
    if kind == "search":
        assert ep["progress"][0] != ({}, {}, False), ep["progress"]  # a finished trial or an OPD checkpoint
        assert ep["summary"]["trials"] == ref["trials"] == size
    else:
        assert ep["progress"][0][0] >= 1, ep["progress"]  # killed after its first checkpoint
        assert ep["summary"]["hash"] == ref["hash"] and ep["summary"]["steps"] == size
        assert not job.ckpt.parent.exists()


SLOW_SAVE = """
import sys, time
from opd.io import atomic_torch_save

class Slow:  # pickling it blocks: the save is under way, its temp file open
    def __reduce__(self):
        print("saving", flush=True)
        time.sleep(120)

atomic_torch_save({"x": Slow()}, sys.argv[1])
"""


def test_next_write_sweeps_the_temp_file_of_a_writer_killed_mid_save(tmp_path):
    """A kill between the temp file and its rename leaves `.<name>.tmp-<pid>-*`; the next write of
    the same path removes it (the bench found these in eval caches and checkpoint directories)."""
    import os
    import signal
    import subprocess

    from opd.io import atomic_torch_save

    path = tmp_path / "state.pt"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "saving"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (stale,) = fi.leftovers(tmp_path)
    assert stale.startswith(f".state.pt.tmp-{proc.pid}-") and not path.exists()
    busy = tmp_path / f".state.pt.tmp-{os.getpid()}-busy"  # a live writer's: not touched
    busy.write_bytes(b"")
    atomic_torch_save({"x": 1}, path)
    assert fi.leftovers(tmp_path) == [busy.name]
