"""Merge recipes: every shipped recipe loads; bad ones fail with one line naming the field."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from opd.errors import OpdError
from opd.merge.recipe import load_recipe

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("merge_recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_load(path, monkeypatch):
    monkeypatch.chdir(path.parents[1])  # recipes name paths (base, include_path) from the repo root
    r = load_recipe(path)
    assert r.split == "val" and r.strategies
    assert str(r.out_dir) == f"runs/merge/{r.name}"
    assert r.storage_url.startswith("sqlite:///") and r.storage_url.endswith("study.db")


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


BASIC = "name: x\nexperts: [add]\nstrategies: {ties: {density: [0.2, 1.0], weight: 1.0}}\n"


def test_overrides_are_dotted_and_parsed_as_yaml(tmp_path):
    r = load_recipe(_write(tmp_path, BASIC), ["budget.n_trials=7", "strategies.ties.density=[0.5, 0.9]",
                                              "storage=postgresql://h/db", "screening.limit=null"])
    assert r.budget.n_trials == 7
    assert r.strategies["ties"]["density"] == (0.5, 0.9)
    assert r.storage_url == "postgresql://h/db"
    assert r.screening.limit is None
    with pytest.raises(pydantic.ValidationError):
        r.seed = 3  # frozen


def test_layerwise_spec_validates(tmp_path):
    from opd.merge.recipe import LayerRange

    r = load_recipe(_write(tmp_path, BASIC), ["strategies.ties.density={range: [0.2, 0.9], layer_groups: 3}"])
    assert r.strategies["ties"]["density"] == LayerRange(range=(0.2, 0.9), layer_groups=3)
    assert r.model_dump(mode="json")["strategies"]["ties"]["density"] == {"range": [0.2, 0.9], "layer_groups": 3}
    # a hybrid's merge half too
    r = load_recipe(_write(tmp_path, BASIC), ["strategies.ties+opd={density: {range: [0.2, 0.9], layer_groups: 2}}"])
    assert r.strategies["ties+opd"]["density"].layer_groups == 2


@pytest.mark.parametrize("override, words", [
    ("split=test", "val' only"),
    ("bogus=1", "field 'bogus': unknown field"),
    ("strategies.nope={}", "'nope' is unknown"),
    ("strategies.ties.t=0.5", "has no parameter 't'"),
    ("strategies.slerp={}", "needs a value or range for 't'"),
    ("strategies.regmean={inputs: answers}", "'inputs' = 'answers': Input should be 'prompt' or 'completion'"),
    ("budget.n_trials=null", "give n_trials, timeout_s"),
    ("capabilities=[nosuchcap]", "nosuchcap"),
    ("noequals", "expected key=value"),
    ("strategies.ties.density={range: [0.2, 0.9], layer_groups: 0}",
     "'strategies.ties.density.layers.layer_groups': Input should be greater than or equal to 1"),
    ("strategies.ties.density={range: [0.9, 0.2], layer_groups: 2}", "range for 'density' must be [low, high]"),
    ("strategies.ties.density={range: [0.2, 0.9, 1.0], layer_groups: 2}", "density.layers.range"),
    ("strategies.ties.int8_mask={range: [0, 1], layer_groups: 2}",
     "'int8_mask' cannot be searched per layer group; its float parameters can: ['density', 'lambda', 'weight']"),
    ("strategies.opd={lr: {range: [0.001, 0.01], layer_groups: 2}}",
     "'lr' cannot be searched per layer group; only a weight-space merge method's float parameters can"),
])
def test_bad_recipes_fail_in_one_line(tmp_path, override, words):
    with pytest.raises(OpdError) as e:
        load_recipe(_write(tmp_path, BASIC), [override])
    assert words in str(e.value) and "\n" not in str(e.value)
    assert "r.yaml" in str(e.value) or "=" not in override
