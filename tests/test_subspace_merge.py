"""Subspace merges (TSV-M, Iso-C, Iso-CTS): the maths against hand-worked small matrices, the
fallback for non-matrix tensors, and the mergekit methods through opd's merge path."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from opd.weights.subspace import iso_c, iso_cts, iso_cts_dims, task_mean, tsv_m


def diag(*v):
    return torch.diag(torch.tensor(v, dtype=torch.float64))


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=0, atol=1e-10)


# TSV-M


def test_tsv_m_of_orthogonal_tasks_is_their_scaled_sum():
    # diag(3,0) = 3·e1e1ᵀ and diag(0,2) = 2·e2e2ᵀ: T=2, r=2, so each keeps k=1 component; the
    # stacked U = [e1, e2] and V = [e1, e2] are orthonormal already, so merged = alpha·diag(3, 2).
    close(tsv_m([diag(3, 0), diag(0, 2)]), diag(3, 2))
    close(tsv_m([diag(3, 0), diag(0, 2)], alpha=0.5), diag(1.5, 1))
    # 3×2: e1e1ᵀ and 2·e3e2ᵀ (disjoint rows and columns) merge to their sum.
    d1 = torch.tensor([[1.0, 0], [0, 0], [0, 0]], dtype=torch.float64)
    d2 = torch.tensor([[0.0, 0], [0, 0], [0, 2]], dtype=torch.float64)
    close(tsv_m([d1, d2]), d1 + d2)


def test_tsv_m_keeps_each_tasks_top_1_over_T_components():
    # diag(3,1) keeps only 3·e1e1ᵀ (k = r/T = 1); diag(0,2) keeps 2·e2e2ᵀ; the 1 is dropped.
    close(tsv_m([diag(3, 1), diag(0, 2)]), diag(3, 2))
    # rank_fraction=1 keeps everything: U = [e1, e2, e2] has a repeated direction, orth gives
    # [e1, e2/√2, e2/√2] (and the same for V), so merged = 3·e1e1ᵀ + (1+2)/2·e2e2ᵀ.
    close(tsv_m([diag(3, 1), diag(0, 2)], rank_fraction=1.0), diag(3, 1.5))
    # One task keeps all r components, which are orthonormal: TSV-M returns it.
    d = torch.tensor([[1.0, 2], [3, 4], [5, 6]], dtype=torch.float64)
    close(tsv_m([d]), d)


def test_tsv_m_decorrelates_left_singular_vectors_symmetrically():
    # Δ1 = e1e1ᵀ, Δ2 = x e2ᵀ with x at 60° to e1. V = [e1, e2] is orthonormal; U = [e1, x] is not.
    # The polar factor of two unit vectors at angle θ turns them apart symmetrically about their
    # bisector until they are orthogonal: to θ/2 − 45° = −15° and θ/2 + 45° = 75°. With σ = 1,
    # merged = [u1 u2] (columns), u1 at −15°, u2 at 75°: the rotation by −15°.
    x = torch.tensor([math.cos(math.pi / 3), math.sin(math.pi / 3)], dtype=torch.float64)
    d1 = diag(1, 0)
    d2 = torch.outer(x, torch.tensor([0.0, 1], dtype=torch.float64))
    c, s = math.cos(math.radians(15)), math.sin(math.radians(15))
    close(tsv_m([d1, d2]), [[c, s], [-s, c]])


def test_tsv_m_of_repeated_task_is_that_task():
    # Δ1 = Δ2 = 2·u vᵀ: U = [u, u] → orth = [u/√2, u/√2], V likewise, so
    # merged = 2·(u/√2)(v/√2)ᵀ + 2·(u/√2)(v/√2)ᵀ = 2·u vᵀ (the mean, not the sum).
    u = torch.tensor([0.6, 0.8], dtype=torch.float64)
    v = torch.tensor([1.0, 0, 0], dtype=torch.float64)
    d = 2 * torch.outer(u, v)
    close(tsv_m([d, d]), d)


# Iso-C


def test_iso_c_flattens_the_spectrum_of_the_sum():
    # sum = diag(3, 1): σ̄ = 2, U Vᵀ = I.
    close(iso_c([diag(3, 0), diag(0, 1)]), diag(2, 2))
    close(iso_c([diag(3, 0), diag(0, 1)], alpha=1.5), diag(3, 3))
    # sum = diag(3, −1) = I·diag(3, 1)·diag(1, −1): U Vᵀ = diag(1, −1).
    close(iso_c([diag(3, 0), diag(0, -1)]), diag(2, -2))
    # 3×2: [[1,0],[0,0],[0,2]] = [e1 e3]·diag(1, 2)·[e1 e2]ᵀ; σ̄ = 1.5.
    d = torch.tensor([[1.0, 0], [0, 0], [0, 2]], dtype=torch.float64)
    close(iso_c([d]), [[1.5, 0], [0, 0], [0, 1.5]])


def test_iso_c_keeps_the_rank_of_the_sum():
    # Two rank-1 tasks along the same u vᵀ (gains 1 and 3): the sum 4·u vᵀ has one nonzero singular
    # value, so σ̄ = 4 over the kept rank and no arbitrary second direction is added.
    u = torch.tensor([0.6, 0.8], dtype=torch.float64)
    v = torch.tensor([0.0, 1.0], dtype=torch.float64)
    close(iso_c([torch.outer(u, v), 3 * torch.outer(u, v)]), 4 * torch.outer(u, v))


# Iso-CTS


def test_iso_cts_dims_follow_the_reference_rounding():
    assert iso_cts_dims(4, 2, 0.5) == (2, 1)
    assert iso_cts_dims(10, 3, 0.8) == (7, 1)  # ⌊8⌋ = 8; round(2/3) = 1
    assert iso_cts_dims(4, 2, 0.8) == (4, 0)  # round(1/2) = 0: everything common, Iso-C
    assert iso_cts_dims(3, 2, 0.0) == (1, 1)  # round(3/2) = 2 would overrun r = 3; capped at ⌊3/2⌋
    assert iso_cts_dims(32, 10, 0.8) == (22, 1)


def test_iso_cts_adds_task_specific_directions():
    # 4×4, T=2, fraction 0.5: k = 2, s = 1. sum = diag(5,4,3,2): common = e1, e2 (σ 5, 4).
    # Δ1 minus the common part: diag(0,0,2,0) → top: 2·e3e3ᵀ. Δ2's: diag(0,0,1,2) → top: 2·e4e4ᵀ.
    # U = V = [e1, e2, e3, e4], σ = (5, 4, 2, 2), mean 3.25: merged = 3.25·I.
    # Iso-C on the same tasks flattens (5,4,3,2) instead: 3.5·I.
    d1, d2 = diag(5, 0, 2, 0), diag(0, 4, 1, 2)
    close(iso_cts([d1, d2], common_space_fraction=0.5), 3.25 * torch.eye(4, dtype=torch.float64))
    close(iso_c([d1, d2]), 3.5 * torch.eye(4, dtype=torch.float64))
    # Both tasks' leftovers along e3 (Δ2 = diag(0,4,1,0.5)): U = [e1, e2, e3, e3] → orth gives
    # [e1, e2, e3/√2, e3/√2]; σ = (5, 4, 2, 1), mean 3: merged = 3·(e1e1ᵀ + e2e2ᵀ + e3e3ᵀ).
    close(iso_cts([d1, diag(0, 4, 1, 0.5)], common_space_fraction=0.5), diag(3, 3, 3, 0))


def test_iso_cts_with_all_common_space_is_iso_c():
    g = torch.Generator().manual_seed(0)
    ds = [torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    torch.testing.assert_close(iso_cts(ds, alpha=0.7, common_space_fraction=1.0), iso_c(ds, alpha=0.7))
    with pytest.raises(ValueError, match="common_space_fraction"):
        iso_cts(ds, common_space_fraction=1.5)


# Shared rules


@pytest.mark.parametrize("fn", [tsv_m, iso_c, iso_cts])
def test_cancelling_tasks_merge_to_zero(fn):
    # Δ and −Δ: the sum is 0, and each task's singular pair flips sign on one side only, so their
    # rank-1 terms cancel too.
    d = torch.tensor([[1.0, 2], [0, 1]], dtype=torch.float64)
    close(fn([d, -d]), torch.zeros(2, 2))


@pytest.mark.parametrize("fn", [tsv_m, iso_c, iso_cts])
def test_non_matrix_tensors_fall_back_to_the_scaled_mean(fn):
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    torch.testing.assert_close(fn([a, b], alpha=2.0), torch.tensor([4.0, 8.0]))
    torch.testing.assert_close(task_mean([a, b]), torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError, match="differ in shape"):
        fn([a, torch.zeros(3)])


@pytest.mark.parametrize("fn", [tsv_m, iso_c, iso_cts])
def test_low_precision_inputs_come_back_in_their_dtype(fn):
    out = fn([diag(3, 0).to(torch.bfloat16), diag(0, 2).to(torch.bfloat16)])
    assert out.dtype == torch.bfloat16


# mergekit and opd registration


def test_methods_are_registered_with_mergekit_and_opd():
    import mergekit.merge_methods as mm

    import opd.merge  # noqa: F401  (registers them)
    from opd.merge.strategies import get_strategy

    for name in ("tsv_m", "iso_c", "iso_cts"):
        assert mm.get(name).spec.name == name
        s = get_strategy(name)
        assert s.inputs == "base+experts" and "alpha" in s.shared and "weight" in s.per_model
        s.check_inputs(10)
    assert get_strategy("iso_cts").shared["common_space_fraction"] == 0.8


def test_recipe_may_search_the_new_methods(tmp_path):
    from opd.errors import OpdError
    from opd.merge.recipe import load_recipe

    p = tmp_path / "r.yaml"
    p.write_text("name: x\nexperts: [add]\nstrategies: {tsv_m: {alpha: [0.5, 2.0]}, iso_c: {alpha: 1.0},"
                 " iso_cts: {alpha: [0.5, 2.0], common_space_fraction: [0.5, 0.9]}}\n")
    r = load_recipe(p)
    assert r.strategies["iso_cts"]["common_space_fraction"] == (0.5, 0.9)
    p.write_text("name: x\nexperts: [add]\nstrategies: {tsv_m: {density: 0.5}}\n")
    with pytest.raises(OpdError, match="no parameter 'density'; it takes \\['alpha', 'weight'\\]"):
        load_recipe(p)


def test_mergekit_adapter_uses_the_fallback_for_vocabulary_matrices():
    import mergekit.merge_methods as mm

    import opd.merge  # noqa: F401

    base = torch.zeros(2, 2)
    experts = [torch.tensor([[3.0, 0], [0, 0]]), torch.tensor([[0.0, 0], [0, 1]])]
    ids = ["base", "a", "b"]
    out = mm.merge_tensors([base, *experts], "iso_c", ids=ids, base_index=0, name="model.embed_tokens.weight")
    torch.testing.assert_close(out, torch.tensor([[1.5, 0], [0, 0.5]]))  # mean of the deltas
    out = mm.merge_tensors([base, *experts], "iso_c", ids=ids, base_index=0, name="model.layers.0.mlp.up_proj.weight",
                           parameters={"weight": {"a": 1.0, "b": 3.0}})
    torch.testing.assert_close(out, torch.tensor([[3.0, 0], [0, 3.0]]))  # sum diag(3, 3): σ̄ = 3


CASES = [
    ("tsv_m", tsv_m, {"alpha": 1.2}, {}),
    ("iso_c", iso_c, {"alpha": 0.9}, {}),
    ("iso_cts", iso_cts, {"alpha": 1.1, "common_space_fraction": 0.6}, {"common_space_fraction": 0.6}),
]


@pytest.mark.parametrize("method, fn, shared, extra", CASES, ids=[c[0] for c in CASES])
def test_merge_candidate_runs_each_method_and_matches_run_merge(lab3, tmp_path, method, fn, shared, extra):
    from opd.weights.merge import Candidate, merge_candidate, mergekit_config, run_mergekit

    lab, sds = lab3
    experts = list(lab["experts"])
    cand = Candidate(strategy=method, shared=shared, per_model={experts[0]: {"weight": 0.5}})
    paths = {e: str(lab["experts"][e]) for e in experts}
    mine = merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in experts})
    base = sds["base"]
    weights = [0.5, 1.0, 1.0]
    for k in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        deltas = [w * (sds[e][k] - base[k]) for w, e in zip(weights, experts)]
        torch.testing.assert_close(mine[k], base[k] + fn(deltas, alpha=shared["alpha"], **extra))
        assert not torch.equal(mine[k], base[k])
    assert torch.equal(mine["model.norm.weight"], base["model.norm.weight"])  # no expert moved it
    # The export path: the same candidate's YAML through mergekit's run_merge, tensor for tensor.
    run_mergekit(mergekit_config(cand, str(lab["base"]), paths), str(tmp_path / "out"))
    ref = load_file(tmp_path / "out" / "model.safetensors")
    assert set(ref) == set(mine)
    for k in ref:
        assert torch.equal(ref[k], mine[k]), k


@pytest.mark.parametrize("fn", [tsv_m, iso_cts])
def test_an_svd_that_fails_to_converge_is_retried_in_float64(fn, monkeypatch):
    """LAPACK's gesdd gives up on some ill-conditioned float32 inputs (Iso-CTS on bf16-stored 0.5B
    experts did, bench/bench_scale.py): the merge then takes the float64 SVD, not an error."""
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(12, 8, generator=g) for _ in range(3)]
    want = fn([d.double() for d in deltas]).float()
    real, failed = torch.linalg.svd, []

    def flaky(x, full_matrices=True):
        if x.dtype == torch.float32:
            failed.append(x.shape)
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return real(x, full_matrices=full_matrices)

    monkeypatch.setattr(torch.linalg, "svd", flaky)
    got = fn(deltas)
    assert failed and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
