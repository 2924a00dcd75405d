"""The stacked teacher forward, the dense full-vocabulary targets and the off-policy warm start."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from opd.distill.batch import build_batch, teacher_outputs
from opd.distill.config import DistillConfig
from opd.distill.loop import distill
from opd.distill.offpolicy import pack_samples, unpack_samples, verified_samples
from opd.distill.routing import resolve_routes
from opd.distill.teacher_bank import TeacherBank, check_same_architecture
from opd.distill.teachers import completion_hidden, embedded_teacher, lm_head_weight
from opd.errors import OpdError
from opd.lab.model import ModelShape, build_model
from opd.lab.pico import PICO
from opd.rl.batch import completion_targets, pad_sequences
from opd.rl.estimators import EstimatorSettings, Minibatch, get_estimator
from opd.rollout import Rollout


def per_token_kl(name: str, h, W, batch, teachers, chunk: int = 1024, topk: int | None = None):
    """Estimator `name`'s per-token KL over every row of `batch` (h: (N, H), all its real tokens) and its
    per-teacher means: the stacked target when the batch has one, else each teacher's hidden states."""
    rows = torch.arange(len(batch.cmask))
    mb = Minibatch(rows, batch.cmask, h, W, None, None, torch.arange(h.shape[0]), torch.ones(len(rows)), None)
    est = get_estimator(name, EstimatorSettings(chunk=chunk, topk=topk))
    return est.per_token(mb, teacher_outputs(batch, teachers, logits=True))


def _teachers(model, tok, n=3, scale=0.05):
    torch.manual_seed(1)
    out = {}
    for i, cap in enumerate(["count", "rev", "sort"][:n]):
        m = copy.deepcopy(model)
        for p in m.parameters():
            p.data += scale * torch.randn_like(p)
        out[f"t{i}"] = embedded_teacher(f"t{i}", cap, m, tok)
    return out


def test_stacked_forward_matches_each_teacher_alone(pico_model, tokenizer):
    teachers = _teachers(pico_model, tokenizer)
    names = sorted(teachers)
    P = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5, 5]]
    C = [[14, 15], [16], [17, 18, 19], [20]]
    ids, attn, cmask, plen = pad_sequences(P, C, tokenizer.pad_token_id)
    T = cmask.shape[1]
    targets = completion_targets(ids, plen, T)
    # rows 0 and 2 each have one teacher; row 1 mixes t0 and t1 half and half; row 3 is t2's
    w = torch.tensor([[1.0, 0.5, 0, 0], [0, 0.5, 1.0, 0], [0, 0, 0, 1.0]])
    target, log_z, tlp = TeacherBank(teachers, names).score(ids, attn, plen, targets, w)
    ref = torch.stack([torch.log_softmax(completion_hidden(teachers[n].model, ids, attn, plen, T)
                                         @ lm_head_weight(teachers[n].model).T, -1) for n in names])  # (K, B, T, V)
    geo = (w[:, :, None, None] * ref).sum(0)
    real = cmask.bool()
    torch.testing.assert_close(target[real], (geo - torch.logsumexp(geo, -1, keepdim=True))[real], atol=1e-5, rtol=0)
    # one teacher: nothing to normalise; two: log_z < 0 (Hoelder), so sum_k w_k KL_k = KL(s||target) - log_z >= it
    assert float(log_z[0].abs().max()) < 1e-5 and bool((log_z[1, :1] < 0).all())
    for k, n in enumerate(names):
        scored = teachers[n].engine.score(P, C)
        for b in range(4):
            if w[k, b] > 0:
                torch.testing.assert_close(tlp[k, b, : len(C[b])], torch.tensor(scored[b]), atol=1e-5, rtol=0)


def test_dense_and_loop_kl_agree_on_a_mixed_batch(pico_model, tokenizer):
    """The stacked path's per-token loss equals sum_k w_k KL(pi_s || pi_k) from the per-teacher path."""
    teachers = _teachers(pico_model, tokenizer)
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    routes["count"] = {"t0": 0.5, "t1": 0.5}
    items = [type("I", (), {"capability": c, "answer": "x"}) for c in ["count", "rev", "sort"]]
    groups = [[Rollout("p", [5, 6, 7], [14, 15], "ab", [0.0, 0.0])], [Rollout("p", [8, 9], [16], "a", [0.0])],
              [Rollout("p", [10, 11], [17, 18, 19], "abc", [0.0] * 3)]]
    student = pico_model
    loop = build_batch(student, items, groups, teachers, routes, tokenizer.pad_token_id)
    dense = build_batch(student, items, groups, teachers, routes, tokenizer.pad_token_id,
                        bank=TeacherBank(teachers, sorted(teachers)))
    assert loop.target is None and dense.target is not None
    torch.testing.assert_close(loop.teacher_lp, dense.teacher_lp, atol=1e-5, rtol=0)
    real = loop.cmask.bool()
    h = completion_hidden(student, loop.ids, loop.attn, loop.plen, loop.cmask.shape[1])[real]
    W = lm_head_weight(student)
    kl_loop, _ = per_token_kl("full", h, W, loop, teachers)
    kl_dense, st = per_token_kl("full", h, W, dense, teachers)
    torch.testing.assert_close(kl_dense, kl_loop, atol=1e-5, rtol=1e-4)
    assert set(st) == {"kl/t0", "kl/t1", "kl/t2"}


def test_full_estimator_update_is_the_same_without_the_old_policy_forward(pico_model, tokenizer):
    """The full estimator without a reward term never reads old_lp, so build_batch skips that student
    forward: the update (loss, KLs, resulting weights) is identical either way."""
    from opd.distill.loop import StudentHidden, opd_step

    teachers = _teachers(pico_model, tokenizer)
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    items = [type("I", (), {"capability": c, "answer": "x"}) for c in ["count", "rev"]]
    groups = [[Rollout("p", [5, 6, 7], [14, 15], "ab", [0.0, 0.0])], [Rollout("p", [8, 9], [16], "a", [0.0])]]
    cfg = DistillConfig(estimator="full", updates_per_batch=1)
    out = {}
    for keep in (True, False):
        student = copy.deepcopy(pico_model)
        bank = TeacherBank(teachers, sorted(teachers))
        batch = build_batch(student, items, groups, teachers, routes, tokenizer.pad_token_id, bank=bank, old_lp=keep)
        assert (batch.old_lp is None) != keep
        opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
        torch.manual_seed(0)
        out[keep] = (opd_step(StudentHidden(student), opt, batch, cfg, teachers), student.state_dict())
    assert out[True][0] == out[False][0]
    for k, v in out[True][1].items():
        torch.testing.assert_close(out[False][1][k], v, atol=0, rtol=0)


def test_teachers_of_another_architecture_are_refused(pico_model, tokenizer):
    teachers = _teachers(pico_model, tokenizer, n=1)
    wider = build_model(ModelShape(**{**PICO.model_dump(), "intermediate_size": 96}), tokenizer, seed=0)
    teachers["wide"] = embedded_teacher("wide", "rev", wider, tokenizer)
    with pytest.raises(OpdError, match="teacher 'wide'.*shape"):
        check_same_architecture(teachers)


def test_verified_samples_keep_only_what_the_verifier_accepts(trained_pico_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from opd.capabilities import get_capability

    teacher = embedded_teacher("count", "count", AutoModelForCausalLM.from_pretrained(trained_pico_dir), tokenizer)
    routes = resolve_routes({"count": "count"})
    out = verified_samples({"count": teacher}, routes, random.Random(0), prompts=32, group=4, temperature=1.0, seed=0)
    assert 0 < len(out["count"]) <= 128
    cap = get_capability("count")
    for p, c in out["count"]:
        prompt = tokenizer.decode(p)
        answer = cap.solve(prompt) if hasattr(cap, "solve") else None
        text = tokenizer.decode(c)
        if answer is not None:
            assert cap.verify(text, answer) == 1.0
    assert len(set(map(lambda pc: (tuple(pc[0]), tuple(pc[1])), out["count"]))) == len(out["count"])


def test_warm_start_then_opd_lowers_kl_and_resumes(tmp_path, trained_pico_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    routes = resolve_routes({"count": "count"})
    cfg = DistillConfig(estimator="full", steps=3, prompts_per_step=4, group_size=1, warmstart_steps=20,
                        warmstart_prompts=32, warmstart_lr=3e-3, warmstart_batch=16, checkpoint_every=2)
    evals = []
    scores = iter([0.2, 0.5, 0.4])

    def evaluate(m):
        evals.append(1)
        return {"count": next(scores)}

    student = build_model(PICO, tokenizer, seed=0)
    state = distill(cfg, student, tokenizer, teachers, routes, tmp_path / "state.pt", evaluate_fn=evaluate,
                    references={"count": 0.5}, log=lambda *_: None)
    warm = state.history[0]
    assert warm["phase"] == "warmstart" and warm["warm_tokens"] > 0 and state.warm_step == 20
    assert state.best_step == 0 or state.best_min_retention == pytest.approx(1.0)
    assert [r["step"] for r in state.history] == [0, 1, 2, 3]
    # extended by 1 step: the progress bars hear where the resumed run stands before it takes a step
    seen = []
    distill(cfg.model_copy(update={"steps": 4}), build_model(PICO, tokenizer, seed=0), tokenizer, teachers,
            routes, tmp_path / "state.pt", log=lambda *_: None,
            progress=lambda st, rec: seen.append((st.warm_step, st.step, rec is None)))
    assert seen == [(20, 3, True), (20, 4, False)]
    # off-policy alone: steps 0
    alone = build_model(PICO, tokenizer, seed=0)
    before = {k: v.clone() for k, v in alone.state_dict().items()}
    st2 = distill(cfg.model_copy(update={"steps": 0}), alone, tokenizer, teachers, routes, log=lambda *_: None)
    assert st2.step == 0 and st2.warm_step == 20
    assert any(not torch.equal(before[k], v) for k, v in alone.state_dict().items())


def test_steps_and_warmstart_both_zero_is_refused():
    with pytest.raises(ValueError, match="nothing to train"):
        DistillConfig(steps=0)


def _dies_at_call(n: int, real):
    """`real`, but its n-th call raises KeyboardInterrupt (a kill in the middle of a warm start)."""
    calls = []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a, **k)

    return wrapped


def test_warm_start_killed_midway_resumes_to_the_same_weights(tmp_path, trained_pico_dir, tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    import opd.distill.loop as loop

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    routes = resolve_routes({"count": "count"})
    cfg = DistillConfig(estimator="full", steps=2, prompts_per_step=4, group_size=1, warmstart_steps=20,
                        warmstart_prompts=16, warmstart_batch=8, checkpoint_every=2)  # warm checkpoints every 10
    whole = build_model(PICO, tokenizer, seed=0)
    distill(cfg, whole, tokenizer, teachers, routes, tmp_path / "a.pt", log=lambda *_: None)

    real = loop.sft_loss
    monkeypatch.setattr(loop, "sft_loss", _dies_at_call(15, real))
    killed = build_model(PICO, tokenizer, seed=0)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, killed, tokenizer, teachers, routes, tmp_path / "b.pt", log=lambda *_: None)
    monkeypatch.setattr(loop, "sft_loss", real)
    logs = []
    resumed = build_model(PICO, tokenizer, seed=0)
    distill(cfg, resumed, tokenizer, teachers, routes, tmp_path / "b.pt", log=logs.append)
    assert "resuming distillation at step 0" in logs and not any("verified teacher samples" in m for m in logs)
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, atol=0, rtol=0)


def test_a_run_killed_in_the_warm_starts_closing_check_resumes_into_it(tmp_path, trained_pico_dir, tokenizer):
    """Killed after the warm start's last checkpoint, in its retention check: the rerun does the check
    (the history's step-0 record) and the rest, to the weights of a run never killed (it used to skip
    the check and carry the warm start's Adam moments into OPD)."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    routes = resolve_routes({"count": "count"})
    cfg = DistillConfig(estimator="full", steps=2, prompts_per_step=4, group_size=1, warmstart_steps=20,
                        warmstart_prompts=16, warmstart_batch=8, checkpoint_every=2)  # warm checkpoints every 10

    def evaluate(model):
        return {"count": 0.5}

    def dies(model):
        raise KeyboardInterrupt

    whole = build_model(PICO, tokenizer, seed=0)
    want = distill(cfg, whole, tokenizer, teachers, routes, tmp_path / "a.pt", log=lambda *_: None,
                   evaluate_fn=evaluate, references={"count": 1.0})
    killed = build_model(PICO, tokenizer, seed=0)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, killed, tokenizer, teachers, routes, tmp_path / "b.pt", log=lambda *_: None,
                evaluate_fn=dies, references={"count": 1.0})
    assert torch.load(tmp_path / "b.pt", weights_only=True)["state"]["warm_step"] == 20
    resumed = build_model(PICO, tokenizer, seed=0)
    got = distill(cfg, resumed, tokenizer, teachers, routes, tmp_path / "b.pt", log=lambda *_: None,
                  evaluate_fn=evaluate, references={"count": 1.0})
    assert [h["step"] for h in got.history] == [h["step"] for h in want.history] and got.history[0]["phase"] == "warmstart"
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, atol=0, rtol=0)


def test_warm_start_checkpoints_hold_the_samples_as_tensors_until_it_ends(tmp_path, trained_pico_dir, tokenizer,
                                                                          monkeypatch):
    """A warm start's checkpoints carry its samples packed (three int32 tensors per capability, not
    10^5 pickled lists: a save at the lab12 recipe's size, 0.78 s -> 0.041 s), they unpack to the
    samples it trains on, and once it ends the checkpoints drop them."""
    from transformers import AutoModelForCausalLM

    import opd.distill.loop as loop

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    routes = resolve_routes({"count": "count"})
    cfg = DistillConfig(estimator="full", steps=1, prompts_per_step=4, group_size=1, warmstart_steps=20,
                        warmstart_prompts=16, warmstart_batch=8, checkpoint_every=2)
    seen, real = [], loop.sft_loss

    def recording(policy, batch, *a, **k):
        seen.extend(batch)
        return real(policy, batch, *a, **k)

    monkeypatch.setattr(loop, "sft_loss", _dies_at_call(15, recording))
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, build_model(PICO, tokenizer, seed=0), tokenizer, teachers, routes, tmp_path / "s.pt",
                log=lambda *_: None)
    packed = torch.load(tmp_path / "s.pt", weights_only=True)["state"]["warm_samples"]
    assert set(packed["count"]) == {"tokens", "prompt_len", "completion_len"}
    assert all(t.dtype == torch.int32 for t in packed["count"].values())
    samples = unpack_samples(packed)["count"]
    assert seen and all(pair in samples for pair in seen)  # what it trained on, as lists of ids
    assert sum(len(p) + len(c) for p, c in samples) == packed["count"]["tokens"].numel()
    monkeypatch.setattr(loop, "sft_loss", real)
    distill(cfg, build_model(PICO, tokenizer, seed=0), tokenizer, teachers, routes, tmp_path / "s.pt",
            log=lambda *_: None)
    assert torch.load(tmp_path / "s.pt", weights_only=True)["state"]["warm_samples"] is None


def test_packed_samples_round_trip_and_older_checkpoints_lists_still_load():
    samples = {"a": [([1, 2, 3], [4]), ([5], [6, 7]), ([1, 2, 3], [4])], "b": []}
    packed = pack_samples(samples)
    assert packed["a"]["tokens"].tolist() == [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4] and packed["b"]["tokens"].numel() == 0
    assert unpack_samples(packed) == samples
    assert unpack_samples(samples) == samples  # a checkpoint from before the packing


def test_kl_warm_start_from_cached_teacher_logits_trains_as_the_in_step_teachers(tmp_path, trained_pico_dir,
                                                                                  tokenizer, monkeypatch):
    """warmstart_loss kl: within warmstart_cache_mib the teachers score their samples once and no step
    runs a teacher; at 0 (or over the budget) every step does. The two train the same student to float
    rounding, and a run killed midway rebuilds the cache and resumes to the uninterrupted weights."""
    from transformers import AutoModelForCausalLM

    import opd.distill.loop as loop
    import opd.distill.offpolicy as offpolicy
    import opd.distill.teachers as teachers_module

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    routes = resolve_routes({"count": "count"})
    cfg = DistillConfig(estimator="full", steps=0, warmstart_steps=20, warmstart_prompts=16, warmstart_batch=8,
                        warmstart_loss="kl", verifier="none", checkpoint_every=2, layout="packed")
    runs, real = {}, offpolicy.hidden_at
    for budget in (4096, 0):
        logs, forwards = [], []
        for module in (offpolicy, teachers_module):  # the in-step teachers' forward, and the cache's
            monkeypatch.setattr(module, "hidden_at", lambda *a, f=forwards, **k: f.append(1) or real(*a, **k))
        student = build_model(PICO, tokenizer, seed=0)
        distill(cfg.model_copy(update={"warmstart_cache_mib": budget}), student, tokenizer, teachers, routes,
                tmp_path / f"{budget}.pt", log=logs.append)
        runs[budget] = student.state_dict()
        assert any(m.startswith("warm start step 20/20: loss") and " count=" in m for m in logs)  # its running KL
        if budget:
            assert any("distinct samples once" in m for m in logs)
            assert len(forwards) == 1  # 16 prompts x 4 samples: one chunk, before the 20 steps
        else:
            assert any("over warmstart_cache_mib 0: each step runs its teachers" in m for m in logs)
            assert len(forwards) == 20
    for k, v in runs[4096].items():
        torch.testing.assert_close(runs[0][k], v, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(offpolicy, "hidden_at", real)

    real_kd = loop.kd_sequence_losses
    monkeypatch.setattr(loop, "kd_sequence_losses", _dies_at_call(15, real_kd))
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, build_model(PICO, tokenizer, seed=0), tokenizer, teachers, routes, tmp_path / "k.pt",
                log=lambda *_: None)
    monkeypatch.setattr(loop, "kd_sequence_losses", real_kd)
    logs, resumed = [], build_model(PICO, tokenizer, seed=0)
    distill(cfg, resumed, tokenizer, teachers, routes, tmp_path / "k.pt", log=logs.append)
    assert any("distinct samples once" in m for m in logs)
    for k, v in runs[4096].items():
        torch.testing.assert_close(resumed.state_dict()[k], v, atol=0, rtol=0)


def test_the_warm_starts_bar_hears_what_it_does_before_its_first_step(tmp_path, trained_pico_dir, tokenizer):
    """A progress callback with a `status` attribute (opd.distill.bar's) hears each capability's
    sampling, then the teachers' scoring, then an empty note, all before the first step."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    teachers = {c: embedded_teacher(c, c, teacher, tokenizer) for c in ("count", "rev")}
    routes = resolve_routes({"count": "count", "rev": "rev"})
    cfg = DistillConfig(estimator="full", steps=0, warmstart_steps=6, warmstart_prompts=8, warmstart_batch=4,
                        warmstart_loss="kl", verifier="none", checkpoint_every=1, layout="packed")
    notes, steps = [], []

    def progress(state, rec):
        steps.append((state.warm_step, len(notes)))

    progress.status = notes.append
    distill(cfg, build_model(PICO, tokenizer, seed=0), tokenizer, teachers, routes, tmp_path / "s.pt",
            log=lambda *_: None, progress=progress)
    assert notes == ["teachers sampling: count (1/2)", "teachers sampling: rev (2/2)",
                     "teachers scoring their samples", ""]
    assert [n for s, n in steps if s >= 1] == [4] * 6  # every note came before the first step



def test_d3_warm_start_draws_more_of_the_capability_further_from_its_teacher_and_resumes(
        tmp_path, trained_pico_dir, tokenizer, monkeypatch):
    """warmstart_balance d3: each step's draws follow the capabilities' running KL so far (the larger KL,
    the larger share, at most 4 to 0.25 of the mix), starting from the mix itself; the running KLs ride in
    the checkpoint, so a run killed midway resumes to the same weights."""
    from transformers import AutoModelForCausalLM

    import opd.distill.loop as loop

    rev_teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    count_teacher = copy.deepcopy(rev_teacher)
    torch.manual_seed(3)
    for p in count_teacher.parameters():
        p.data += 0.05 * torch.randn_like(p)
    teachers = {"count": embedded_teacher("count", "count", count_teacher, tokenizer),
                "rev": embedded_teacher("rev", "rev", rev_teacher, tokenizer)}
    routes = resolve_routes({"count": "count", "rev": "rev"})
    cfg = DistillConfig(estimator="full", steps=0, warmstart_steps=20, warmstart_prompts=16, warmstart_batch=8,
                        warmstart_loss="kl", warmstart_balance="d3", verifier="none", checkpoint_every=2,
                        layout="packed")
    shares, kls, real_draw = [], [], loop.draw_sft
    monkeypatch.setattr(loop, "draw_sft", lambda s, mix, *a, **k: shares.append(dict(mix)) or real_draw(s, mix, *a, **k))
    logs, whole = [], AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    state = distill(cfg, whole, tokenizer, teachers, routes, tmp_path / "a.pt", log=logs.append,
                    progress=lambda st, rec: rec is None and kls.append(dict(st.warm_kl)))
    assert shares[0] == {"count": 0.5, "rev": 0.5}  # nothing measured before the first step
    assert len(shares) == len(kls) == 20 and kls[-1] == state.warm_kl
    for share, kl in zip(shares[1:], kls):
        hi, lo = sorted(kl, key=kl.get, reverse=True)
        ratio = min(4.0, kl[hi] / (sum(kl.values()) / 2)) / max(0.25, kl[lo] / (sum(kl.values()) / 2))
        assert share[hi] / share[lo] == pytest.approx(ratio) and share[hi] > 0.5
    assert max(s["count"] for s in shares) - min(s["count"] for s in shares) > 0.05  # the schedule moves
    assert any("count=" in m and "rev=" in m for m in logs if m.startswith("warm start step"))

    real_kd = loop.kd_sequence_losses
    monkeypatch.setattr(loop, "kd_sequence_losses", _dies_at_call(15, real_kd))
    killed = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    with pytest.raises(KeyboardInterrupt):
        distill(cfg, killed, tokenizer, teachers, routes, tmp_path / "b.pt", log=lambda *_: None)
    monkeypatch.setattr(loop, "kd_sequence_losses", real_kd)
    resumed = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    again = distill(cfg, resumed, tokenizer, teachers, routes, tmp_path / "b.pt", log=lambda *_: None)
    assert again.warm_kl == state.warm_kl
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, atol=0, rtol=0)


def test_d3_warm_start_needs_the_kl_loss():
    with pytest.raises(ValueError, match="warmstart_balance d3 .* set warmstart_loss: kl"):
        DistillConfig(steps=0, warmstart_steps=10, warmstart_balance="d3")
