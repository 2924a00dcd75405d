"""Merge strategies: mergekit's methods by name; the in-memory merge equals mergekit-yaml's output."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from opd.errors import OpdError
from opd.merge.strategies import STRATEGIES, get_strategy
from opd.weights.merge import Candidate, merge_candidate, mergekit_config, run_mergekit


def test_registry_names_mergekit_methods_and_lists_them_on_error():
    for name in ["linear", "task_arithmetic", "ties", "dare_ties", "dare_linear", "della", "breadcrumbs",
                 "model_stock", "sce", "karcher", "ram", "ramplus_tl", "slerp", "nuslerp"]:
        assert name in STRATEGIES
    assert "density" in get_strategy("ties").per_model and "lambda" in get_strategy("ties").shared
    with pytest.raises(OpdError, match="'tie' is unknown.*'ties'"):
        get_strategy("tie")


def test_input_contracts_are_checked_before_work():
    with pytest.raises(OpdError, match="exactly two models"):
        get_strategy("slerp").check_inputs(3)
    with pytest.raises(OpdError, match="model_stock"):
        get_strategy("model_stock").check_inputs(1)
    get_strategy("ties").check_inputs(3)


CASES = [
    ("linear", {}, {"weight": 0.7}, 3),
    ("task_arithmetic", {"lambda": 0.8}, {"weight": 0.6}, 3),
    ("ties", {}, {"weight": 0.9, "density": 0.4}, 3),
    ("breadcrumbs", {}, {"weight": 0.9, "density": 0.8, "gamma": 0.02}, 3),
    ("dare_ties", {}, {"weight": 0.9, "density": 0.5}, 3),  # randomised: mergekit's own RNG order
    ("della", {}, {"weight": 0.9, "density": 0.5, "epsilon": 0.1}, 3),
    ("model_stock", {}, {}, 3),
    ("karcher", {}, {}, 3),
    ("sce", {"select_topk": 0.5}, {"weight": 1.0}, 3),
    ("slerp", {"t": 0.3}, {}, 2),
    ("nuslerp", {}, {"weight": 0.5}, 2),
]


@pytest.mark.parametrize("method, shared, per, n", CASES, ids=[c[0] for c in CASES])
def test_in_memory_merge_equals_run_merge(lab3, tmp_path, method, shared, per, n):
    lab, sds = lab3
    experts = list(lab["experts"])[:n]
    st = get_strategy(method)
    cand = Candidate(strategy=method, shared=shared, seed=5,
                     per_model={e: {k: v for k, v in per.items() if k in st.per_model} for e in experts})
    paths = {e: str(lab["experts"][e]) for e in experts}
    mine = merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in experts})
    run_mergekit(mergekit_config(cand, str(lab["base"]), paths), str(tmp_path / "out"), seed=5)
    ref = load_file(tmp_path / "out" / "model.safetensors")
    assert set(ref) == set(mine)
    for k in ref:
        assert torch.equal(ref[k], mine[k]), k
    assert not torch.equal(mine["model.layers.0.mlp.up_proj.weight"], sds["base"]["model.layers.0.mlp.up_proj.weight"])
