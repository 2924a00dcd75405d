"""`sample_ahead`: the next batch sampled and scored in a background thread while the update runs."""

from __future__ import annotations

import pytest

import opd.distill.sampler as sampler
from opd.distill.config import DistillConfig
from opd.distill.loop import distill
from opd.distill.routing import resolve_routes
from opd.distill.teachers import embedded_teacher
from opd.lab.model import build_model
from opd.lab.pico import PICO
from opd.rl.checkpoint import Checkpointer

SAVE = Checkpointer.save  # the real one (each run's spy calls it, not an earlier run's spy)


@pytest.fixture
def teachers(trained_pico_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    return {"count": embedded_teacher("count", "count", teacher, tokenizer)}


def _run(cfg, tokenizer, teachers, ckpt, monkeypatch):
    """The run's history and the prompt RNG state each checkpoint saved, by step."""
    saved = {}

    def spy(self, student, opt, state, rng):
        saved[state["step"]] = rng.getstate()
        SAVE(self, student, opt, state, rng)

    monkeypatch.setattr(Checkpointer, "save", spy)
    student = build_model(PICO, tokenizer, seed=0)
    state = distill(cfg, student, tokenizer, teachers, resolve_routes({"count": "count"}),
                    ckpt, log=lambda *_: None)
    return state, saved


def test_ahead_draws_the_plain_loops_prompts_and_checkpoints_its_rng(tmp_path, tokenizer, teachers, monkeypatch):
    # lr so small that no weight moves: the student one update behind is the same student, so sampling
    # ahead must give exactly the plain loop's batches, and every checkpoint the plain loop's prompt RNG
    # (the state before the batch in flight, not the one the background thread has moved on)
    cfg = DistillConfig(estimator="full", steps=4, lr=1e-12, prompts_per_step=4, group_size=2, layout="packed",
                        checkpoint_every=1, seed=3)
    plain, plain_rng = _run(cfg, tokenizer, teachers, tmp_path / "plain.pt", monkeypatch)
    ahead, ahead_rng = _run(cfg.model_copy(update={"sample_ahead": True}), tokenizer, teachers, tmp_path / "ahead.pt",
                            monkeypatch)
    assert sorted(ahead_rng) == sorted(plain_rng) == [1, 2, 3, 4]
    assert ahead_rng == plain_rng
    for p, a in zip(plain.history, ahead.history, strict=True):
        assert a["gen_tokens"] == p["gen_tokens"] and a["reward/count"] == p["reward/count"]
        assert a["kl/count"] == pytest.approx(p["kl/count"], rel=1e-5)
        assert a["time/score"] == 0.0 and a["time/sample"] >= 0.0  # the wait for the batch in flight


def test_ahead_lowers_kl_and_resumes(tmp_path, tokenizer, teachers, monkeypatch):
    cfg = DistillConfig(estimator="full", steps=6, lr=3e-3, prompts_per_step=8, group_size=2, layout="packed",
                        checkpoint_every=2, sample_ahead=True)
    ckpt = tmp_path / "run.pt"
    state, _ = _run(cfg, tokenizer, teachers, ckpt, monkeypatch)
    kls = [r["kl/count"] for r in state.history]
    assert kls[-1] < kls[0], kls
    # a longer run with the same settings continues from the last checkpoint
    longer, saved = _run(cfg.model_copy(update={"steps": 8}), tokenizer, teachers, ckpt, monkeypatch)
    assert [r["step"] for r in longer.history] == list(range(1, 9)) and sorted(saved) == [8]
    # the mode is part of the run's identity: the plain loop does not take over its checkpoint, it starts over
    _, saved = _run(cfg.model_copy(update={"steps": 10, "sample_ahead": False}), tokenizer, teachers, ckpt, monkeypatch)
    assert sorted(saved) == [2, 4, 6, 8, 10]


def test_process_worker_gives_the_threads_run_exactly(tmp_path, tokenizer, teachers, monkeypatch):
    # a real lr, so every batch depends on the weights pushed to the worker after each update: a forked
    # worker that missed one (or sampled stale weights) would diverge from the thread
    cfg = DistillConfig(estimator="full", steps=5, lr=3e-3, prompts_per_step=6, group_size=2, layout="packed",
                        checkpoint_every=1, sample_ahead=True, inference_dtype="bfloat16", seed=1)
    thread, thread_rng = _run(cfg, tokenizer, teachers, tmp_path / "t.pt", monkeypatch)
    proc, proc_rng = _run(cfg.model_copy(update={"sample_worker": "process"}), tokenizer, teachers,
                          tmp_path / "p.pt", monkeypatch)
    assert proc_rng == thread_rng and sorted(proc_rng) == [1, 2, 3, 4, 5]
    for t, p in zip(thread.history, proc.history, strict=True):
        assert p["gen_tokens"] == t["gen_tokens"] and p["reward/count"] == t["reward/count"]
        assert p["kl/count"] == t["kl/count"] and p["loss"] == t["loss"]
    assert thread.history[-1]["kl/count"] != thread.history[0]["kl/count"]  # the student did move
    import multiprocessing

    assert not multiprocessing.active_children()  # the worker ended with the run


def test_the_worker_lays_out_the_updates_minibatches_and_that_changes_nothing(tmp_path, tokenizer, teachers,
                                                                             monkeypatch):
    from opd.distill.batch import OpdBatch

    cfg = DistillConfig(estimator="full", steps=4, lr=3e-3, prompts_per_step=6, group_size=2, layout="packed",
                        updates_per_batch=3, sample_ahead=True, seed=1)
    token_rows, found = OpdBatch.token_rows, []

    def spy(self, rows):  # the update's calls: the batch's layouts are there (the worker's own: not yet)
        if self.laid is not None:
            found.append(tuple(rows.tolist()) in self.laid)
        return token_rows(self, rows)

    monkeypatch.setattr(OpdBatch, "token_rows", spy)
    ahead, _ = _run(cfg, tokenizer, teachers, tmp_path / "a.pt", monkeypatch)
    assert found == [True] * 12  # every minibatch of the 4 steps came laid out from the worker
    monkeypatch.setattr(OpdBatch, "lay_out_ahead", lambda *_: None)
    own, _ = _run(cfg, tokenizer, teachers, tmp_path / "o.pt", monkeypatch)
    assert len(found) == 12
    for a, o in zip(ahead.history, own.history, strict=True):
        assert a["loss"] == o["loss"] and a["kl/count"] == o["kl/count"]


def test_process_worker_resumes_a_thread_runs_checkpoint(tmp_path, tokenizer, teachers, monkeypatch):
    # the worker is not part of a run's identity (both sample the same batches): a run checkpointed
    # with a thread continues under a process
    cfg = DistillConfig(estimator="full", steps=4, lr=3e-3, prompts_per_step=4, group_size=2, layout="packed",
                        checkpoint_every=2, sample_ahead=True)
    ckpt = tmp_path / "run.pt"
    _run(cfg, tokenizer, teachers, ckpt, monkeypatch)
    longer, saved = _run(cfg.model_copy(update={"steps": 6, "sample_worker": "process"}), tokenizer, teachers, ckpt,
                         monkeypatch)
    assert [r["step"] for r in longer.history] == list(range(1, 7)) and sorted(saved) == [6]


def test_process_worker_failure_names_the_worker_and_its_error(tmp_path, tokenizer, teachers, monkeypatch):
    def broken(*a, **k):
        raise KeyError("no such teacher row")

    monkeypatch.setattr(sampler, "build_batch", broken)  # the forked child inherits the patch
    cfg = DistillConfig(estimator="full", steps=3, prompts_per_step=2, group_size=2, layout="packed",
                        sample_ahead=True, sample_worker="process")
    with pytest.raises(RuntimeError, match=r"sample-ahead worker process failed:(.|\n)*no such teacher row"):
        _run(cfg, tokenizer, teachers, None, monkeypatch)
    import multiprocessing

    assert not multiprocessing.active_children()


def test_ahead_first_batch_samples_the_student_as_it_is_when_drawn(tokenizer, teachers):
    # the warm start trains the student after the sampler's copy is made: the first batch in flight must
    # be sampled from the student as it is when the loop asks for it, exactly as the synchronous sampler does
    import random

    import torch

    routes = resolve_routes({"count": "count"})
    cfg = DistillConfig(estimator="full", steps=3, prompts_per_step=4, group_size=2, seed=5)
    drawn = {}
    for ahead in (False, True):
        student = build_model(PICO, tokenizer, seed=0)
        with sampler.Sampler(cfg.model_copy(update={"sample_ahead": ahead}), student, tokenizer, teachers,
                             routes) as s:
            with torch.no_grad():  # what a warm start does: the student moves after the copy is made
                for p in student.parameters():
                    p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
            drawn[ahead] = s.next(0, {"count": 1.0}, random.Random(1)).batch
    assert torch.equal(drawn[True].targets, drawn[False].targets)
    assert torch.allclose(drawn[True].teacher_lp, drawn[False].teacher_lp)
