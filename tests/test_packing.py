"""The packed token layout (opd.rl.packing): the same hidden states and gradients as one right-padded
row per sample, for the student's update, the warm start and the stacked teachers."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from opd.distill.batch import build_batch
from opd.distill.config import DistillConfig
from opd.distill.loop import StudentHidden, minibatches, opd_step, run_identity
from opd.distill.offpolicy import sft_loss
from opd.distill.routing import resolve_routes
from opd.distill.teacher_bank import TeacherBank
from opd.distill.teachers import completion_hidden
from opd.rl.batch import pad_sequences
from opd.rl.packing import hidden_at, lay_out
from opd.rollout import Rollout
from tests.test_distill_fast import _teachers

# Three groups: a prompt with three samples (one of a single token), a prompt of one token with
# one sample, and a prompt with two; lengths mixed so padding and packing differ.
P = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [9], [10, 11, 12], [10, 11, 12]]
C = [[14, 15, 16], [17], [18, 19], [20, 21, 22, 23, 24], [25, 26], [27, 28, 29]]


def _padded_hidden(model, prompts, completions, pad_id):
    ids, attn, cmask, plen = pad_sequences(prompts, completions, pad_id)
    return completion_hidden(model, ids, attn, plen, cmask.shape[1])[cmask.bool()]


def test_packed_hidden_states_and_gradients_equal_the_padded_rows(pico_model, tokenizer):
    pad = tokenizer.pad_token_id
    ref = _padded_hidden(pico_model, P, C, pad)
    grads = {}
    for layout in ("padded", "packed"):
        rows = lay_out(P, C, pad, layout)
        h = hidden_at(pico_model, rows)
        torch.testing.assert_close(h, ref, atol=1e-5, rtol=0)
        pico_model.zero_grad()
        (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
        grads[layout] = [p.grad.clone() for p in pico_model.parameters()]
    for a, b in zip(grads["padded"], grads["packed"]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_a_group_prompt_is_laid_out_once_and_completions_never_see_each_other(pico_model, tokenizer):
    pad = tokenizer.pad_token_id
    rows = lay_out(P, C, pad, "packed")
    real = int((rows.ids != pad).sum())
    # three distinct prompts once each, then every completion but its last token
    assert real == 4 + 1 + 3 + sum(len(c) - 1 for c in C)
    assert rows.ids.numel() < lay_out(P, C, pad, "padded").ids.numel()
    base = hidden_at(pico_model, rows)
    # change the first group's second sample: its own hidden states move, its siblings' do not
    C2 = [C[0], [31], C[2], *C[3:]]
    P2, C3 = P, [C2[0], [31, 32, 33], *C2[2:]]
    moved = hidden_at(pico_model, lay_out(P2, C3, pad, "packed"))
    n0, n1 = len(C[0]), len(C3[1])
    torch.testing.assert_close(moved[:n0], base[:n0], atol=1e-6, rtol=0)  # sibling before it
    tail_old, tail_new = base[n0 + len(C[1]):], moved[n0 + n1:]
    torch.testing.assert_close(tail_new, tail_old, atol=1e-6, rtol=0)  # siblings and other groups after it
    assert not torch.allclose(moved[n0 + 1 : n0 + n1], torch.zeros_like(moved[n0 + 1 : n0 + n1]))


def test_rows_of_empty_completions_and_bad_input():
    rows = lay_out([[5, 6], [7]], [[], [8, 9]], 0, "packed")
    assert rows.index.tolist() == [2, 3]  # row 1's prompt ends at flat position 2: no token from row 0
    with pytest.raises(ValueError, match="prompt token"):
        lay_out([[]], [[1]], 0, "packed")
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        lay_out([[1], [2]], [[3]], 0, "padded")


def _batch(student, teachers, tokenizer, layout, bank=True, old_lp=False):
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    routes["count"] = {"t0": 0.5, "t1": 0.5}  # one capability with a mixed target
    caps = ["count", "rev", "sort"]
    items = [type("I", (), {"capability": c, "answer": "x"}) for c in caps]
    groups, b = [], 0
    for g in (3, 1, 2):  # the groups of P, C
        groups.append([Rollout("p", P[b + j], C[b + j], "a", [0.0] * len(C[b + j])) for j in range(g)])
        b += g
    # build_batch wants equal groups for the reward tensor: pad each to 3 samples of its prompt
    groups = [g + [Rollout("p", g[0].prompt_ids, [40 + i], "a", [0.0]) for i in range(3 - len(g))] for g in groups]
    return build_batch(student, items, groups, teachers, routes, tokenizer.pad_token_id,
                       bank=TeacherBank(teachers, sorted(teachers)) if bank else None, old_lp=old_lp, layout=layout)


def test_packed_teacher_scores_equal_the_padded_bank(pico_model, tokenizer):
    teachers = _teachers(pico_model, tokenizer)
    padded = _batch(pico_model, teachers, tokenizer, "padded", old_lp=True)
    packed = _batch(pico_model, teachers, tokenizer, "packed", old_lp=True)
    for name in ("target", "log_z", "teacher_lp", "old_lp"):
        torch.testing.assert_close(getattr(packed, name), getattr(padded, name), atol=1e-5, rtol=0)
    assert float(packed.log_z.abs().max()) > 1e-3  # the mixed capability's normaliser is there


def test_packed_scoring_in_chunks_equals_one_forward(pico_model, tokenizer, monkeypatch):
    import opd.distill.teacher_bank as bank

    teachers = _teachers(pico_model, tokenizer)
    whole = _batch(pico_model, teachers, tokenizer, "packed")
    calls = []
    monkeypatch.setattr(bank, "CHUNK_TOKENS", 5)  # a chunk per group
    monkeypatch.setattr(bank, "lay_out", lambda p, *a, **k: calls.append(p) or lay_out(p, *a, **k))
    chunked = _batch(pico_model, teachers, tokenizer, "packed")
    assert max(len(c) for c in calls) == 3 and all(len({tuple(p) for p in c}) == 1 for c in calls)  # whole groups
    for name in ("target", "log_z", "teacher_lp"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), atol=1e-5, rtol=0)
    assert bank.chunk_rows([0, 1, 2, 3], [[1], [1], [2], [2]], [[5, 6]] * 4, 4) == [[0, 1], [2, 3]]
    assert bank.chunk_rows([0, 1, 2, 3], [[1], [1], [2], [2]], [[5, 6]] * 4, 100) == [[0, 1, 2, 3]]


def test_packed_update_equals_the_padded_update(pico_model, tokenizer):
    """One sample per prompt: the same minibatches, so the same loss and weights up to float rounding;
    groups of three: whole groups per minibatch."""
    teachers = _teachers(pico_model, tokenizer)
    cfg = DistillConfig(estimator="full", updates_per_batch=1)
    out = {}
    for layout in ("padded", "packed"):
        student = copy.deepcopy(pico_model)
        batch = _batch(student, teachers, tokenizer, layout)
        opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
        torch.manual_seed(0)
        out[layout] = (opd_step(StudentHidden(student), opt, batch, cfg, teachers), student.state_dict())
    assert out["packed"][0]["loss"] == pytest.approx(out["padded"][0]["loss"], rel=1e-5)
    for k, v in out["padded"][1].items():
        torch.testing.assert_close(out["packed"][1][k], v, atol=1e-5, rtol=1e-4)
    batch = _batch(pico_model, teachers, tokenizer, "packed")
    torch.manual_seed(0)
    for rows in minibatches(batch, 2):
        assert len(rows) % 3 == 0 and all(set(range(r // 3 * 3, r // 3 * 3 + 3)) <= set(rows.tolist())
                                          for r in rows.tolist())


def test_packed_warm_start_loss_equals_the_padded_one(pico_model, tokenizer):
    pairs = list(zip(P, C))
    policy = StudentHidden(pico_model)
    losses = {layout: sft_loss(policy, pairs, tokenizer.pad_token_id, layout=layout) for layout in ("padded", "packed")}
    assert losses["packed"][1] == losses["padded"][1] == sum(len(c) for c in C)
    assert float(losses["packed"][0].detach()) == pytest.approx(float(losses["padded"][0].detach()), rel=1e-5)


def test_layout_padded_resumes_checkpoints_written_before_the_field():
    """Runs from before `layout` existed were padded: left at padded, the identity omits the field."""
    assert "layout" not in run_identity(DistillConfig())
    assert run_identity(DistillConfig(layout="packed"))["layout"] == "packed"


def test_bench_packed_layout_runs_on_a_pico_base(pico_dir):
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_packed_layout.py"
    out = subprocess.run([sys.executable, str(bench), "--base", str(pico_dir), "--steps", "2", "--batch", "8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch threads 1" in out.stdout and out.stdout.strip().splitlines()[-1].startswith("ratio: ")
    bad = subprocess.run([sys.executable, str(bench), "--base", str(pico_dir / "nope")], capture_output=True, text=True)
    assert bad.returncode == 2 and "--base" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_last_mlp_at_the_read_positions_only_gives_the_same_states_and_gradients(pico_model, tokenizer, layout):
    rows = lay_out(P, C, tokenizer.pad_token_id, layout)
    seen = []
    hook = pico_model.get_decoder().layers[-1].mlp.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape))
    out = {}
    for trim in (False, True):
        pico_model.zero_grad()
        h = hidden_at(pico_model, rows, last_mlp_at_index=trim)
        (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
        out[trim] = (h.detach(), [p.grad.clone() for p in pico_model.parameters()])
    hook.remove()
    mlp = pico_model.get_decoder().layers[-1].mlp
    assert not mlp._forward_hooks and not mlp._forward_pre_hooks  # the trimming's hooks are gone afterwards
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-6, rtol=0)
    for a, b in zip(out[False][1], out[True][1]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    # untrimmed: every position of the rows; trimmed: each read position once (a prompt's last
    # position predicts each of its group's first tokens)
    assert seen[0][:2] == rows.ids.shape
    assert seen[1][1] == len(set(rows.index.tolist())) < rows.ids.numel()


def test_row_width_packs_no_more_positions_than_a_fixed_width():
    import random

    from opd.rl.packing import first_fit, row_width

    assert row_width([5, 7, 9]) == 21  # together within 64: one row of their own length
    assert row_width([70, 5]) == 70  # a document longer than 64 sets the width
    assert row_width([23] * 6) == 23  # rows of one document each, no padding (64 would leave 18 free per row)
    assert row_width([23, 22] * 3) == 45  # two a row, no padding
    rng = random.Random(0)
    for _ in range(50):
        size = [rng.randrange(8, 40) for _ in range(rng.randrange(3, 40))]
        S = row_width(size)
        place, fill = first_fit(size, S)
        assert max(size) <= S <= max(max(size), 64)
        fixed = max(max(size), min(64, sum(size)))
        assert len(fill) * S <= len(first_fit(size, fixed)[1]) * fixed
        assert all(f <= S for f in fill) and len(set(place)) == len(size)


def _count_and_sort_teachers(pico_model, tokenizer) -> dict:
    """Two in-process teachers: count, a copy of the student; sort, the student perturbed (seeded)."""
    from opd.distill.teachers import embedded_teacher

    torch.manual_seed(0)
    other = copy.deepcopy(pico_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return {"count": embedded_teacher("t1", "count", copy.deepcopy(pico_model), tokenizer),
            "sort": embedded_teacher("t2", "sort", other, tokenizer)}


def _kd_setup(pico_model, tokenizer):
    """The KL warm-start tests' pad id, two teachers, six pairs of both capabilities mixed, the student's
    StudentHidden and its head."""
    teachers = _count_and_sort_teachers(pico_model, tokenizer)
    caps = ["sort", "count", "sort", "count", "count", "sort"]
    return (tokenizer.pad_token_id, teachers, list(zip(caps, zip(P, C))), StudentHidden(pico_model),
            pico_model.get_output_embeddings().weight)


def test_warm_start_kl_loss_is_the_exact_per_token_kl_to_each_capability_teacher(pico_model, tokenizer):
    """warmstart_loss: kl: every completion token's KL(student || its capability's teacher) over the
    full vocabulary, from the padded logits by hand, in either layout, pairs of two teachers mixed;
    zero against a teacher equal to the student, and its gradient reaches the student alone."""
    from opd_kernels.chunked import reverse_kl_from_logits

    from opd.distill.offpolicy import kd_loss

    pad, teachers, batch, policy, W = _kd_setup(pico_model, tokenizer)
    per_seq = []
    for cap, (p, c) in batch:
        zs = _padded_hidden(pico_model, [p], [c], pad) @ W.T
        t = teachers[cap].model
        zt = _padded_hidden(t, [p], [c], pad) @ t.get_output_embeddings().weight.T
        per_seq.append(reverse_kl_from_logits(zs, zt).mean())
    want = torch.stack(per_seq).mean()
    for layout in ("padded", "packed"):
        loss, n = kd_loss(policy, batch, teachers, pad, layout=layout)
        assert n == sum(len(c) for c in C)
        assert float(loss.detach()) == pytest.approx(float(want), rel=1e-4) and float(loss.detach()) > 1e-4
    same = {c: teachers["count"] for c in ("count", "sort")}
    assert float(kd_loss(policy, batch, same, pad, layout="packed")[0].detach()) == pytest.approx(0.0, abs=1e-6)
    pico_model.zero_grad()
    kd_loss(policy, batch, teachers, pad, layout="packed")[0].backward()
    assert W.grad is not None and W.grad.abs().sum() > 0
    assert all(p.grad is None for t in teachers.values() for p in t.model.parameters())


def test_warm_start_kl_target_temperature(pico_model, tokenizer):
    """warmstart_target_temperature: the KL's target is softmax(teacher logits / T), by hand, whether the
    teachers run in the step or their logits come from the cache; 1.0 is the teacher itself, and a T
    that is not 1.0 changes the loss. Refused without warmstart_loss: kl."""
    from opd_kernels.chunked import reverse_kl_from_logits

    from opd.distill.config import DistillConfig
    from opd.distill.offpolicy import cached_logits, kd_loss, teacher_logits_cache

    pad, teachers, batch, policy, W = _kd_setup(pico_model, tokenizer)
    samples = {c: [pair for cc, pair in batch if cc == c] for c in ("count", "sort")}
    cache = teacher_logits_cache(samples, teachers, pad, "packed")
    seen = {c: 0 for c in samples}
    draws = []
    for c, _ in batch:
        draws.append((c, seen[c]))
        seen[c] += 1
    losses = {}
    for T in (1.0, 0.3):
        per_seq = []
        for cap, (p, c) in batch:
            zs = _padded_hidden(pico_model, [p], [c], pad) @ W.T
            t = teachers[cap].model
            zt = _padded_hidden(t, [p], [c], pad) @ t.get_output_embeddings().weight.T
            per_seq.append(reverse_kl_from_logits(zs, zt / T).mean())
        want = float(torch.stack(per_seq).mean())
        in_step = float(kd_loss(policy, batch, teachers, pad, layout="packed", target_temperature=T)[0].detach())
        cached = float(kd_loss(policy, batch, teachers, pad, layout="packed", target_temperature=T,
                               teacher_logits=cached_logits(cache, draws))[0].detach())
        assert in_step == pytest.approx(want, rel=1e-4) and cached == pytest.approx(want, rel=1e-4)
        losses[T] = want
    assert abs(losses[0.3] - losses[1.0]) > 1e-3
    with pytest.raises(ValueError, match="warmstart_target_temperature"):
        DistillConfig(warmstart_steps=10, warmstart_target_temperature=0.5)
    DistillConfig(warmstart_steps=10, warmstart_loss="kl", warmstart_target_temperature=0.5)


def test_warm_start_kl_loss_is_refused_without_in_process_teachers(pico_model, tokenizer):
    """teachers_on: ray holds the teachers in actors: refused in the config, in one message naming
    the fix; a teacher with no model (a server's) is refused by the loss itself."""
    from opd.distill.offpolicy import kd_loss
    from opd.distill.teachers import Teacher
    from opd.errors import OpdError
    from opd.rollout import get_engine

    with pytest.raises(ValueError, match="warmstart_loss: kl .* use warmstart_loss: nll"):
        DistillConfig(teachers_on="ray", warmstart_loss="kl", warmstart_steps=5, sample_ahead=False)
    DistillConfig(teachers_on="ray", warmstart_loss="nll", warmstart_steps=5, sample_ahead=False)
    remote = Teacher("t", "count", get_engine("embedded", model=pico_model, tokenizer=tokenizer), None)
    with pytest.raises(OpdError, match="teacher of count has none"):
        kd_loss(StudentHidden(pico_model), [("count", (P[0], C[0]))], {"count": remote}, tokenizer.pad_token_id)


def test_warm_start_kl_from_cached_teacher_logits_equals_the_in_step_teachers(pico_model, tokenizer):
    """teacher_logits_cache scores every sample once, in chunks (here 2 pairs, so chunks split a
    capability's samples); kd_loss on the cached logits of any draw gives the loss and the student
    gradient of running the draw's teachers in the step, in either layout, and runs no teacher."""
    from opd.distill.offpolicy import cache_bytes, cached_logits, draw_sft, kd_loss, teacher_logits_cache

    pad = tokenizer.pad_token_id
    teachers = _count_and_sort_teachers(pico_model, tokenizer)
    # sort's first pair twice (a teacher near its mode repeats itself): its logits are cached once
    samples = {"count": list(zip(P, C)), "sort": list(zip(P[::-1], C[::-1]))[:3] + [(P[-1], C[-1])]}
    V = pico_model.get_output_embeddings().weight.shape[0]
    assert cache_bytes(samples, V) == 4 * V * (sum(len(c) for c in C) + sum(len(c) for c in C[::-1][:3]))
    draws = draw_sft(samples, {"count": 1.0, "sort": 2.0}, random.Random(3), 9) + [("sort", 3)]
    batch = [(c, samples[c][i]) for c, i in draws]
    policy = StudentHidden(pico_model)
    W = pico_model.get_output_embeddings().weight
    for layout in ("padded", "packed"):
        cache = teacher_logits_cache(samples, teachers, pad, layout, chunk=2)
        assert {c: tuple(f.shape) for c, (f, _, _) in cache.items()} == {
            c: (sum(len(x) for _, x in v[:len(P) if c == "count" else 3]), V) for c, v in samples.items()}
        assert cache["sort"][2] == [0, 1, 2, 0]
        pico_model.zero_grad()
        want, n = kd_loss(policy, batch, teachers, pad, layout=layout)
        want.backward()
        g_want = W.grad.clone()
        pico_model.zero_grad()
        broken = {c: None for c in teachers}  # a teacher run here would fail
        got, m = kd_loss(policy, batch, broken, pad, layout=layout,
                         teacher_logits=cached_logits(cache, draws))
        got.backward()
        assert m == n and float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5) and float(want.detach()) > 1e-4
        torch.testing.assert_close(W.grad, g_want, rtol=1e-4, atol=1e-6)


def test_draw_sft_draws_as_random_choice_did():
    """draw_sft's indices are the pairs the warm start drew before it returned indices (rng.choice),
    so seeded warm starts keep their batches."""
    from opd.distill.offpolicy import draw_sft

    samples = {"a": [([1], [i]) for i in range(7)], "b": [([2], [i]) for i in range(3)], "c": []}
    mix = {"a": 1.0, "b": 3.0, "c": 1.0}
    r1, r2 = random.Random(5), random.Random(5)
    caps = [c for c in mix if samples[c]]
    chosen = r1.choices(caps, weights=[mix[c] for c in caps], k=20)
    old = [r1.choice(samples[c]) for c in chosen]
    assert [samples[c][i] for c, i in draw_sft(samples, mix, r2, 20)] == old
    assert r1.random() == r2.random()


def test_draw_sft_groups_draws_whole_prompts_and_packs_each_prompt_once():
    """warmstart_draws: groups: every drawn prompt comes with all its kept samples, consecutive, until
    the batch has at least `size` pairs; laid out packed, each prompt is laid out once for them."""
    from opd.distill.offpolicy import draw_sft, prompt_groups
    from opd.rl.packing import lay_out

    a = [([1, 2, 3, 4, 5], [10 + i, 30 + g]) for i in range(5) for g in range(4)]  # 5 prompts x 4 samples
    a = [([1, 2, 3, 4, 5 + i], c) for i, (_, c) in zip([j // 4 for j in range(20)], a)]
    b = [([7, 8, 9], [40]), ([7, 8, 9], [41]), ([7, 8, 6], [42])]  # prompts with 2 and 1 kept samples
    samples = {"a": a, "b": b}
    assert prompt_groups(b) == [range(0, 2), range(2, 3)] and len(prompt_groups(a)) == 5
    draws = draw_sft(samples, {"a": 1.0, "b": 1.0}, random.Random(0), 16, "groups")
    assert len(draws) >= 16
    at = 0
    while at < len(draws):  # the draws are whole groups, one after another
        c, i = draws[at]
        g = next(g for g in prompt_groups(samples[c]) if i in g)
        assert draws[at: at + len(g)] == [(c, j) for j in g]
        at += len(g)
    pairs = [samples[c][i] for c, i in draws]
    rows = [lay_out([p for p, _ in pairs], [c for _, c in pairs], 0, "packed"),
            lay_out([p for p, _ in pairs], [c for _, c in pairs], 0, "padded")]
    starts = [j for j in range(len(pairs)) if j == 0 or pairs[j][0] != pairs[j - 1][0]]
    assert len(starts) < len(pairs)
    laid = sum(len(pairs[j][0]) for j in starts) + sum(len(c) - 1 for _, c in pairs)  # each prompt once
    assert int((rows[0].ids != 0).sum()) == laid
    assert rows[0].index.numel() == rows[1].index.numel() == sum(len(c) for _, c in pairs)
