"""Layer-wise merge parameters: a value per layer group (embeddings, block gradient, head), searched by
Optuna, merged in memory, and exported as the mergekit setting that `run_merge` turns into the same weights."""

from __future__ import annotations

import json

import optuna
import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_merge_fakes import PICO, build_fake_lab, write_recipe

from opd.merge.recipe import load_recipe
from opd.weights.layers import LayerValues, layout_for
from opd.weights.merge import Candidate, merge_candidate, merge_keys, mergekit_config, run_mergekit

LAYERS = 5  # enough blocks for a 3-point gradient to interpolate between its points


@pytest.fixture(scope="module")
def lab5(tmp_path_factory):
    """A fake lab of 5-layer pico models (experts add, rev) and their merge-key state dicts."""
    from transformers import AutoModelForCausalLM

    lab = build_fake_lab(tmp_path_factory.mktemp("lab5"), ("add", "rev"),
                         shape=PICO.model_copy(update={"num_hidden_layers": LAYERS}))
    sds = {n: merge_keys(AutoModelForCausalLM.from_pretrained(p).state_dict()) for n, p in
           [("base", lab["base"]), *lab["experts"].items()]}
    return lab, sds


def test_layout_is_mergekits_architecture(lab5):
    lab, sds = lab5
    layout = layout_for(str(lab["base"]))
    assert layout.pre == ("model.embed_tokens.weight",)
    assert layout.post == ("model.norm.weight", "lm_head.weight")  # lm_head: optional, tied here
    assert layout.num_layers == LAYERS and layout.layer["model.layers.3.mlp.up_proj.weight"] == 3
    # every tensor the search merges sits in one group
    assert all(k in layout.layer or k in layout.pre or k in layout.post for k in sds["base"])


def test_each_group_gets_its_value(lab5):
    """linear without normalising on one expert is weight * expert, so each tensor shows the weight
    it got. Blocks [0, 1, 0.25] over 5 layers: layer i sits at t = i/4, i.e. at i/2 on the points, so
    layers 0..4 get 0, (0+1)/2, 1, (1+0.25)/2, 0.25; embeddings 0.5, final norm 2."""
    lab, sds = lab5
    w = LayerValues(embed=0.5, blocks=(0.0, 1.0, 0.25), head=2.0)
    cand = Candidate(strategy="linear", shared={"normalize": False}, per_model={"add": {"weight": w}})
    merged = merge_candidate(cand, str(lab["base"]), {"add": str(lab["experts"]["add"])}, sds["base"],
                             {"add": sds["add"]})
    x = sds["add"]
    assert torch.allclose(merged["model.embed_tokens.weight"], 0.5 * x["model.embed_tokens.weight"])
    assert torch.allclose(merged["model.norm.weight"], 2.0 * x["model.norm.weight"])
    for i, expected in enumerate([0.0, 0.5, 1.0, 0.625, 0.25]):
        for name in ("mlp.up_proj.weight", "self_attn.q_proj.weight", "input_layernorm.weight"):
            k = f"model.layers.{i}.{name}"
            assert torch.allclose(merged[k], expected * x[k], rtol=1e-6, atol=0), k


CASES = [  # shared and per-expert values, a randomised method (run through run_merge), one value per block
    ("ties", {"lambda": LayerValues(embed=0.5, blocks=(0.3, 0.9, 0.4), head=1.2)},
     {"weight": 0.9, "density": LayerValues(embed=0.6, blocks=(0.2, 1.0), head=0.7)}),
    ("dare_ties", {}, {"weight": LayerValues(embed=1.0, blocks=(0.5, 1.0), head=0.8), "density": 0.5}),
    ("linear", {}, {"weight": LayerValues(embed=0.6, blocks=(0.2, 1.0, 0.5, 0.1, 0.3), head=0.7)}),
    # opd's data-aware method, data-free on the first block only: its Grams are read for the others
    ("wudi", {"data": LayerValues(embed=0.0, blocks=(0.0, 3.0), head=0.0), "prompts": 4, "inputs": "prompt"},
     {"weight": LayerValues(embed=1.0, blocks=(0.5, 1.0), head=0.8)}),
]


@pytest.mark.parametrize("method, shared, per", CASES, ids=[c[0] for c in CASES])
def test_layerwise_merge_equals_run_merge(lab5, tmp_path, method, shared, per):
    lab, sds = lab5
    # each expert its own points, so that a value applied to the wrong input or tensor shows
    per_model = {e: {k: (v.model_copy(update={"blocks": tuple(b * (1 + j) / 2 for b in v.blocks)})
                         if isinstance(v, LayerValues) else v) for k, v in per.items()}
                 for j, e in enumerate(lab["experts"])}
    cand = Candidate(strategy=method, shared=shared, per_model=per_model, seed=4)
    paths = {e: str(p) for e, p in lab["experts"].items()}
    mine = merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in paths})
    config = mergekit_config(cand, str(lab["base"]), paths)
    config = yaml.safe_load(yaml.safe_dump(config))  # as written to mergekit.yaml
    run_mergekit(config, str(tmp_path / "out"), seed=4)
    ref = load_file(tmp_path / "out" / "model.safetensors")
    assert set(ref) == set(mine)
    for k in ref:
        assert torch.equal(ref[k], mine[k]), k
    # the YAML is the setting a user would write: filtered ends, a gradient over the blocks
    setting = config["models"][-1]["parameters"]["weight" if method != "ties" else "density"]
    assert setting[0] == {"filter": "model.embed_tokens.weight", "value": setting[0]["value"]}
    assert isinstance(setting[-1]["value"], list) and "filter" not in setting[-1]


def test_search_suggests_one_value_per_group_and_export_rebuilds_it(lab5, tmp_path):
    """A recipe's `{range, layer_groups}` becomes one Optuna float per group; the candidate round-trips
    through JSON (results.json) and `python -m opd.merge export` rebuilds it with run_merge."""
    from opd.merge.export import export_trial
    from opd.merge.space import suggest

    lab, _ = lab5
    path = write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", strategies={
        "ties": {"density": {"range": [0.2, 0.9], "layer_groups": 3}, "weight": [0.5, 1.0]}})
    recipe = load_recipe(path)
    study = optuna.create_study(directions=["maximize"], sampler=optuna.samplers.RandomSampler(seed=1))
    trial = study.ask()
    cand = suggest(trial, recipe, list(lab["experts"]))
    d = cand.per_model["add"]["density"]
    assert isinstance(d, LayerValues) and len(d.blocks) == 3 and 0.2 <= min(d.blocks) <= max(d.blocks) <= 0.9
    assert d.embed == trial.params["ties.density.add@embed"] and d.blocks[2] == trial.params["ties.density.add@block2"]
    assert d.head == trial.params["ties.density.add@head"] and "ties.weight.rev" in trial.params
    assert Candidate.model_validate(json.loads(json.dumps(cand.model_dump(mode="json")))) == cand
    assert "density=[" in cand.label()

    recipe.out_dir.mkdir(parents=True)
    (recipe.out_dir / "results.json").write_text(json.dumps({
        "recipe": recipe.model_dump(mode="json"),
        "trials": [{"number": 0, "candidate": cand.model_dump(mode="json")}]}))
    out = export_trial(recipe.out_dir, 0, log=lambda *a: None)
    m = json.loads((out / "manifest.json").read_text())
    assert m["reproduced"]["max_abs_diff"] == 0.0 and m["reproduced"]["tensors"] > 0
    exported = yaml.safe_load((out / "mergekit.yaml").read_text())
    assert exported["models"][1]["parameters"]["density"][-1] == {"value": list(d.blocks)}


def test_warm_start_keeps_layer_group_values_in_range(lab5, tmp_path):
    """A rerun after an expert changed enqueues the earlier best's per-group values that lie in the
    recipe's range; one outside it (block0) is left for the sampler, like a scalar would be."""
    from opd.merge.history import warm_params

    lab, _ = lab5
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", strategies={
        "ties": {"density": {"range": [0.2, 0.9], "layer_groups": 2}, "weight": [0.5, 1.0]}}))
    params = {"ties.density.add@embed": 0.5, "ties.density.add@block0": 0.95, "ties.density.add@head": 0.3,
              "ties.weight.add": 0.7, "ties.weight.add@embed": 0.7}
    prev = {"trials": [{"number": 2, "params": params}],
            "final": {"#2 ties": {"trial": 2, "candidate": {"strategy": "ties"}}}}
    assert warm_params(prev, recipe, list(lab["experts"]), 5) == [
        (2, {"ties.density.add@embed": 0.5, "ties.density.add@head": 0.3, "ties.weight.add": 0.7})]
