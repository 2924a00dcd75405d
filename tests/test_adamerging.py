"""AdaMerging on WUDI: the combination and the KL by hand, the fit lowering its objective from the WUDI
start, registration with mergekit and the strategies, refusals, and a merge of fake experts through
opd's in-memory path and mergekit's run_merge (refitted from nothing, as a fresh export process does)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from opd.weights.adamerging import combine, token_kl


def test_combine_by_hand():
    base = torch.tensor([[1.0, 2.0]])
    start = torch.tensor([[1.0, 1.0]])
    deltas = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]])]
    # 1 + 0.5·1 + 2·1 + (−1)·0 = 3.5;  2 + 0.5·1 + 2·0 + (−1)·2 = 0.5
    torch.testing.assert_close(combine(base, start, deltas, 0.5, [2.0, -1.0]), torch.tensor([[3.5, 0.5]]))
    torch.testing.assert_close(combine(base, start, deltas, 1.0, [0.0, 0.0]), base + start)  # the fit's step 0
    with pytest.raises(ValueError, match="2 task vectors but 1 coefficients"):
        combine(base, start, deltas, 1.0, [1.0])


def test_combine_is_differentiable_in_the_coefficients():
    a = torch.tensor(1.0, requires_grad=True)
    lam = torch.zeros(2, requires_grad=True)
    out = combine(torch.zeros(2), torch.tensor([1.0, 2.0]), [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])],
                  a, lam)
    out.sum().backward()
    assert float(a.grad) == 3.0 and lam.grad.tolist() == [3.0, 4.0]


def test_token_kl_by_hand():
    teacher = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))  # (1, 2, 2)
    student = torch.tensor([[[0.0, math.log(3.0)], [5.0, -5.0]]])  # q = (0.25, 0.75) at position 0
    mask = torch.tensor([[1.0, 0.0]])  # position 1 is not a completion token
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(token_kl(teacher, student, mask)) == pytest.approx(want, abs=1e-6)
    assert float(token_kl(teacher, teacher, torch.ones(1, 2))) == pytest.approx(0.0, abs=1e-7)


SMALL = {"data": 1.0, "prompts": 4, "inputs": "prompt", "samples": 6, "fit_steps": 4, "fit_lr": 0.05,
         "fit_batch": 3}


def _parts(lab, sds):
    """What `prepare` fits on: the base's float tensors, WUDI's start, task vectors, completion batches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.manifest import load_manifest
    from opd.weights import adamerging, wudi

    experts = sorted(lab["experts"], key=lambda e: str(lab["experts"][e].resolve()))
    base = {k: v for k, v in sds["base"].items() if v.is_floating_point()}
    tok = AutoTokenizer.from_pretrained(lab["base"])
    data = [adamerging.completion_batch(AutoModelForCausalLM.from_pretrained(lab["experts"][e]).eval(), tok,
                                        load_manifest(lab["experts"][e]).capability, 6) for e in experts]
    by_path = {str(lab["experts"][e].resolve()): sds[e] for e in experts}
    wudi.prepare({p: p for p in by_path}, {"data": 1.0, "prompts": 4, "inputs": "prompt"})
    start = adamerging._start(base, by_path, 1.0, 4, "prompt")
    deltas = [{k: sds[e][k] - base[k] for k in base} for e in experts]
    return AutoModelForCausalLM.from_pretrained(lab["base"]), base, start, deltas, data


def test_fit_lowers_the_objective_from_the_wudi_start(lab3):
    from opd.weights.adamerging import fit, merged_params, objective

    lab, sds = lab3
    model, base, start, deltas, data = _parts(lab, sds)
    a, lam, losses = fit(model, base, start, deltas, data, steps=0)
    assert losses == [] and all(float(v) == 1.0 for v in a.values()) and not any(v.any() for v in lam.values())
    before = float(objective(model, merged_params(base, start, deltas, a, lam), data))
    assert before > 0  # the WUDI merge is not every expert
    after = {}
    for granularity in ("tensor", "row"):
        a, lam, losses = fit(model, base, start, deltas, data, steps=25, lr=0.05, batch=6, granularity=granularity)
        k = "model.layers.0.mlp.up_proj.weight"
        rows = base[k].shape[0]
        assert lam[k].shape == ((3,) if granularity == "tensor" else (3, rows, 1))
        assert a[k].shape == (() if granularity == "tensor" else (rows, 1))
        assert len(losses) == 25 and lam[k].any()
        with torch.no_grad():
            after[granularity] = float(objective(model, merged_params(base, start, deltas, a, lam), data))
        assert after[granularity] < 0.9 * before, (before, after)
    assert after["row"] < after["tensor"]  # more coefficients fit the experts closer


def test_registered_with_mergekit_and_the_strategies(tmp_path):
    import mergekit.merge_methods as mm

    import opd.merge  # noqa: F401  (registers it)
    from opd.merge.recipe import load_recipe
    from opd.merge.strategies import get_strategy

    assert mm.get("adamerging").spec.name == "adamerging"
    s = get_strategy("adamerging")
    assert s.inputs == "base+experts" and not s.native and s.per_model == {}
    assert s.shared == {"data": 1.0, "prompts": 64, "inputs": "completion", "samples": 128, "fit_steps": 300,
                        "fit_lr": 0.01, "fit_batch": 8, "fit_seed": 0, "granularity": "tensor"}
    assert not s.layerwise  # one fit for the whole model
    hybrid = get_strategy("adamerging+opd")  # OPD's steps and lr are its own, not the fit's
    assert hybrid.shared["fit_steps"] == 300 and hybrid.shared["steps"] != 300
    p = tmp_path / "r.yaml"
    p.write_text("name: x\nexperts: [add]\nstrategies: {adamerging: {fit_lr: [0.003, 0.03], fit_seed: 1}}\n")
    assert load_recipe(p).strategies["adamerging"] == {"fit_lr": (0.003, 0.03), "fit_seed": 1}


@pytest.mark.parametrize("override, words", [
    ("strategies.adamerging={fit_lr: -1}", "'fit_lr' = -1: Input should be greater than or equal to 0"),
    ("strategies.adamerging={fit_batch: 0}", "'fit_batch' = 0: Input should be greater than or equal to 1"),
    ("strategies.adamerging={inputs: answers}", "'inputs' = 'answers'"),
    ("strategies.adamerging={granularity: column}", "'granularity' = 'column'"),
    ("strategies.adamerging={data: {range: [0.0, 1.0], layer_groups: 2}}",
     "'data' cannot be searched per layer group"),
])
def test_bad_recipes_fail_in_one_line(tmp_path, override, words):
    from opd.errors import OpdError
    from opd.merge.recipe import load_recipe

    p = tmp_path / "r.yaml"
    p.write_text("name: x\nexperts: [add]\nstrategies: {adamerging: {}}\n")
    with pytest.raises(OpdError) as e:
        load_recipe(p, [override])
    assert words in str(e.value) and "\n" not in str(e.value) and "r.yaml" in str(e.value)


def test_refuses_to_merge_without_a_fit_or_with_per_layer_settings(lab3):
    import mergekit.merge_methods as mm

    import opd.merge  # noqa: F401
    from opd.errors import OpdError
    from opd.weights.adamerging import prepare

    base = torch.zeros(2, 2)
    with pytest.raises(OpdError, match="adamerging: no fitted coefficients for merge input 'nobody'"):
        mm.merge_tensors([base, base + 1], "adamerging", ids=["base", "nobody"], base_index=0, name="x.weight")
    lab, _ = lab3
    paths = {e: str(p) for e, p in lab["experts"].items()}
    with pytest.raises(OpdError, match="fit_lr must be a number .* for every tensor"):
        prepare(paths, {"fit_lr": [0.1, 0.2]}, base=str(lab["base"]))
    with pytest.raises(OpdError, match="needs the base model's directory"):
        prepare(paths, {})


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_merge_candidate_is_the_fit_and_run_merge_refits_it(lab3, tmp_path, granularity):
    from opd.weights import adamerging, regmean
    from opd.weights.merge import Candidate, merge_candidate, mergekit_config, run_mergekit

    lab, sds = lab3
    experts = list(lab["experts"])
    paths = {e: str(lab["experts"][e]) for e in experts}
    adamerging._FITS.clear()
    cand = Candidate(strategy="adamerging", shared={**SMALL, "granularity": granularity})
    mine = merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in experts})
    # the maths: base + a·WUDI + Σ λ τ with the fitted coefficients, tensor by tensor
    ((a, lam, order),) = adamerging._FITS.values()
    _, base, start, deltas, _ = _parts(lab, sds)
    assert order == sorted(str(p.resolve()) for p in lab["experts"].values())  # _parts' order
    assert set(a) == set(base) and any(v.any() for v in lam.values())
    for k in base:
        torch.testing.assert_close(mine[k], combine(base[k], start[k], [d[k] for d in deltas], a[k], lam[k]),
                                   rtol=0, atol=1e-6)
    # a fresh process (the export) has no fit and no Grams: the YAML pins every setting and run_merge
    # refits the same coefficients, tensor for tensor
    adamerging._FITS.clear()
    adamerging._BOUND.clear()
    regmean.STORE.clear()
    doc = mergekit_config(cand, str(lab["base"]), paths)
    assert doc["merge_method"] == "adamerging" and doc["base_model"] == str(lab["base"])
    assert doc["parameters"] == {**SMALL, "fit_seed": 0, "granularity": granularity}
    run_mergekit(doc, str(tmp_path / "out"))
    ref = load_file(tmp_path / "out" / "model.safetensors")
    assert set(ref) == set(mine)
    for k in ref:
        assert torch.equal(ref[k], mine[k]), k
