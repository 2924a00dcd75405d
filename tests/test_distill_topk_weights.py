"""The top-k OPD estimator and per-capability loss weights: maths by hand, agreement with the full
estimator at K = V on both teacher paths, config refusals, and a top-k run that trains."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from opd_kernels import reverse_kl_from_logits
from test_distill_fast import _teachers as perturbed_teachers
from test_distill_fast import per_token_kl

from opd.distill.batch import build_batch
from opd.distill.config import DistillConfig, load_run
from opd.distill.loop import StudentHidden, distill, opd_step, run_identity
from opd.distill.routing import resolve_routes
from opd.distill.teacher_bank import TeacherBank
from opd.distill.teachers import completion_hidden, embedded_teacher, lm_head_weight
from opd.errors import OpdError
from opd.rl.distill_loss import row_capability_weights, sequence_mean_loss, topk_reverse_kl
from opd.rollout import Rollout

# ---- the pure loss, by hand --------------------------------------------------------------------

PS = torch.tensor([0.5, 0.25, 0.125, 0.125])  # the student; its top-2 is {0, 1}
PT = torch.tensor([0.25, 0.25, 0.4, 0.1])  # the teacher


def test_topk_kl_of_known_distributions():
    zs, lt = PS.log()[None], PT.log()[None]
    # K=1: buckets {0} and the tail {1,2,3}: student (1/2, 1/2), teacher (1/4, 3/4)
    #   KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    assert topk_reverse_kl(zs, lt, 1).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-6)
    # K=2: {0}, {1}, tail {2,3}: student (1/2, 1/4, 1/4), teacher (1/4, 1/4, 1/2)
    #   KL = 1/2 ln 2 + 0 + 1/4 ln(1/2) = 1/4 ln 2
    assert topk_reverse_kl(zs, lt, 2).item() == pytest.approx(0.25 * math.log(2), abs=1e-6)
    # The full KL adds the tail's own KL weighted by the student's tail mass (the chain rule): the
    # tails normalised are (1/2, 1/2) and (4/5, 1/5), KL = 1/2 ln(5/8) + 1/2 ln(5/2) = ln(5/4), so
    # full = 1/4 ln 2 + 1/4 ln(5/4); top-k never exceeds it. K >= V (4, 9) is the full KL.
    full = 0.25 * math.log(2) + 0.25 * math.log(1.25)
    assert reverse_kl_from_logits(zs, lt).item() == pytest.approx(full, abs=1e-6)
    for k in (4, 9):
        assert topk_reverse_kl(zs, lt, k).item() == pytest.approx(full, abs=1e-6)
    assert topk_reverse_kl(lt, lt, 1).item() == pytest.approx(0.0, abs=1e-7)


def test_topk_kl_gradient_by_hand():
    # With buckets q_j (student) and t_j (teacher) and D their KL, dD/dz_i = p_i (ln q_b(i) - ln t_b(i) - D):
    # K=1, q = (1/2, 1/2), t = (1/4, 3/4), D = 1/2 ln(4/3): token 0 gets 1/2 (ln 2 - D), the tail's
    # tokens p_i (ln(2/3) - D). The teacher is a constant.
    zs = PS.log().clone().requires_grad_()
    topk_reverse_kl(zs[None], PT.log()[None], 1).sum().backward()
    D = 0.5 * math.log(4 / 3)
    want = torch.cat([PS[:1] * (math.log(2) - D), PS[1:] * (math.log(2 / 3) - D)])
    torch.testing.assert_close(zs.grad, want, atol=1e-6, rtol=0)


def test_topk_at_full_vocabulary_is_the_full_kl_and_gradient():
    torch.manual_seed(0)
    zs = (3 * torch.randn(5, 7)).requires_grad_()
    lt = torch.log_softmax(3 * torch.randn(5, 7), -1)
    full = reverse_kl_from_logits(zs, lt)
    (g_full,) = torch.autograd.grad(full.sum(), zs)
    top = topk_reverse_kl(zs, lt, 7)
    (g_top,) = torch.autograd.grad(top.sum(), zs)
    torch.testing.assert_close(top, full, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_top, g_full, atol=1e-6, rtol=0)


def test_topk_tail_is_stable_when_the_top_holds_nearly_all_mass():
    zs = torch.tensor([[40.0, 0.0, 0.0, 0.0]], requires_grad=True)  # tail mass ~ 1e-17: 1 - sum(top) = 0
    lt = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), -1)
    kl = topk_reverse_kl(zs, lt, 1)
    kl.backward()
    assert torch.isfinite(kl).all() and torch.isfinite(zs.grad).all()
    assert kl.item() == pytest.approx(-lt[0, 0].item(), abs=1e-5)  # all mass on token 0: KL = -ln p_t(0)


# ---- per-capability loss weights, by hand ------------------------------------------------------


def test_row_capability_weights_by_hand():
    # raw (2, 2, 1, 1) (c unnamed: 1), mean 3/2 -> (4/3, 4/3, 2/3, 2/3)
    got = row_capability_weights(["a", "a", "b", "c"], {"a": 2.0, "b": 1.0})
    torch.testing.assert_close(got, torch.tensor([4 / 3, 4 / 3, 2 / 3, 2 / 3]))
    assert row_capability_weights(["a", "b"], None).tolist() == [1.0, 1.0]
    assert row_capability_weights(["a", "a"], {"a": 5.0}).tolist() == [1.0, 1.0]  # one capability: no change


# ---- the loop's two teacher paths ----------------------------------------------------------------


def _teachers(model, tok):

    return perturbed_teachers(model, tok, scale=0.3)  # further from the student than there: top-k has a tail


def _mixed_batches(student, teachers, tok):
    """One batch of three rows (count mixes t0 and t1), scored per teacher (loop) and stacked (dense)."""
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    routes["count"] = {"t0": 0.5, "t1": 0.5}
    items = [type("I", (), {"capability": c, "answer": "x"}) for c in ["count", "rev", "sort"]]
    groups = [[Rollout("p", [5, 6, 7], [14, 15], "ab", [0.0, 0.0])], [Rollout("p", [8, 9], [16], "a", [0.0])],
              [Rollout("p", [10, 11], [17, 18, 19], "abc", [0.0] * 3)]]
    loop = build_batch(student, items, groups, teachers, routes, tok.pad_token_id)
    dense = build_batch(student, items, groups, teachers, routes, tok.pad_token_id,
                        bank=TeacherBank(teachers, sorted(teachers)))
    assert loop.target is None and dense.target is not None
    return loop, dense


def _kl_and_grads(fn, student, batch):
    real = batch.cmask.bool()
    h = completion_hidden(student, batch.ids, batch.attn, batch.plen, batch.cmask.shape[1])[real]
    h = h.detach().requires_grad_()
    W = lm_head_weight(student).detach().clone().requires_grad_()
    kl, st = fn(h, W, batch)
    gh, gw = torch.autograd.grad(kl.sum(), (h, W))
    return kl.detach(), gh, gw, st


def test_topk_matches_the_full_estimator_at_full_vocabulary_on_both_paths(pico_model, tokenizer):
    teachers = _teachers(pico_model, tokenizer)
    loop, dense = _mixed_batches(pico_model, teachers, tokenizer)
    V = lm_head_weight(pico_model).shape[0]
    want = _kl_and_grads(lambda *a: per_token_kl("full", *a, teachers), pico_model, loop)
    for batch in (loop, dense):
        for chunk in (1024, 2):  # one chunk, and several checkpointed ones
            got = _kl_and_grads(lambda *a, c=chunk: per_token_kl("topk", *a, teachers, c, V), pico_model, batch)
            for g, w in zip(got[:3], want[:3]):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
            assert set(got[3]) == {"kl/t0", "kl/t1", "kl/t2"}
    dense_full = _kl_and_grads(lambda *a: per_token_kl("full", *a, teachers), pico_model, dense)
    torch.testing.assert_close(dense_full[0], want[0], atol=1e-5, rtol=1e-4)


def test_topk_paths_agree_below_full_vocabulary(pico_model, tokenizer):
    """K < V: the stacked path's precomputed mixture and the loop's per-chunk one give the same
    loss and gradient; the row with one teacher is exactly topk_reverse_kl against that teacher."""
    teachers = _teachers(pico_model, tokenizer)
    loop, dense = _mixed_batches(pico_model, teachers, tokenizer)
    a = _kl_and_grads(lambda *x: per_token_kl("topk", *x, teachers, 2, 3), pico_model, loop)
    b = _kl_and_grads(lambda *x: per_token_kl("topk", *x, teachers, 1024, 3), pico_model, dense)
    for g, w in zip(a[:3], b[:3]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    real = loop.cmask.bool()
    T = loop.cmask.shape[1]
    hs = completion_hidden(pico_model, loop.ids, loop.attn, loop.plen, T)[real]
    ht = completion_hidden(teachers["t1"].model, loop.ids, loop.attn, loop.plen, T)[real]
    one = real[1].sum().item()  # row 1 (rev, t1 alone) holds real tokens 2 .. 2 + one
    zs = hs[2:2 + one] @ lm_head_weight(pico_model).T
    lt = torch.log_softmax(ht[2:2 + one] @ lm_head_weight(teachers["t1"].model).T, -1)
    torch.testing.assert_close(a[0][2:2 + one], topk_reverse_kl(zs, lt, 3).detach(), atol=1e-5, rtol=1e-4)
    full = _kl_and_grads(lambda *x: per_token_kl("full", *x, teachers), pico_model, loop)[0]
    assert bool((a[0] <= full + 1e-5).all()) and bool((a[0] < full - 1e-4).any())  # a coarser KL, never above


def test_capability_weights_scale_each_rows_loss(pico_model, tokenizer):
    """opd_step's first-update loss, full and top-k: mean over rows of w_b x (row b's mean token KL),
    w = (3, 1, 1) / (5/3) for the capabilities (count, rev, sort); sampled: -mean_b w_b mean_t A_bt,
    the GSPO-token loss at ratio 1."""
    teachers = _teachers(pico_model, tokenizer)
    _, batch = _mixed_batches(pico_model, teachers, tokenizer)
    real = batch.cmask.bool()
    w = torch.tensor([3.0, 1.0, 1.0]) / (5 / 3)
    h = completion_hidden(pico_model, batch.ids, batch.attn, batch.plen, batch.cmask.shape[1])[real]
    with torch.no_grad():
        per_token = {"full": per_token_kl("full", h, lm_head_weight(pico_model), batch, teachers)[0],
                     "topk": per_token_kl("topk", h, lm_head_weight(pico_model), batch, teachers, topk=2)[0]}
    for est, kl in per_token.items():
        padded = torch.zeros(real.shape).masked_scatter(real, kl)  # (B, T)
        row_means = padded.sum(1) / real.sum(1)
        want = float((w * row_means).mean())
        cfg = DistillConfig(estimator=est, topk=2 if est == "topk" else None, updates_per_batch=1,
                            capability_weights={"count": 3.0})
        student = copy.deepcopy(pico_model)
        out = opd_step(StudentHidden(student), torch.optim.SGD(student.parameters(), lr=0.0), batch, cfg, teachers)
        assert out["loss"] == pytest.approx(want, rel=1e-4), est
        unweighted = opd_step(StudentHidden(student), torch.optim.SGD(student.parameters(), lr=0.0), batch,
                              cfg.model_copy(update={"capability_weights": None}), teachers)
        assert unweighted["loss"] == pytest.approx(float(row_means.mean()), rel=1e-4)
    loop, _ = _mixed_batches(pico_model, teachers, tokenizer)  # its old_lp: the sampled estimator's ratio 1
    from opd.rl.distill_loss import mix_teacher_logprobs, sampled_advantages

    adv = sampled_advantages(loop.old_lp, mix_teacher_logprobs(loop.teacher_lp, loop.weights), loop.cmask)
    want = -float(sequence_mean_loss(adv * w[:, None], loop.cmask))
    student = copy.deepcopy(pico_model)
    out = opd_step(StudentHidden(student), torch.optim.SGD(student.parameters(), lr=0.0), loop,
                   DistillConfig(updates_per_batch=1, capability_weights={"count": 3.0}), teachers)
    assert out["loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)


# ---- config --------------------------------------------------------------------------------------


def test_topk_and_capability_weights_are_validated(tmp_path):
    with pytest.raises(ValueError, match="estimator 'topk' needs topk: K"):
        DistillConfig(estimator="topk")
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        DistillConfig(estimator="topk", topk=0)
    assert DistillConfig(estimator="topk", topk=8).topk == 8
    path = tmp_path / "r.yaml"
    path.write_text("teachers: [experts/count]\ndistill: {estimator: topk, topk: 4}\n")
    with pytest.raises(OpdError, match="the topk estimator reads teachers' hidden states"):
        load_run(path, ["teacher_servers={count: http://127.0.0.1:1}"])
    with pytest.raises(OpdError) as e:
        load_run(path, ["distill.capability_weights={count: 2, cuont: 1}"])
    msg = str(e.value)
    assert "\n" not in msg and "field 'distill.capability_weights'" in msg and "unknown capability 'cuont'" in msg
    with pytest.raises(OpdError, match="field 'distill.capability_weights.count'"):
        load_run(path, ["distill.capability_weights={count: 0}"])
    # unset, the new fields leave a checkpoint's identity as it was before they existed
    assert not {"topk", "capability_weights"} & set(run_identity(DistillConfig()))
    assert {"topk", "capability_weights"} <= set(run_identity(DistillConfig(estimator="topk", topk=2,
                                                                          capability_weights={"count": 2})))


def test_capability_weights_for_an_unrouted_capability_are_refused(pico_model, tokenizer):
    teachers = {"count": embedded_teacher("count", "count", pico_model, tokenizer)}
    cfg = DistillConfig(steps=1, capability_weights={"rev": 2.0})
    with pytest.raises(OpdError, match=r"capability_weights: \['rev'\] not among the routed capabilities"):
        distill(cfg, copy.deepcopy(pico_model), tokenizer, teachers, resolve_routes({"count": "count"}),
                log=lambda *_: None)


# ---- a run ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("forward", ["stacked", "loop"])
def test_topk_opd_lowers_student_kl_to_teacher(trained_pico_dir, tokenizer, forward):
    from test_distill import _exact_kl
    from transformers import AutoModelForCausalLM

    from opd.lab.model import build_model
    from opd.lab.pico import PICO

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    student = build_model(PICO, tokenizer, seed=0)
    prompts = ["#a:abca=", "#b:bbdd=", "#c:acdcab=", "#d:ddda="]
    before = _exact_kl(student, teacher, tokenizer, prompts)
    cfg = DistillConfig(estimator="topk", topk=4, steps=30, lr=3e-3, prompts_per_step=8, group_size=4,
                        teacher_forward=forward)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    state = distill(cfg, student, tokenizer, teachers, resolve_routes({"count": "count"}), log=lambda *_: None)
    after = _exact_kl(student, teacher, tokenizer, prompts)
    assert after < 0.8 * before, (before, after)
    assert {"kl/count", "loss", "grad_norm"} <= set(state.history[-1])


def test_estimator_registry_refuses_an_unknown_name_and_lists_the_known():
    from opd.rl.estimators import ESTIMATORS, get_estimator

    assert sorted(ESTIMATORS) == ["full", "sampled", "teacher_topk", "topk"]
    assert [get_estimator(n).reads_logits for n in ("sampled", "full", "topk", "teacher_topk")] == [
        False, True, True, False]
    assert [get_estimator(n).reads_top for n in ("sampled", "full", "topk", "teacher_topk")] == [
        False, False, False, True]
    with pytest.raises(OpdError, match=r"estimator 'exact' is unknown; estimators opd has: "
                                       r"\['full', 'sampled', 'teacher_topk', 'topk'\]"):
        get_estimator("exact")
