"""opd.rl.checkpoint, the one checkpoint both loops use: identity and ranks fields, the newest step,
checkpoints written before ranks were recorded, and a run without a checkpoint path."""

from __future__ import annotations

import random

import torch

from opd.rl.checkpoint import PLAIN, Checkpointer, Ranks


def _ck(path, identity="a", ranks=Ranks(), legacy=None, resumes=None):
    return Checkpointer(path, ranks, identity, "config", resumes=resumes, legacy_ranks=legacy, log=lambda *_: None)


def test_newest_step_of_the_same_identity_and_ranks_restores_model_and_rngs(tmp_path, pico_model):
    path = tmp_path / "state.pt"
    opt = torch.optim.AdamW(pico_model.parameters())
    rng = random.Random(7)
    torch.manual_seed(3)
    for step in (1, 2):
        _ck(path).save(pico_model, opt, {"step": step}, rng)
    want_torch = torch.get_rng_state()
    torch.manual_seed(99)
    other = random.Random(0)
    state, optim = _ck(path).restore(pico_model, other)
    assert state == {"step": 2} and other.getstate() == rng.getstate() and optim.keys() == opt.state_dict().keys()
    assert torch.equal(torch.get_rng_state(), want_torch)
    assert _ck(path, identity="b").latest() is None  # another run's
    assert _ck(path, resumes=lambda recorded: recorded in ("a", "b"), identity="b").latest()["state"]["step"] == 2
    assert _ck(path, ranks=Ranks(0, 1, True)).latest() is None  # a plain run's, not a DeepSpeed one's


def test_a_checkpoint_without_ranks_is_read_as_its_legacy_ranks(tmp_path, pico_model):
    path = tmp_path / "state.pt"
    _ck(path).save(pico_model, torch.optim.AdamW(pico_model.parameters()), {"step": 4}, random.Random(0))
    old = torch.load(path, weights_only=True)
    del old["ranks"]  # as written before ranks were recorded
    torch.save(old, path)
    assert _ck(path, legacy=PLAIN).latest()["state"]["step"] == 4
    assert _ck(path, ranks=Ranks(0, 1, True), legacy=PLAIN).latest() is None  # OPD: those were plain runs
    assert _ck(path, ranks=Ranks(0, 1, True)).latest()["state"]["step"] == 4  # GSPO: any


def test_no_path_saves_nothing_and_resumes_nothing(tmp_path, pico_model):
    ck = _ck(None)
    ck.save(pico_model, torch.optim.AdamW(pico_model.parameters()), {"step": 1}, random.Random(0))
    assert ck.file is None and ck.restore(pico_model, random.Random(0)) is None and not list(tmp_path.iterdir())


def test_each_rank_writes_its_own_file(tmp_path, pico_model):
    ck = _ck(tmp_path / "state.pt", ranks=Ranks(1, 2, True))
    assert ck.file == tmp_path / "state-rank1.pt"
