"""Torn checkpoints (truncated or empty state.pt) of GSPO, OPD and the base: the run falls back to the
previous checkpoint or starts fresh with a one-line warning; it never stops until someone deletes a file."""

import random

import pytest
import torch

from opd.expert.spec import ExpertSpec
from opd.expert.trainer import RunState, checkpointer
from opd.io import atomic_torch_save, previous_path, torn_path
from opd.io import load_checkpoint as read_checkpoint


def _tear(path, how):
    data = path.read_bytes()
    path.write_bytes(b"" if how == "empty" else data[: len(data) // 2])


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_io_falls_back_to_previous_then_fresh(tmp_path, how):
    path = tmp_path / "state.pt"
    atomic_torch_save({"step": 1}, path, keep_previous=True)
    atomic_torch_save({"step": 2}, path, keep_previous=True)
    assert previous_path(path).exists()
    _tear(path, how)
    warnings = []
    assert read_checkpoint(path, warnings.append) == {"step": 1}
    assert len(warnings) == 1 and "unreadable" in warnings[0] and "\n" not in warnings[0]
    # the torn file is set aside: the next save keeps the good previous version, not the torn one
    assert not path.exists() and torn_path(path).exists() and "state.torn.pt" in warnings[0]
    atomic_torch_save({"step": 3}, path, keep_previous=True)
    assert read_checkpoint(path) == {"step": 3} and torch.load(previous_path(path)) == {"step": 1}
    _tear(path, how)
    _tear(previous_path(path), how)
    warnings.clear()
    assert read_checkpoint(path, warnings.append) is None
    assert len(warnings) == 2 and "starting fresh" in warnings[1]


def test_the_checkpoint_exists_at_every_instant_of_a_save(tmp_path, monkeypatch):
    """A reader polling state.pt (another rank, a test, a user's `ls`) never finds it missing: the
    previous version is a hard link made before the new file replaces the current one."""
    import opd.io

    path = tmp_path / "state.pt"
    atomic_torch_save({"step": 1}, path, keep_previous=True)
    real = opd.io.os.replace
    seen = []

    def replace(src, dst):
        seen.append(path.exists())
        real(src, dst)

    monkeypatch.setattr(opd.io.os, "replace", replace)
    atomic_torch_save({"step": 2}, path, keep_previous=True)
    assert seen and all(seen)
    assert torch.load(path) == {"step": 2} and torch.load(previous_path(path)) == {"step": 1}


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_gspo_resumes_from_previous_checkpoint(tmp_path, pico_model, how):
    run = ExpertSpec(capability="count", steps=3).run_settings()
    opt = torch.optim.AdamW(pico_model.parameters())
    path = tmp_path / "state.pt"
    warnings = []
    ck = checkpointer(path, run, log=warnings.append)
    for step in (10, 20):
        ck.save(pico_model, opt, RunState(step=step).__dict__, random.Random(0))
    _tear(path, how)
    state, _ = ck.restore(pico_model, random.Random(0))
    assert state["step"] == 10 and len(warnings) == 1
    _tear(previous_path(path), how)
    assert ck.restore(pico_model, random.Random(0)) is None  # fresh start


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_opd_resumes_from_previous_checkpoint_then_starts_fresh(tmp_path, pico_model, how):
    """OPD checkpoints as GSPO does (opd.rl.checkpoint): a torn file is set aside with one warning and
    the previous version resumes; both torn, a fresh start."""
    from opd.distill.config import DistillConfig
    from opd.distill.loop import DistillState, checkpointer

    path = tmp_path / "state.pt"
    warnings = []
    ck = checkpointer(path, DistillConfig(), log=warnings.append)
    opt = torch.optim.AdamW(pico_model.parameters())
    for step in (3, 6):
        ck.save(pico_model, opt, DistillState(step=step).__dict__, random.Random(0))
    assert ck.latest()["state"]["step"] == 6
    _tear(path, how)
    assert ck.latest()["state"]["step"] == 3
    assert len(warnings) == 1 and "unreadable" in warnings[0] and "trying the previous one" in warnings[0]
    assert torn_path(path).exists()
    _tear(previous_path(path), how)
    assert ck.latest() is None and "starting fresh" in warnings[-1]


def test_a_checkpoint_of_classes_this_run_does_not_load_is_passed_over_and_kept(tmp_path):
    """A DeepSpeed run's checkpoint read by a plain run: whole, so not set aside as torn."""
    path = tmp_path / "state.pt"
    atomic_torch_save({"step": 1, "odd": random.Random(0)}, path)
    warnings = []
    assert read_checkpoint(path, warnings.append) is None
    assert path.exists() and not torn_path(path).exists() and "passed over" in warnings[0]


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_base_build_reruns_over_a_torn_checkpoint(tmp_path, how):
    from opd.lab.base import BaseSpec, build_base
    from opd.lab.pico import PICO

    spec = BaseSpec(capabilities=["count"], mixture={"count": 1.0}, steps=2, eval_every=1, eval_limit=4,
                    batch_size=4, warmup=0, shape=PICO, threads=1)
    out = tmp_path / "runs" / "base"
    ckpt = out.parent / f".{out.name}.ckpt" / "state.pt"
    ckpt.parent.mkdir(parents=True)
    atomic_torch_save({"not": "a checkpoint"}, ckpt)
    _tear(ckpt, how)
    logs = []
    manifest = build_base(spec, out, log=logs.append)
    assert manifest["kept_step"] in (1, 2) and (out / "config.json").exists()
    assert sum("unreadable" in m for m in logs) == 1


def test_base_build_resumes_with_its_bar_where_it_stopped(tmp_path):
    """Killed after its step-1 checkpoint, the rerun resumes at step 1 and its progress bar hears
    step 1 before it trains step 2 (a resumed bar does not start from 0)."""
    from opd.lab.base import BaseSpec, build_base
    from opd.lab.pico import PICO

    spec = BaseSpec(capabilities=["count"], mixture={"count": 1.0}, steps=2, eval_every=1, eval_limit=4,
                    batch_size=4, warmup=0, shape=PICO, threads=1, report_to="none")
    out = tmp_path / "runs" / "base"

    def kill_at_2(step, total, loss):
        if step == 2:
            raise KeyboardInterrupt  # after step 1's checkpoint, before step 2's

    with pytest.raises(KeyboardInterrupt):
        build_base(spec, out, progress=kill_at_2, log=lambda *_: None)
    seen, logs = [], []
    build_base(spec, out, progress=lambda s, n, loss: seen.append(s), log=logs.append)
    assert "resuming base build at step 1" in logs and seen == [1, 2]
