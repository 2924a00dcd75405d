"""WUDI: the closed-form solve against hand-worked small matrices and the objective's gradient, the
data term (and its RegMean limit), the fallbacks and refusals, registration with mergekit and the
strategy registry, and a merge of fake experts through opd's in-memory path, mergekit's run_merge and
`python -m opd.merge export`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from opd.weights.regmean import regmean_merge
from opd.weights.wudi import RIDGE, objective, wudi, wudi_gram


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def diag(*v):
    return torch.diag(torch.tensor(v, dtype=torch.float64))


def close(a, b, atol=1e-12):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=0, atol=atol)


# The maths, by hand


def test_gram_is_the_unit_trace_row_gram():
    # τ = [[1, 2], [2, 4]]: τᵀτ = [[5, 10], [10, 20]], ‖τ‖² = 25 → G = [[.2, .4], [.4, .8]] (trace 1).
    close(wudi_gram(t([1.0, 2.0], [2.0, 4.0])), [[0.2, 0.4], [0.4, 0.8]])
    # with data 3 and XᵀX = diag(2, 0): + 3 · diag(1, 0)
    close(wudi_gram(t([1.0, 2.0], [2.0, 4.0]), diag(2.0, 0.0), 3.0), [[3.2, 0.4], [0.4, 0.8]])
    close(wudi_gram(torch.zeros(2, 2, dtype=torch.float64)), torch.zeros(2, 2))  # a zero τ: no term


def test_one_expert_merges_to_itself():
    # τ G G⁻¹ = τ for an invertible G; exactly without the ridge.
    tau = t([1.0, 2.0], [0.0, 3.0], [4.0, 1.0])
    close(wudi([tau], ridge=0.0), tau)
    # Rank 1, τ = [[1, 2], [2, 4]] = s u vᵀ: G = v vᵀ is singular, τ G = τ, and (G + λI)⁻¹ v = v/(1 + λ):
    # τ_m = τ / (1 + λ), λ = RIDGE · tr(G)/in = RIDGE/2. The ridge's only trace is that shrink.
    tau = t([1.0, 2.0], [2.0, 4.0])
    close(wudi([tau]), tau / (1 + RIDGE / 2))


def test_orthogonal_row_spaces_add_up():
    # τ1 reads input e1 only, τ2 e2 only: G1 = diag(1, 0), G2 = diag(0, 1), Σ G = I, τ_m = τ1 + τ2.
    t1, t2 = t([1.0, 0.0], [2.0, 0.0]), t([0.0, 3.0], [0.0, -1.0])
    close(wudi([t1, t2], ridge=0.0), t1 + t2)
    close(wudi([t1, t2]), (t1 + t2) / (1 + RIDGE), atol=1e-14)  # λ = RIDGE · 2/2; Σ G = I


def test_2x2_overlapping_tasks_end_their_interference():
    # τ1 = [[1, 0], [0, 0]]: G1 = diag(1, 0). τ2 = [[0, 0], [1, 1]]: G2 = [[1, 1], [1, 1]]/2.
    # Σ G = [[1.5, .5], [.5, .5]] (det .5), (Σ G)⁻¹ = [[1, −1], [−1, 3]]; Σ τ G = τ1 + τ2 = [[1, 0], [1, 1]];
    # τ_m = [[1, 0], [1, 1]] · [[1, −1], [−1, 3]] = [[1, −1], [0, 2]].
    t1, t2 = t([1.0, 0.0], [0.0, 0.0]), t([0.0, 0.0], [1.0, 1.0])
    merged = wudi([t1, t2], ridge=0.0)
    close(merged, [[1.0, -1.0], [0.0, 2.0]])
    # It does on each task's input what that task does: e1 → (1, 0) as τ1, (1, 1) → (0, 2) as τ2;
    # the task-arithmetic sum sends e1 to (1, 1), τ2's interference on task 1.
    e1, ones = t([1.0], [0.0]), t([1.0], [1.0])
    close(merged @ e1, t1 @ e1)
    close(merged @ ones, t2 @ ones)
    assert objective(merged, [t1, t2]) < 1e-20 < objective(t1 + t2, [t1, t2])


def test_conflicting_tasks_meet_in_between():
    # (1, 0), (0, 1) and (2, 2): by symmetry τ_m = (a, a), loss 2(a − 1)² + 16(a − 2)²/8 → a = 3/2.
    # Σ G = [[1.5, .5], [.5, 1.5]], Σ τ G = (3, 3), (3, 3)(Σ G)⁻¹ = (1.5, 1.5).
    close(wudi([t([1.0, 0.0]), t([0.0, 1.0]), t([2.0, 2.0])], ridge=0.0), [[1.5, 1.5]])
    # The same input direction, different outputs: G1 = G2 = diag(1, 0), the mean 2 (not the sum 4),
    # the ridge λ = RIDGE · 2/2 on the free direction: 4 / (2 + λ).
    close(wudi([t([1.0, 0.0]), t([3.0, 0.0])]), [[4 / (2 + RIDGE), 0.0]])


def test_exact_solve_is_the_objectives_minimum():
    # The paper descends this objective with Adam; the closed form is where its gradient is zero.
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    xs = [torch.randn(7, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    for data in (0.0, 2.5):
        merged = wudi(deltas, grams=[x.T @ x for x in xs], data=data, ridge=0.0).requires_grad_()
        loss = objective(merged, deltas, xs, data)
        (grad,) = torch.autograd.grad(loss, merged)
        assert grad.abs().max() < 1e-10
        assert loss < objective(sum(deltas), deltas, xs, data)


def test_adam_steps_from_the_sum_by_hand():
    # One entry: τ1 = (1), τ2 = (3), G1 = G2 = (1): gradient 2 (2x − 4), start x = 4 (the sum).
    # Adam's first step is lr · m̂/(√v̂ + eps) = lr · sign(gradient) (up to eps): 4 → 4 − lr.
    t1, t2 = t([1.0]), t([3.0])
    close(wudi([t1, t2], solver="adam", lr=0.1, steps=0), [[4.0]])  # no steps: task arithmetic
    close(wudi([t1, t2], solver="adam", lr=0.1, steps=1), [[3.9]], atol=1e-8)
    # The second: g = 2 (2 · 3.9 − 4) = 7.6 after 8; m̂ = (.9 · .1 · 8 + .1 · 7.6)/(1 − .81),
    # v̂ = (.999 · .001 · 64 + .001 · 57.76)/(1 − .998001); step lr · m̂/√v̂.
    m = (0.9 * 0.1 * 8 + 0.1 * 7.6) / (1 - 0.9**2)
    v = (0.999 * 0.001 * 64 + 0.001 * 7.6**2) / (1 - 0.999**2)
    close(wudi([t1, t2], solver="adam", lr=0.1, steps=2), [[3.9 - 0.1 * m / v**0.5]], atol=1e-8)
    # alpha scales the result as for the exact solve
    close(wudi([t1, t2], alpha=0.5, solver="adam", lr=0.1, steps=1), [[1.95]], atol=1e-8)


def test_adam_approaches_the_exact_solve():
    g = torch.Generator().manual_seed(4)
    deltas = [torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    grams = [x.T @ x for x in (torch.randn(9, 4, generator=g, dtype=torch.float64) for _ in range(3))]
    exact = wudi(deltas, grams=grams, data=1.0)
    far = (sum(deltas) - exact).abs().max()
    near = (wudi(deltas, grams=grams, data=1.0, solver="adam", lr=0.01, steps=3000) - exact).abs().max()
    assert near < 0.01 * far
    few = (wudi(deltas, grams=grams, data=1.0, solver="adam", lr=0.01, steps=30) - exact).abs().max()
    assert near < few < far  # fewer steps stop between the sum and the optimum


def test_data_term_hand_worked():
    # τ1 = (1, 0), τ2 = (0, 1): data-free Σ G = I and τ_m = (1, 1). Both experts' inputs lie on e2
    # (X1ᵀX1 = diag(0, 4), X2ᵀX2 = diag(0, 1), each diag(0, 1) at unit trace), where τ1 does nothing:
    # Σ G = diag(1, 1 + 2d), Σ τ G = (1, 0) + (0, 1 + d) → τ_m = (1, (1 + d)/(1 + 2d)).
    t1, t2 = t([1.0, 0.0]), t([0.0, 1.0])
    grams = [diag(0.0, 4.0), diag(0.0, 1.0)]
    close(wudi([t1, t2], ridge=0.0), [[1.0, 1.0]])
    close(wudi([t1, t2], grams=grams, data=1.0, ridge=0.0), [[1.0, 2 / 3]])
    close(wudi([t1, t2], grams=grams, data=3.0, ridge=0.0), [[1.0, 4 / 7]])
    close(wudi([t1, t2], grams=grams, data=0.0, ridge=0.0), [[1.0, 1.0]])  # grams unused at d = 0


def test_large_data_is_regmean_on_unit_trace_grams():
    g = torch.Generator().manual_seed(1)
    deltas = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    grams = [(x.T @ x) for x in (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(2))]
    want = regmean_merge(deltas, [gr / torch.trace(gr) for gr in grams], alpha=1.0)
    close(wudi(deltas, grams=grams, data=1e9, ridge=0.0), want, atol=1e-7)
    assert not torch.allclose(wudi(deltas, grams=grams, data=1.0), want, atol=1e-3)  # d = 1 is in between


def test_alpha_zero_fallback_and_dtype():
    t1, t2 = t([1.0, 0.0], [0.0, 0.0]), t([0.0, 0.0], [1.0, 1.0])
    close(wudi([t1, t2], alpha=0.5, ridge=0.0), [[0.5, -0.5], [0.0, 1.0]])
    close(wudi([torch.zeros(2, 3), torch.zeros(2, 3)]), torch.zeros(2, 3))  # nothing moved: nothing to solve
    # not a matrix: alpha · the mean task vector, as TSV-M
    torch.testing.assert_close(
        wudi([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])], alpha=2.0), torch.tensor([4.0, 8.0])
    )
    out = wudi([t1.to(torch.bfloat16), t2.to(torch.bfloat16)])
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"solver": "sgd"}, "solver must be one of ['exact', 'adam'], got 'sgd'"),
        ({"solver": "adam", "lr": -1.0}, "lr and steps must be >= 0, got lr=-1.0, steps=300"),
        ({"data": -1.0}, "data must be >= 0"),
        ({"data": 1.0}, "data > 0 needs one (2, 2) input Gram per expert, got None"),
        ({"data": 1.0, "grams": [torch.eye(3), torch.eye(2)]}, "got [(3, 3), (2, 2)]"),
    ],
)
def test_bad_arguments_are_refused(kwargs, words):
    with pytest.raises(ValueError) as e:
        wudi([torch.eye(2), torch.eye(2)], **kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"wudi: task vectors differ in shape: \[\(2, 2\), \(2, 3\)\]"):
        wudi([torch.zeros(2, 2), torch.zeros(2, 3)])


# mergekit and opd registration


def test_registered_with_mergekit_and_the_strategies(tmp_path):
    import mergekit.merge_methods as mm

    import opd.merge  # noqa: F401  (registers it)
    from opd.merge.recipe import load_recipe
    from opd.merge.strategies import get_strategy

    assert mm.get("wudi").spec.name == "wudi"
    s = get_strategy("wudi")
    assert s.inputs == "base+experts" and s.per_model == {"weight": 1.0} and not s.native
    assert s.shared == {"alpha": 1.0, "solver": "exact", "data": 0.0, "prompts": 64, "inputs": "completion",
                        "lr": 2e-5, "steps": 300}
    assert {"alpha", "data"} <= s.layerwise
    s.check_inputs(10)
    assert get_strategy("wudi+opd").merge_part  # its hybrid with OPD
    p = tmp_path / "r.yaml"
    p.write_text(
        "name: x\nexperts: [add]\nstrategies: {wudi: {alpha: [0.8, 1.2], solver: exact, data: [0.5, 10.0]}}\n"
    )
    assert load_recipe(p).strategies["wudi"] == {"alpha": (0.8, 1.2), "solver": "exact", "data": (0.5, 10.0)}


@pytest.mark.parametrize(
    "override, words",
    [
        ("strategies.wudi={solver: sgd}", "strategy 'wudi': 'solver' = 'sgd': Input should be 'exact' or 'adam'"),
        ("strategies.wudi={lr: -1}", "'lr' = -1: Input should be greater than or equal to 0"),
        ("strategies.wudi={data: -1}", "'data' = -1: Input should be greater than or equal to 0"),
        ("strategies.wudi={data: [-1, 2]}", "'data' = -1.0: Input should be greater than or equal to 0"),
        (
            "strategies.wudi={data: {choices: [0, -2]}}",
            "'data' = -2: Input should be greater than or equal to 0",
        ),
        ("strategies.wudi+opd={data: -1}", "strategy 'wudi+opd': strategy 'wudi': 'data' = -1"),
    ],
)
def test_bad_recipes_fail_in_one_line(tmp_path, override, words):
    from opd.errors import OpdError
    from opd.merge.recipe import load_recipe

    p = tmp_path / "r.yaml"
    p.write_text("name: x\nexperts: [add]\nstrategies: {wudi: {alpha: 1.0}}\n")
    with pytest.raises(OpdError) as e:
        load_recipe(p, [override])
    assert words in str(e.value) and "\n" not in str(e.value) and "r.yaml" in str(e.value)


def test_mergekit_adapter_falls_back_and_needs_grams_for_data():
    import mergekit.merge_methods as mm

    import opd.merge  # noqa: F401
    from opd.errors import OpdError

    base = torch.zeros(2, 2)
    experts = [torch.tensor([[1.0, 0], [0, 0]]), torch.tensor([[0.0, 0], [1, 1]])]
    ids = ["base", "a", "b"]
    out = mm.merge_tensors([base, *experts], "wudi", ids=ids, base_index=0, name="model.embed_tokens.weight")
    torch.testing.assert_close(out, torch.tensor([[0.5, 0], [0.5, 0.5]]))  # vocabulary: the mean task vector
    out = mm.merge_tensors(
        [base + 1, *(e + 1 for e in experts)],
        "wudi",
        ids=ids,
        base_index=0,
        name="model.layers.0.mlp.up_proj.weight",
        parameters={"alpha": 2.0},
    )
    want = 1 + 2 * torch.tensor([[1.0, -1.0], [0.0, 2.0]])  # the 2x2 case above, alpha 2
    torch.testing.assert_close(out, want, rtol=0, atol=1e-4)
    with pytest.raises(OpdError, match="wudi: no Gram matrices for merge input 'a'"):
        mm.merge_tensors(
            [base, *experts], "wudi", ids=ids, base_index=0, name="x.weight", parameters={"data": 1.0}
        )


# Fake experts, both merge paths and the export


KEYS = (
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
)


@pytest.mark.parametrize(
    "shared",
    [{"alpha": 1.2}, {"alpha": 0.9, "data": 2.0, "prompts": 8, "inputs": "prompt"}],
    ids=["data-free", "data"],
)
def test_merge_candidate_matches_the_maths_and_run_merge(lab3, tmp_path, shared):
    from opd.weights import regmean
    from opd.weights.merge import Candidate, merge_candidate, mergekit_config, run_mergekit

    lab, sds = lab3
    experts = list(lab["experts"])
    paths = {e: str(lab["experts"][e]) for e in experts}
    cand = Candidate(strategy="wudi", shared=shared, per_model={experts[0]: {"weight": 0.5}})
    mine = merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in experts})
    base, data = sds["base"], shared.get("data", 0.0)
    grams = {e: regmean.expert_grams(paths[e], 8, "prompt") for e in experts} if data else None
    for k in KEYS:
        deltas = [w * (sds[e][k] - base[k]) for w, e in zip([0.5, 1.0, 1.0], experts)]
        gk = [grams[e][k] for e in experts] if data else None
        torch.testing.assert_close(mine[k], base[k] + wudi(deltas, shared["alpha"], gk, data))
        if data:  # the experts' inputs moved it
            assert not torch.allclose(mine[k], base[k] + wudi(deltas, shared["alpha"]), atol=1e-4)
        assert not torch.allclose(mine[k], base[k] + shared["alpha"] * sum(deltas), atol=1e-4)  # not the sum
    k = "model.layers.0.self_attn.k_proj.weight"  # no expert moved it: every τ is zero, so is the merge
    assert torch.equal(mine[k], base[k]) and torch.equal(mine["model.norm.weight"], base["model.norm.weight"])
    # The export path as a fresh process runs it (no Grams in memory): the YAML pins every setting
    # the statistics depend on, and run_merge rebuilds the merge tensor for tensor.
    regmean.STORE.clear()
    doc = mergekit_config(cand, str(lab["base"]), paths)
    assert doc["merge_method"] == "wudi" and doc["base_model"] == str(lab["base"])
    assert doc["parameters"] == {
        "alpha": shared["alpha"],
        "solver": "exact",
        "data": data,
        "prompts": shared.get("prompts", 64),
        "inputs": shared.get("inputs", "completion"),
        "lr": 2e-5,
        "steps": 300,
    }
    run_mergekit(doc, str(tmp_path / "out"))
    assert bool(regmean.STORE.stats) == bool(data)  # data-free WUDI reads no expert's inputs
    ref = load_file(tmp_path / "out" / "model.safetensors")
    assert set(ref) == set(mine)
    for k in ref:
        assert torch.equal(ref[k], mine[k]), k


def test_export_rebuilds_a_wudi_trial(lab3, tmp_path):
    """`python -m opd.merge export <run> <trial>` on a data-aware WUDI trial: the YAML and run_merge's
    model, checked against the search's merge tensor for tensor."""
    from test_merge_fakes import write_recipe

    from opd.merge.__main__ import main
    from opd.merge.recipe import load_recipe
    from opd.weights import regmean
    from opd.weights.merge import Candidate

    lab, _ = lab3
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            lab,
            tmp_path / "out",
            strategies={"wudi": {"alpha": [0.8, 1.2], "data": [0.5, 10.0], "prompts": 8, "inputs": "prompt"}},
        )
    )
    cand = Candidate(
        strategy="wudi",
        shared={"alpha": 1.1, "data": 3.0, "prompts": 8, "inputs": "prompt"},
        per_model={"rev": {"weight": 1.5}},
    )
    recipe.out_dir.mkdir(parents=True)
    (recipe.out_dir / "results.json").write_text(
        json.dumps(
            {
                "recipe": recipe.model_dump(mode="json"),
                "trials": [{"number": 0, "candidate": cand.model_dump(mode="json")}],
            }
        )
    )
    regmean.STORE.clear()
    main(["export", str(recipe.out_dir), "0"])
    out = recipe.out_dir / "export" / "trial-0"
    m = json.loads((out / "manifest.json").read_text())
    assert m["reproduced"]["max_abs_diff"] == 0.0 and m["reproduced"]["tensors"] > 0
    assert "merge_method: wudi" in (out / "mergekit.yaml").read_text()
