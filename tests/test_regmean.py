"""RegMean: the least-squares maths against hand-worked small matrices and torch.linalg.lstsq, the
fallback for tensors that are not linear weights, Gram collection on lab prompts, and the mergekit
method through opd's in-memory merge and mergekit's run_merge."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from opd.weights.regmean import (
    collect_grams,
    collect_stats,
    grams_from_inputs,
    merge_tensor,
    regmean_diagonal,
    regmean_embedding,
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
    assert s.inputs == "experts" and s.per_model == {"weight": 1.0}
    assert s.shared == {"alpha": 0.9, "prompts": 64, "inputs": "completion", "propagate": "expert",
                        "embeddings": "average", "norms": "average"}
    s.check_inputs(10)
    p = tmp_path / "r.yaml"
    p.write_text("name: x\nexperts: [add]\nstrategies: {regmean: {alpha: [0.5, 1.0], inputs: prompt, "
                 "propagate: {choices: [expert, merged]}}}\n")
    r = load_recipe(p).strategies["regmean"]
    assert r["alpha"] == (0.5, 1.0) and r["inputs"] == "prompt" and r["propagate"].choices == ["expert", "merged"]


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
    cached = dict(regmean.STORE.stats)
    assert merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in experts}).keys() == mine.keys()
    assert all(regmean.STORE.stats[k] is v for k, v in cached.items()) and len(regmean.STORE.stats) == len(cached)  # reused
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
    regmean.STORE.clear()
    doc = mergekit_config(cand, str(lab["base"]), paths)
    # the YAML pins every setting the statistics depend on, the defaults included
    assert doc["merge_method"] == "regmean" and "base_model" not in doc
    assert doc["parameters"] == {**shared, "inputs": "completion", "propagate": "expert", "embeddings": "average",
                                 "norms": "average"}
    run_mergekit(doc, str(tmp_path / "out"))
    ref = load_file(tmp_path / "out" / "model.safetensors")
    assert set(ref) == set(mine)
    for k in ref:
        assert torch.equal(ref[k], mine[k]), k


# Embeddings, norms and the rule each tensor gets


def test_embedding_rows_average_by_token_share():
    # Untied (no head Grams): row v = Σ_t n_tv E_t[v] / Σ_t n_tv. Token 0: both experts use it half
    # the time, ((1, 2) + (3, 0))/2 = (2, 1); token 1: only expert 1 uses it, (3, 4); token 2: no one,
    # the plain mean ((5, 6) + (1, 2))/2 = (3, 4).
    e1, e2 = t([1.0, 2.0], [3.0, 4.0], [5.0, 6.0]), t([3.0, 0.0], [0.0, 0.0], [1.0, 2.0])
    n1, n2 = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64), torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64)
    close(regmean_embedding([e1, e2], [n1, n2]), [[2.0, 1.0], [3.0, 4.0], [3.0, 4.0]])
    # importance (3, 1): token 0 is (1.5·(1, 2) + 0.5·(3, 0))/2 = (1.5, 1.5); token 2 the weighted mean (4, 5)
    close(regmean_embedding([e1, e2], [n1, n2], importance=[3.0, 1.0]), [[1.5, 1.5], [3.0, 4.0], [4.0, 5.0]])


def test_tied_embedding_sums_both_roles_least_squares():
    # d = 1: each row solves Σ_t (g_t + n_tv)(e − E_t[v])² → e = Σ_t E_t[v](g_t + n_tv) / Σ_t (g_t + n_tv).
    # G1 = 2, G2 = 1; n1 = (0.5, 0.5), n2 = (1, 0). Row 0: (1·2.5 + 3·2)/(2.5 + 2) = 17/9;
    # row 1: (2·2.5 + 0·1)/(2.5 + 1) = 10/7.
    e1, e2 = t([1.0], [2.0]), t([3.0], [0.0])
    n1, n2 = torch.tensor([0.5, 0.5], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)
    close(regmean_embedding([e1, e2], [n1, n2], [t([2.0]), t([1.0])]), [[17 / 9], [10 / 7]])


def test_tied_embedding_against_a_solve_per_row_and_the_head_alone():
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(3)]  # (V, d)
    hs = [grams_from_inputs(torch.randn(4, 3, generator=g, dtype=torch.float64)) for _ in ws]  # (d, d)
    ns = [torch.rand(5, generator=g, dtype=torch.float64) for _ in ws]  # (V,)
    c, alpha = [1.0, 2.0, 0.5], 0.8
    got = regmean_embedding(ws, ns, hs, alpha, c)
    eye = torch.eye(3, dtype=torch.float64)
    for v in range(5):  # e_v = (Σ c_t E_t[v](G_t' + n_tv I))(Σ c_t (G_t' + n_tv I))⁻¹
        a = sum(ci * (scale_off_diagonal(h, alpha) + n[v] * eye) for ci, h, n in zip(c, hs, ns))
        b = sum(ci * w[v] @ (scale_off_diagonal(h, alpha) + n[v] * eye) for ci, w, h, n in zip(c, ws, hs, ns))
        torch.testing.assert_close(got[v], torch.linalg.solve(a.T, b), rtol=0, atol=1e-10)
    # No token counts: the head's RegMean, as regmean_merge computes it for a (V, d) weight.
    zero = [torch.zeros(5, dtype=torch.float64)] * 3
    torch.testing.assert_close(regmean_embedding(ws, zero, hs, alpha, c), regmean_merge(ws, hs, alpha, c),
                               rtol=0, atol=1e-10)


def test_norm_weights_average_each_feature_by_input_energy():
    # γ_j = Σ_t s_tj γ_tj / Σ_t s_tj: feature 0 (1 + 3)/2 = 2; feature 1 (3·2 + 1·0)/4 = 1.5;
    # feature 2 reaches no one (s = 0): the plain mean (3 + 1)/2 = 2.
    g1, g2 = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 0.0, 1.0])
    s1, s2 = torch.tensor([1.0, 3.0, 0.0]), torch.tensor([1.0, 1.0, 0.0])
    torch.testing.assert_close(regmean_diagonal([g1, g2], [s1, s2]), torch.tensor([2.0, 1.5, 2.0]))
    # importance (1, 3): (1 + 9)/4 = 2.5; (6 + 0)/6 = 1; weighted mean (3 + 3)/4 = 1.5
    torch.testing.assert_close(regmean_diagonal([g1, g2], [s1, s2], [1.0, 3.0]), torch.tensor([2.5, 1.0, 1.5]))
    # the same as regmean_merge of the (1, d) rows with diagonal Grams
    d1, d2 = torch.diag(s1.double()), torch.diag(s2.double())
    torch.testing.assert_close(regmean_diagonal([g1.double(), g2.double()], [s1, s2]),
                               regmean_merge([g1.double()[None], g2.double()[None]], [d1, d2], alpha=0.5)[0])


def test_merge_tensor_picks_the_rule_from_the_statistics():
    g = t([2.0, 1.0], [1.0, 3.0])
    close(merge_tensor([W1, W2], [g, 2 * g], alpha=1.0), regmean_merge([W1, W2], [g, 2 * g], 1.0))
    n1, n2 = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)
    close(merge_tensor([W1, W2], [n1, n2]), (W1 + W2) / 2)  # an embedding, averaged by default
    close(merge_tensor([W1, W2], [n1, n2], embeddings="regmean"), [[1.0, 2.0], [0.0, 8.0]])  # row 0 from 1, row 1 from 2
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    sa, sb = torch.tensor([1.0, 0.0]), torch.tensor([3.0, 1.0])
    torch.testing.assert_close(merge_tensor([a, b], [sa, sb]), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(merge_tensor([a, b], [sa, sb], norms="regmean"), torch.tensor([2.5, 6.0]))
    torch.testing.assert_close(merge_tensor([a, b], [None, None], norms="regmean"), torch.tensor([2.0, 4.0]))


class _Norm(torch.nn.Module):
    """An RMSNorm as transformers writes one: a 1-D weight and `variance_epsilon`."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.variance_epsilon = 0.0

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4, 2)
        with torch.no_grad():  # token 0 pads (its row must not count), then (1, 1), (3, 0), (0, 2)
            self.emb.weight.copy_(torch.tensor([[5.0, 5.0], [1.0, 1.0], [3.0, 0.0], [0.0, 2.0]]))
        self.norm = _Norm(2)
        self.lin = torch.nn.Linear(2, 1, bias=False)

    def forward(self, input_ids, attention_mask):
        return self.lin(self.norm(self.emb(input_ids)))


def test_collect_stats_counts_tokens_and_normalised_inputs():
    # tokens 1, 2, 3 (the second sequence is padded by one). Their share: (0, 1/3, 1/3, 1/3).
    # Normalised inputs x̂ = x / rms(x): (1, 1), (√2, 0), (0, √2); the norm's moments mean x̂² = (1, 1);
    # the linear layer sees x̂: Gram mean x̂ x̂ᵀ = ([[1, 1], [1, 1]] + [[2, 0], [0, 0]] + [[0, 0], [0, 2]])/3.
    stats = collect_stats(_Tiny(), [[1, 2], [3]], pad_id=0, batch=2)
    assert set(stats) == {"emb.weight", "norm.weight", "lin.weight"}
    close(stats["emb.weight"], [0.0, 1 / 3, 1 / 3, 1 / 3])
    close(stats["norm.weight"], [1.0, 1.0])
    assert all(v.dtype == torch.float32 for v in stats.values())  # STATS_DTYPE: half float64's bytes
    torch.testing.assert_close(stats["lin.weight"], t([1.0, 1 / 3], [1 / 3, 1.0]).float(), rtol=0, atol=1e-6)
    # `hooked` picks modules; `stop` ends each pass after a module: the linear layer never runs
    model = _Tiny()
    assert set(collect_stats(model, [[1, 2], [3]], 0, hooked=lambda n: n == "lin")) == {"lin.weight"}
    assert set(collect_stats(model, [[1, 2], [3]], 0, stop=model.norm)) == {"emb.weight", "norm.weight"}


def test_completion_inputs_are_the_experts_greedy_answers(lab3):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.weights.regmean import lab_prompts, lab_sequences

    lab, _ = lab3
    path = lab["experts"]["add"]
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in lab_prompts("add", 4)]
    assert lab_sequences(model, tok, "add", 4, "prompt") == prompts
    seqs = lab_sequences(model, tok, "add", 4, "completion")
    for p, s in zip(prompts, seqs):
        assert s[: len(p)] == p and len(p) <= len(s) < len(p) + 4 + 2  # add: max_new_tokens 4, + 2 as lm-eval
        with torch.no_grad():  # each completion token is the model's argmax after what precedes it
            logits = model(input_ids=torch.tensor([s])).logits[0]  # (T, V)
        assert logits[len(p) - 1 : len(s) - 1].argmax(-1).tolist() == s[len(p):]


@pytest.fixture(scope="module")
def lab_nl(tmp_path_factory):
    """The fake lab's three experts with their embeddings and norms moved too (the fake lab moves only
    MLP and query weights), so the embedding and norm rules have something to merge."""
    import json

    from transformers import AutoModelForCausalLM

    from opd.io import state_dict_hash
    from opd.lab.pico import build_fake_lab
    from opd.weights.merge import merge_keys

    lab = build_fake_lab(tmp_path_factory.mktemp("lab_nl"), ("add", "rev", "sort"))
    sds = {}
    for i, (name, d) in enumerate(lab["experts"].items()):
        m = AutoModelForCausalLM.from_pretrained(d)
        g = torch.Generator().manual_seed(7 + i)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "embed" in n or "norm" in n:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        m.save_pretrained(d)
        manifest = json.loads((d / "manifest.json").read_text())
        manifest["content_hash"] = state_dict_hash(m)
        (d / "manifest.json").write_text(json.dumps(manifest))
        sds[name] = merge_keys(m.state_dict())
    return lab, sds


def test_regmean_plus_plus_statistics(lab_nl):
    # RegMean++: block l's statistics of expert t are taken on the merged model's inputs to block l
    # through expert t's own block l. Check the definition on the merge itself: put expert t's block 1
    # into the merged model and record block 1's inputs: they are the statistics the merge used.
    from transformers import AutoModelForCausalLM

    from opd.weights import regmean
    from opd.weights.merge import Candidate, merge_candidate

    lab, sds = lab_nl
    paths = {e: str(p) for e, p in lab["experts"].items()}
    shared = {"alpha": 0.8, "prompts": 8, "propagate": "merged", "norms": "regmean", "embeddings": "regmean"}
    cand = Candidate(strategy="regmean", shared=shared, per_model={"rev": {"weight": 2.0}})
    merged = merge_candidate(cand, str(lab["base"]), paths, sds["add"], sds)
    members = [(str(lab["experts"][e].resolve()), 2.0 if e == "rev" else 1.0) for e in paths]
    stats = regmean.STORE.merged[regmean._merged_key(regmean._Settings(shared), members)]
    model = AutoModelForCausalLM.from_pretrained(paths["add"])
    model.load_state_dict(merged, strict=False)  # the tied head follows the embedding
    for e, path in paths.items():
        expert = AutoModelForCausalLM.from_pretrained(path)
        own = regmean.expert_grams(path, prompts=8)
        seqs = regmean.STORE.seqs[regmean.STORE.bound[(str(lab["experts"][e].resolve()), 8, "completion")]]
        kept = model.model.layers[1]
        model.model.layers[1] = expert.model.layers[1]
        want = regmean.collect_stats(model, seqs, 0, hooked=lambda n: n.startswith("model.layers.1."))
        model.model.layers[1] = kept
        got = stats[str(lab["experts"][e].resolve())]
        assert want and all(torch.allclose(got[k], v, rtol=1e-6, atol=1e-9) for k, v in want.items())
        assert not torch.allclose(got["model.layers.1.mlp.up_proj.weight"], own["model.layers.1.mlp.up_proj.weight"])
        # the embedding is merged first, from the experts' own statistics (its tied head's Gram too)
        # (equal, not the same object: the cached statistics are read from disk on access)
        assert torch.equal(got["model.embed_tokens.weight@head"], own["model.embed_tokens.weight@head"])
    # One expert: its merge is itself, so RegMean++'s statistics are its own.
    own = regmean.expert_grams(paths["add"], prompts=8)
    seqs_add = regmean.STORE.seqs[regmean.STORE.bound[(str(lab["experts"]["add"].resolve()), 8, "completion")]]
    one = regmean.merged_stats([AutoModelForCausalLM.from_pretrained(paths["add"])], [seqs_add], [own], 0, 0.8, [1.0])[0]
    assert set(one) == set(own) and all(torch.allclose(one[k], own[k], rtol=1e-6, atol=1e-9) for k in own)


@pytest.mark.parametrize("shared, per", [
    ({"alpha": 0.8, "prompts": 8, "inputs": "prompt", "embeddings": "regmean", "norms": "regmean"}, {}),
    ({"alpha": 0.95, "prompts": 8, "propagate": "merged", "embeddings": "regmean", "norms": "regmean"},
     {"rev": {"weight": 1.5}}),
])
def test_settings_export_tensor_for_tensor(lab_nl, tmp_path, shared, per):
    from opd.weights import regmean
    from opd.weights.merge import Candidate, merge_candidate, mergekit_config, run_mergekit

    lab, sds = lab_nl
    paths = {e: str(p) for e, p in lab["experts"].items()}
    cand = Candidate(strategy="regmean", shared=shared, per_model=per)
    mine = merge_candidate(cand, str(lab["base"]), paths, sds["add"], sds)
    plain = merge_candidate(Candidate(strategy="regmean", shared={**shared, "embeddings": "average",
                                                                   "norms": "average"}, per_model=per),
                            str(lab["base"]), paths, sds["add"], sds)
    for k in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert not torch.allclose(mine[k], plain[k]), k  # the rules act on these
    regmean.STORE.clear()
    run_mergekit(mergekit_config(cand, str(lab["base"]), paths), str(tmp_path / "out"))
    ref = load_file(tmp_path / "out" / "model.safetensors")
    assert set(ref) == set(mine)
    for k in ref:
        assert torch.equal(ref[k], mine[k]), k


def test_settings_are_checked(lab3):
    from opd.errors import OpdError
    from opd.weights.layers import LayerValues
    from opd.weights.regmean import prepare

    lab, _ = lab3
    paths = {"add": str(lab["experts"]["add"])}
    with pytest.raises(OpdError, match="inputs must be one of"):
        prepare(paths, {"inputs": "answers"})
    with pytest.raises(OpdError, match="prompts must be an integer"):
        prepare(paths, {"prompts": 0})
    with pytest.raises(OpdError, match="one weight per expert"):
        prepare(paths, {"propagate": "merged", "prompts": 4},
                {"add": {"weight": LayerValues(embed=1.0, blocks=(1.0,), head=1.0)}})


def test_spill_directories_of_dead_processes_are_swept(tmp_path, monkeypatch):
    """A RegMean process killed by a signal leaves its spill directory (atexit does not run); the next
    one that spills removes it, and leaves a live process's alone."""
    import os
    import subprocess
    import sys
    import tempfile

    from opd.weights.regmean import sweep_dead_spills

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"opd-regmean-{dead.pid}-abc_123"
    mine = tmp_path / f"opd-regmean-{os.getpid()}-xyz"
    other = tmp_path / "opd-regmean-notapid"
    for d in (gone, mine, other):
        (d / "stats-0").mkdir(parents=True)
    sweep_dead_spills()
    assert not gone.exists() and mine.exists() and other.exists()
