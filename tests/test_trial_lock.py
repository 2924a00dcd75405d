"""A trial directory is trained by one process at a time, and its student file lands whole."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from opd.io import atomic_save_safetensors, exclusive_dir

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_directory_held_by_another_process_is_refused_until_it_dies(tmp_path):
    d = tmp_path / "trial-3"
    d.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(d / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match="in use by another process"):
            with exclusive_dir(d):
                pass
    finally:
        holder.kill()
        holder.wait()
    with exclusive_dir(d):  # the lock died with its process: no stale lock file to clean up
        with pytest.raises(RuntimeError):  # and is exclusive within one process too (a second open file)
            with exclusive_dir(d):
                pass


def test_student_file_is_replaced_whole_or_not_at_all(tmp_path):
    from safetensors.torch import load_file

    f = tmp_path / "student.safetensors"
    atomic_save_safetensors({"w": torch.ones(2)}, f)
    with pytest.raises(ValueError):  # a failing write (not a tensor) leaves the old file and no temp
        atomic_save_safetensors({"w": "not a tensor"}, f)
    assert torch.equal(load_file(f)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["student.safetensors"]
