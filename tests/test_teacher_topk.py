"""Distillation on the teacher's top-k tokens and a tail bucket: the KL warm start's `warmstart_topk` and
OPD's `teacher_topk` estimator. The loss itself, SGLang's top-k input log-probs (tests/sglang_stub.py
copies the server's format from its source and, given a model, reports that model's log-probs), and
runs whose teachers are on servers matching the same teachers in process."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from opd_kernels import reverse_kl_from_logits
from sglang_stub import Stub, serve
from test_merge_fakes import build_fake_lab

import opd.distill.loop as loop
from opd.distill.config import DistillConfig, load_run
from opd.distill.loop import distill
from opd.distill.offpolicy import TopLogprobs, teacher_logits_cache, teacher_targets
from opd.distill.routing import resolve_routes
from opd.distill.teachers import Teacher, embedded_teacher
from opd.errors import OpdError
from opd.rl.distill_loss import teacher_topk_reverse_kl
from opd.rollout import get_engine

REPO = Path(__file__).resolve().parents[1]


def test_teacher_topk_kl_is_the_full_kl_at_the_whole_vocabulary_and_grows_with_k_up_to_it():
    torch.manual_seed(0)
    V = 13
    zs = torch.randn(7, V, requires_grad=True)
    zt = 2 * torch.randn(7, V)
    lt = torch.log_softmax(zt, -1)
    full = reverse_kl_from_logits(zs, zt)
    (g_full,) = torch.autograd.grad(full.sum(), zs)
    prev = torch.zeros(7)
    for k in range(1, V + 1):
        lp, ids = lt.topk(k, -1)
        kl = teacher_topk_reverse_kl(zs, ids, lp)
        # a coarsening of both distributions: never negative, never above the full KL, and each k + 1
        # refines k's partition (the teacher's top k + 1 hold its top k), so the KL only grows
        assert (kl >= -1e-6).all() and (kl <= full + 1e-5).all() and (kl >= prev - 1e-5).all(), k
        prev = kl.detach()
    torch.testing.assert_close(kl, full, atol=1e-5, rtol=1e-5)
    (g,) = torch.autograd.grad(kl.sum(), zs)
    torch.testing.assert_close(g, g_full, atol=1e-5, rtol=1e-5)
    assert float((full - teacher_topk_reverse_kl(zs, *reversed(lt.topk(3, -1)))).detach().min()) > 1e-3  # k < V loses some


def test_teacher_topk_kl_survives_server_log_probs_that_sum_past_one():
    zs = torch.randn(4, 9, requires_grad=True)
    lp, ids = torch.log_softmax(torch.randn(4, 9), -1).topk(8, -1)
    kl = teacher_topk_reverse_kl(zs, ids, lp - lp.logsumexp(-1, keepdim=True) + 0.01)  # the top 8 hold e^0.01 > 1
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(zs.grad).all() and (kl > 0).all()


def _served(model, tokenizer):
    """A stub SGLang server reporting `model`'s log-probs, and a client of it: (server, client, stub)."""
    stub = Stub(tokenizer("7\n", add_special_tokens=False).input_ids, model.config.vocab_size, model=model)
    srv = serve(stub)
    eng = get_engine("sglang", base_url=f"http://127.0.0.1:{srv.server_address[1]}", tokenizer=tokenizer,
                     model=model, timeout_s=10)
    return srv, eng, stub


def _close(srv):
    srv.shutdown()
    srv.server_close()


def test_a_servers_top_logprobs_are_its_models_own_and_a_malformed_answer_is_one_line(tokenizer, pico_model):
    pico_model.eval()
    srv, eng, stub = _served(pico_model, tokenizer)
    try:
        prompts, completions = [[5, 6, 7], [8], [9, 10]], [[9, 10], [11, 12, 13], []]
        got = eng.top_logprobs(prompts, completions, 5)
        assert got[2] == ([], [])  # an empty completion asks nothing
        body = [b for p, b in stub.requests if p == "/generate"][-1]
        assert body["top_logprobs_num"] == 5 and body["logprob_start_len"] == [2, 0]
        teacher = embedded_teacher("t", "count", copy.deepcopy(pico_model), tokenizer)
        want = teacher_targets(teacher, list(zip(prompts[:2], completions[:2])), tokenizer.pad_token_id, "packed",
                               topk=5)
        ids = torch.tensor([i for c in got[:2] for i in c[0]])
        lps = torch.tensor([v for c in got[:2] for v in c[1]])
        assert ids.shape == (5, 5) and torch.equal(ids, want.ids.long())
        torch.testing.assert_close(lps, want.logprobs, atol=1e-5, rtol=0)
        assert eng.top_logprobs([[5]], [[6]], 10_000)[0][0][0].__len__() == pico_model.config.vocab_size  # capped
        stub.faults.append("short_top")
        with pytest.raises(OpdError, match=r"input_top_logprobs of completion 0, token 0, is not 5 \[logprob"):
            eng.top_logprobs([[5, 6]], [[7, 8]], 5)
    finally:
        _close(srv)


def _two_teachers(model_dir, tokenizer):
    """Two teachers, count and rev (rev's weights jittered): their models, and as in-process teachers."""
    from transformers import AutoModelForCausalLM

    models = {c: AutoModelForCausalLM.from_pretrained(model_dir) for c in ("count", "rev")}
    torch.manual_seed(1)
    for p in models["rev"].parameters():
        p.data += 0.05 * torch.randn_like(p)
    return models, {c: embedded_teacher(c, c, m, tokenizer) for c, m in models.items()}


def _samples():
    rng = random.Random(0)
    return {c: [([rng.randrange(3, 40) for _ in range(rng.randint(2, 6))], [rng.randrange(3, 40) for _ in range(3)])
                for _ in range(12)] for c in ("count", "rev")}


def _warm(cfg, tokenizer, teachers, student_dir, tmp_path, name):
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(student_dir)
    logs = []
    distill(cfg, student, tokenizer, teachers, resolve_routes({"count": "count", "rev": "rev"}),
            tmp_path / f"{name}.pt", log=logs.append)
    return student.state_dict(), logs


def test_a_kl_warm_start_from_server_teachers_trains_as_the_same_teachers_in_process(
        tmp_path, tokenizer, trained_pico_dir, monkeypatch):
    """The same teacher samples (fixed here: an SGLang server samples without a seed) distilled with
    warmstart_topk from two teachers on stub servers give the weights that the same teachers in process
    give, cached or scored at every step; and with K = the vocabulary, the full-vocabulary warm start's."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(loop, "verified_samples", lambda *a, **k: _samples())
    models, local = _two_teachers(trained_pico_dir, tokenizer)
    servers = {c: _served(m, tokenizer) for c, m in models.items()}
    remote = {c: Teacher(c, c, eng) for c, (_, eng, _) in servers.items()}
    V = models["count"].config.vocab_size
    cfg = DistillConfig(steps=0, warmstart_steps=6, warmstart_batch=8, warmstart_loss="kl", warmstart_topk=4,
                        verifier="none", layout="packed")
    try:
        here, logs = _warm(cfg, tokenizer, local, trained_pico_dir, tmp_path, "local")
        there, logs_there = _warm(cfg, tokenizer, remote, trained_pico_dir, tmp_path, "server")
        per_step, logs_step = _warm(cfg.model_copy(update={"warmstart_cache_mib": 0}), tokenizer, remote,
                                    trained_pico_dir, tmp_path, "per_step")
        asked = [b for _, _, stub in servers.values() for p, b in stub.requests if p == "/generate"]
    finally:
        for srv, _, _ in servers.values():
            _close(srv)
    assert any("top-4 log-probs" in m and "scored their" in m for m in logs_there)
    assert any("each step runs its teachers" in m for m in logs_step)
    assert asked and all(b["top_logprobs_num"] == 4 for b in asked)
    start = AutoModelForCausalLM.from_pretrained(trained_pico_dir).state_dict()
    for k, v in here.items():
        torch.testing.assert_close(there[k], v, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(per_step[k], v, atol=2e-5, rtol=1e-4)
    assert max(float((here[k] - start[k]).abs().max()) for k in here) > 1e-3  # it trained
    full, _ = _warm(cfg.model_copy(update={"warmstart_topk": None}), tokenizer, local, trained_pico_dir, tmp_path, "f")
    every, _ = _warm(cfg.model_copy(update={"warmstart_topk": V}), tokenizer, local, trained_pico_dir, tmp_path, "v")
    for k, v in full.items():
        torch.testing.assert_close(every[k], v, atol=2e-5, rtol=1e-4)
    assert max(float((full[k] - here[k]).abs().max()) for k in here) > 1e-5  # K = 4 of V is another target


def test_the_cache_holds_k_log_probs_a_token(tokenizer, pico_model):
    teacher = embedded_teacher("count", "count", pico_model, tokenizer)
    samples = {"count": _samples()["count"] * 2}  # every pair twice: scored once
    cache = teacher_logits_cache(samples, {"count": teacher}, tokenizer.pad_token_id, "packed", topk=3)
    top, offsets, which = cache["count"]
    assert isinstance(top, TopLogprobs) and top.ids.shape == top.logprobs.shape == (36, 3)
    assert top.ids.dtype == torch.int32 and offsets[-1] == 36 and which[:12] == which[12:]
    assert (top.logprobs[:, :-1] >= top.logprobs[:, 1:]).all()  # most likely first


def test_warmstart_topk_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="warmstart_topk is the support of warmstart_loss kl's target"):
        DistillConfig(steps=0, warmstart_steps=5, warmstart_topk=4)
    with pytest.raises(ValueError, match="leave warmstart_target_temperature at 1.0, or remove warmstart_topk"):
        DistillConfig(steps=0, warmstart_steps=5, warmstart_loss="kl", warmstart_topk=4,
                      warmstart_target_temperature=0.5)
    lab = build_fake_lab(tmp_path / "lab", ("count",))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"teachers": [str(lab["experts"]["count"])], "base": str(lab["base"]),
                                    "teacher_servers": {"count": "http://127.0.0.1:1"},
                                    "distill": {"steps": 0, "warmstart_steps": 5, "warmstart_loss": "kl",
                                                "verifier": "none"}}))
    with pytest.raises(OpdError, match="set distill.warmstart_topk: K"):
        load_run(path)
    assert load_run(path, ["distill.warmstart_topk=8"]).distill.warmstart_topk == 8
    out = subprocess.run([sys.executable, "-m", "opd.distill", str(path)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and "warmstart_topk" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_server_teacher_without_top_k_is_refused_before_sampling(tokenizer):
    class ScoresOnly:
        def score(self, p, c):
            return [[0.0] * len(x) for x in c]

    from opd.distill.offpolicy import require_models

    teachers = {"count": Teacher("count", "count", ScoresOnly())}
    with pytest.raises(OpdError, match="the teacher of count has none .*: use warmstart_loss: nll"):
        require_models(teachers, ["count"], 4)
    with pytest.raises(OpdError, match="set warmstart_topk: K"):
        require_models(teachers, ["count"])


def test_the_distill_cli_runs_a_kl_warm_start_from_a_teacher_on_a_server(tmp_path, tokenizer):
    """As a user runs it: `python -m opd.distill run.yaml` with the teacher in teacher_servers (a stub
    server reporting the expert's own log-probs) and warmstart_topk: the teacher samples and scores on the
    server, its weights are never loaded here, and the student trains."""
    import os

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lab = build_fake_lab(tmp_path / "lab", ("count",))
    srv, _, stub = _served(AutoModelForCausalLM.from_pretrained(lab["experts"]["count"]).eval(), tokenizer)
    run = {"name": "r", "base": str(lab["base"]), "teachers": [str(lab["experts"]["count"])],
           "teacher_servers": {"count": f"http://127.0.0.1:{srv.server_address[1]}"}, "out": str(tmp_path / "out"),
           "distill": {"steps": 0, "warmstart_steps": 4, "warmstart_prompts": 4, "warmstart_batch": 4,
                       "warmstart_loss": "kl", "warmstart_topk": 4, "verifier": "none"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    env = {**os.environ, "OPD_CACHE": str(tmp_path / "cache")}
    try:
        r = subprocess.run([sys.executable, "-m", "opd.distill", str(path), "--no-eval"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        _close(srv)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "top-4 log-probs" in r.stderr + r.stdout
    bodies = [b for p, b in stub.requests if p == "/generate"]
    assert any("top_logprobs_num" not in b for b in bodies)  # it sampled there
    assert any(b.get("top_logprobs_num") == 4 for b in bodies)  # and scored there
    start, out = load_file(Path(lab["base"]) / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert max(float((out[k] - start[k]).abs().max()) for k in start) > 1e-4


def test_a_killed_topk_warm_start_resumes_to_the_same_weights(tmp_path, tokenizer, trained_pico_dir, monkeypatch):
    """Killed midway (the 5th step's loss raises), the same run resumes from its checkpoint: the top-k
    cache is rebuilt from the checkpointed samples, and the weights are those of an unbroken run."""
    from test_distill_fast import _dies_at_call
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(loop, "verified_samples", lambda *a, **k: _samples())
    teachers = {c: embedded_teacher(c, c, AutoModelForCausalLM.from_pretrained(trained_pico_dir), tokenizer)
                for c in ("count", "rev")}
    cfg = DistillConfig(steps=0, warmstart_steps=8, warmstart_batch=8, warmstart_loss="kl", warmstart_topk=4,
                        verifier="none", layout="packed", checkpoint_every=1)  # a checkpoint every 5 warm steps
    whole, _ = _warm(cfg, tokenizer, teachers, trained_pico_dir, tmp_path, "whole")
    real = loop.kd_sequence_losses
    monkeypatch.setattr(loop, "kd_sequence_losses", _dies_at_call(7, real))
    with pytest.raises(KeyboardInterrupt):
        _warm(cfg, tokenizer, teachers, trained_pico_dir, tmp_path, "killed")
    monkeypatch.setattr(loop, "kd_sequence_losses", real)
    resumed, logs = _warm(cfg, tokenizer, teachers, trained_pico_dir, tmp_path, "killed")
    assert any("resum" in m for m in logs), logs
    for k, v in whole.items():
        torch.testing.assert_close(resumed[k], v, atol=0, rtol=0)


def _opd(cfg, tokenizer, teachers, student_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_pretrained(student_dir)
    state = distill(cfg, student, tokenizer, teachers, resolve_routes({"count": "count", "rev": "rev"}),
                    log=lambda *_: None)
    return state, student.state_dict()


def test_teacher_topk_opd_equals_the_full_estimator_at_the_whole_vocabulary_and_runs_on_servers(
        tokenizer, trained_pico_dir):
    """estimator teacher_topk: with K = V it is the full estimator (same losses, same weights); with K < V
    it is another target; and with the teachers on stub SGLang servers it trains the in-process weights
    (the student samples in process, seeded: the same rollouts)."""

    models, local = _two_teachers(trained_pico_dir, tokenizer)
    V = models["count"].config.vocab_size
    cfg = DistillConfig(estimator="teacher_topk", topk=V, steps=3, prompts_per_step=4, group_size=2, lr=3e-3,
                        verifier="none", layout="packed")
    full, w_full = _opd(cfg.model_copy(update={"estimator": "full"}), tokenizer, local, trained_pico_dir)
    every, w_every = _opd(cfg, tokenizer, local, trained_pico_dir)
    for a, b in zip(full.history, every.history, strict=True):
        for k in ("loss", "kl/count", "kl/rev"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])
    for k, v in w_full.items():
        torch.testing.assert_close(w_every[k], v, atol=1e-4, rtol=1e-4)
    top4 = cfg.model_copy(update={"topk": 4})
    four, w_four = _opd(top4, tokenizer, local, trained_pico_dir)
    assert four.history[0]["loss"] < every.history[0]["loss"] - 1e-6  # a coarser KL, from the same start
    servers = {c: _served(m, tokenizer) for c, m in models.items()}
    try:
        remote = {c: Teacher(c, c, eng) for c, (_, eng, _) in servers.items()}
        there, w_there = _opd(top4, tokenizer, remote, trained_pico_dir)
        asked = [b for _, _, stub in servers.values() for p, b in stub.requests if p == "/generate"]
    finally:
        for srv, _, _ in servers.values():
            _close(srv)
    assert any(b.get("top_logprobs_num") == 4 for b in asked)
    for a, b in zip(four.history, there.history, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    for k, v in w_four.items():
        torch.testing.assert_close(w_there[k], v, atol=1e-4, rtol=1e-4)


def test_teacher_topk_refuses_a_capability_routed_to_two_teachers(tokenizer, pico_model):
    from opd.distill.routing import resolve_routes as routes_of

    a, b = (embedded_teacher(n, "count", copy.deepcopy(pico_model), tokenizer) for n in ("a", "b"))
    cfg = DistillConfig(estimator="teacher_topk", topk=4, steps=1, prompts_per_step=2, group_size=2)
    with pytest.raises(OpdError, match="estimator teacher_topk: count route to several teachers"):
        distill(cfg, copy.deepcopy(pico_model), tokenizer, {"a": a, "b": b}, routes_of({"a": "count", "b": "count"}),
                log=lambda *_: None)
    with pytest.raises(ValueError, match="estimator 'teacher_topk' needs topk: K"):
        DistillConfig(estimator="teacher_topk")


def test_teacher_servers_take_the_teacher_topk_estimator(tmp_path):
    lab = build_fake_lab(tmp_path / "lab", ("count",))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"teachers": [str(lab["experts"]["count"])],
                                    "teacher_servers": {"count": "http://127.0.0.1:1"}}))
    assert load_run(path, ["distill.estimator=teacher_topk", "distill.topk=8"]).distill.estimator == "teacher_topk"
    with pytest.raises(OpdError, match="use estimator 'sampled' or 'teacher_topk'"):
        load_run(path, ["distill.estimator=full"])
