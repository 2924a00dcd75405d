"""RegMean: the least-squares maths against hand-worked small matrices and torch.linalg.lstsq, the
fallback for tensors that are not linear weights, Gram collection on lab prompts, and the mergekit
method through opd's in-memory merge and mergekit's run_merge."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from opd.weights.regmean import (
    collect_grams,
    grams_from_inputs,
    regmean_merge,
    scale_off_diagonal,
    task_average,
)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def diag(*v):
    return torch.diag(torch.tensor(v, dtype=torch.float64))


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=0, atol=1e-10)


W1 = t([1.0, 2.0], [3.0, 4.0])
W2 = t([5.0, -2.0], [0.0, 8.0])


def test_identical_grams_give_the_average():
    # (W1 G + W2 G)(2G)⁻¹ = (W1 + W2)/2 for any invertible G, whatever alpha does to it.
    g = t([2.0, 1.0], [1.0, 3.0])
    for alpha in (0.0, 0.5, 0.9, 1.0):
        close(regmean_merge([W1, W2], [g, g], alpha), (W1 + W2) / 2)


def test_an_expert_with_no_inputs_does_not_count():
    # G2 = 0: W = (W1 G1)(G1)⁻¹ = W1; the expert that saw no data has no say.
    g1 = t([2.0, 1.0], [1.0, 3.0])
    close(regmean_merge([W1, W2], [g1, torch.zeros(2, 2, dtype=torch.float64)], alpha=1.0), W1)


def test_diagonal_grams_average_each_input_column_by_energy():
    # G1 = diag(3, 1), G2 = diag(1, 1): column j is (G1_jj W1[:, j] + G2_jj W2[:, j]) / (G1_jj + G2_jj):
    # column 0 = (3·(1, 3) + (5, 0))/4 = (2, 2.25); column 1 = ((2, 4) + (−2, 8))/2 = (0, 6).
    close(regmean_merge([W1, W2], [diag(3, 1), diag(1, 1)], alpha=1.0), [[2.0, 0.0], [2.25, 6.0]])
    # alpha = 0 keeps only each Gram's diagonal: the same per-column average for any off-diagonal.
    g1, g2 = t([3.0, 1.5], [1.5, 1.0]), t([1.0, -0.5], [-0.5, 1.0])
    close(regmean_merge([W1, W2], [g1, g2], alpha=0.0), [[2.0, 0.0], [2.25, 6.0]])


def test_off_diagonal_gram_and_its_scaling():
    # W1 = [1, 0] saw only x = (1, 1): G1 = [[1, 1], [1, 1]]; W2 = [0, 0] saw e1 and e2: G2 = I.
    # alpha = 1: G = [[2, 1], [1, 2]], G⁻¹ = [[2, −1], [−1, 2]]/3, W1 G1 = [1, 1] → W = [1/3, 1/3]
    # (on x it gives 2/3 where W1 gave 1; on e1, e2 1/3 where W2 gave 0: loss 1/9 + 1/9 + 1/9).
    w1, w2 = t([1.0, 0.0]), t([0.0, 0.0])
    g1, g2 = t([1.0, 1.0], [1.0, 1.0]), torch.eye(2, dtype=torch.float64)
    close(regmean_merge([w1, w2], [g1, g2], alpha=1.0), [[1 / 3, 1 / 3]])
    # alpha = 0.5: G1' = [[1, .5], [.5, 1]], G = [[2, .5], [.5, 2]] (det 3.75), W1 G1' = [1, .5]:
    # W = [1, .5]·[[2, −.5], [−.5, 2]]/3.75 = [1.75, .5]/3.75 = [7/15, 2/15].
    close(scale_off_diagonal(g1, 0.5), [[1.0, 0.5], [0.5, 1.0]])
    close(regmean_merge([w1, w2], [g1, g2], alpha=0.5), [[7 / 15, 2 / 15]])


def test_directions_no_expert_excites_keep_the_average():
    # Input feature 1 is dead for both experts (G = diag(·, 0)): column 1 is the plain mean
    # ((2, 4) + (−2, 8))/2 = (0, 6); column 0 is energy-weighted as above, (2, 2.25).
    close(regmean_merge([W1, W2], [diag(3, 0), diag(1, 0)], alpha=1.0), [[2.0, 0.0], [2.25, 6.0]])
    # No data at all: the plain mean.
    z = torch.zeros(2, 2, dtype=torch.float64)
    close(regmean_merge([W1, W2], [z, z], alpha=0.9), (W1 + W2) / 2)


def test_importance_weights_each_experts_least_squares_term():
    # c = (3, 1) on identical Grams: (3 W1 + W2)/4.
    g = t([2.0, 1.0], [1.0, 3.0])
    close(regmean_merge([W1, W2], [g, g], alpha=1.0, importance=[3.0, 1.0]), (3 * W1 + W2) / 4)
    with pytest.raises(ValueError, match="importance"):
        regmean_merge([W1, W2], [g, g], importance=[0.0, 0.0])


def test_alpha_one_solves_the_stacked_least_squares():
    # min_W Σ_t ‖X_t Wᵀ − X_t W_tᵀ‖²: stack the experts' inputs and targets and solve with lstsq.
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 5, generator=g, dtype=torch.float64) for n in (7, 9, 6)]  # (n_t, in)
    ws = [torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in xs]  # (out, in)
    x = torch.cat(xs)  # (Σ n_t, in)
    y = torch.cat([xt @ wt.T for xt, wt in zip(xs, ws)])  # (Σ n_t, out)
    ref = torch.linalg.lstsq(x, y).solution.T  # (out, in)
    merged = regmean_merge(ws, [grams_from_inputs(xt) for xt in xs], alpha=1.0)
    torch.testing.assert_close(merged, ref, rtol=0, atol=1e-10)
    # ... and it is a minimum: no nearby W does better.
    def loss(w):
        return sum(((xt @ w.T - xt @ wt.T) ** 2).sum() for xt, wt in zip(xs, ws))
    assert loss(merged) < loss(merged + 1e-3 * torch.randn(4, 5, generator=g, dtype=torch.float64))
    # inputs with leading batch axes are flattened row by row: (2, 3, 5) is six rows
    x3 = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    close(grams_from_inputs(x3), x3.reshape(6, 5).T @ x3.reshape(6, 5))


def test_non_matrix_tensors_fall_back_to_the_average():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    torch.testing.assert_close(regmean_merge([a, b], [None, None]), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(regmean_merge([a, b], [None, None], importance=[1.0, 3.0]), torch.tensor([2.5, 5.0]))
    torch.testing.assert_close(task_average([a, b]), torch.tensor([2.0, 4.0]))
    assert regmean_merge([a.bfloat16(), b.bfloat16()], [None, None]).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="differ in shape"):
        regmean_merge([a, torch.zeros(3)], [None, None])
    with pytest.raises(ValueError, match=r"one \(2, 2\) Gram per expert"):
        regmean_merge([W1, W2], [diag(1, 1), None])
    with pytest.raises(ValueError, match="alpha"):
        regmean_merge([W1, W2], [diag(1, 1), diag(1, 1)], alpha=1.5)


def test_collect_grams_hooks_every_linear_and_skips_padding():
    class Tok:  # one token per character, id = digit; 0 pads
        pad_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return type("E", (), {"input_ids": [int(ch) for ch in text]})()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1, bias=False)

        def forward(self, input_ids, attention_mask):
            # a token id i becomes the input (i, 1): Gram Σ (i², i; i, 1), mean over the real tokens
            x = torch.stack([input_ids.float(), torch.ones_like(input_ids, dtype=torch.float)], -1)  # (B, T, 2)
            return self.lin(x)

    # tokens 1, 2 and 3 (the second prompt is padded by one): mean of [[i², i], [i, 1]] over i = 1, 2, 3
    grams = collect_grams(Net(), Tok(), ["12", "3"], batch=2)
    assert set(grams) == {"lin.weight"}
    close(grams["lin.weight"], [[14 / 3, 2.0], [2.0, 1.0]])


# mergekit and opd registration


def test_regmean_is_registered_with_mergekit_and_opd(tmp_path):
    import mergekit.merge_methods as mm

    import opd.merge  # noqa: F401  (registers it)
    from opd.merge.recipe import load_recipe
    from opd.merge.strategies import get_strategy

    assert mm.get("regmean").spec.name == "regmean"
    s = get_strategy("regmean")
    assert s.inputs == "experts" and s.shared == {"alpha": 0.9, "prompts": 64} and s.per_model == {"weight": 1.0}
    s.check_inputs(10)
    p = tmp_path / "r.yaml"
    p.write_text("name: x\nexperts: [add]\nstrategies: {regmean: {alpha: [0.5, 1.0]}}\n")
    assert load_recipe(p).strategies["regmean"]["alpha"] == (0.5, 1.0)


def test_method_refuses_inputs_without_grams():
    import mergekit.merge_methods as mm

    import opd.merge  # noqa: F401
    from opd.errors import OpdError

    with pytest.raises(OpdError, match="no Gram matrices for merge input 'never-prepared'"):
        mm.merge_tensors([W1, W2], "regmean", ids=["never-prepared", "b"], name="x.weight")


def test_merge_candidate_matches_the_maths_and_run_merge(lab3, tmp_path):
    from opd.weights import regmean
    from opd.weights.merge import Candidate, merge_candidate, mergekit_config, run_mergekit
    from opd.weights.regmean import expert_grams

    lab, sds = lab3
    experts = list(lab["experts"])
    paths = {e: str(lab["experts"][e]) for e in experts}
    shared = {"alpha": 0.7, "prompts": 8}
    cand = Candidate(strategy="regmean", shared=shared, per_model={experts[0]: {"weight": 2.0}})
    mine = merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in experts})
    cached = dict(regmean._CACHE)
    assert merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in experts}).keys() == mine.keys()
    assert all(regmean._CACHE[k] is v for k, v in cached.items()) and len(regmean._CACHE) == len(cached)  # reused
    grams = {e: expert_grams(paths[e], prompts=8) for e in experts}
    importance = [2.0, 1.0, 1.0]
    for k in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight",
              "model.layers.1.mlp.down_proj.weight"):
        want = regmean_merge([sds[e][k] for e in experts], [grams[e][k] for e in experts], 0.7, importance)
        torch.testing.assert_close(mine[k], want)
        assert not torch.allclose(mine[k], task_average([sds[e][k] for e in experts], importance))
    # Norms and embeddings have no Gram: the weighted mean (no expert moved them: the base's).
    for k in ("model.norm.weight", "model.embed_tokens.weight"):
        torch.testing.assert_close(mine[k], sds["base"][k])
    # The export path, as a fresh process runs it (no Grams in memory): the candidate's YAML through
    # mergekit's run_merge recomputes the Grams from the expert directories, tensor for tensor.
    regmean._CACHE.clear()
    regmean._BOUND.clear()
    doc = mergekit_config(cand, str(lab["base"]), paths)
    assert doc["merge_method"] == "regmean" and doc["parameters"] == shared and "base_model" not in doc
    run_mergekit(doc, str(tmp_path / "out"))
    ref = load_file(tmp_path / "out" / "model.safetensors")
    assert set(ref) == set(mine)
    for k in ref:
        assert torch.equal(ref[k], mine[k]), k
