"""Merges that stream tensor by tensor from safetensors (opd.weights.lazy, opd.weights.merge), the
search's memory_budget (a candidate over it is merged to disk and scored from there), and the fast
path of bench/bench_scale.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from mergekit.merge_methods import merge_state_dicts

from opd.weights.lazy import LazyStateDict, load_into, state_dict_bytes
from opd.weights.merge import Candidate, _layout, _method, _per_model_params, merge_candidate, merge_in_memory

REPO = Path(__file__).resolve().parents[1]


class _Counting:
    """safetensors.safe_open that counts get_tensor calls (the reads a lazy state dict makes)."""

    calls = 0

    def __init__(self, *a, **kw):
        self._f = _ORIGINAL(*a, **kw)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def get_tensor(self, name):
        type(self).calls += 1
        return self._f.get_tensor(name)

    def __getattr__(self, name):
        return getattr(self._f, name)


_ORIGINAL = safetensors.safe_open


def test_lazy_state_dict_reads_a_tensor_only_when_indexed(lab3, monkeypatch):
    lab, sds = lab3
    monkeypatch.setattr(safetensors, "safe_open", _Counting)
    _Counting.calls = 0
    lazy = LazyStateDict(lab["experts"]["add"], names=list(sds["add"]))
    # the tied lm_head is no stored tensor, and no merge key either (merge_keys drops the alias)
    assert list(lazy) == list(sds["add"]) and "lm_head.weight" not in lazy
    assert len(lazy) == len(sds["add"]) and lazy.nbytes() == state_dict_bytes(sds["add"])
    assert _Counting.calls == 0  # names, sizes and headers read no tensor
    k = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(lazy[k], sds["add"][k]) and _Counting.calls == 1
    assert lazy[k].dtype == torch.float32 and _Counting.calls == 2  # nothing kept: read again
    with pytest.raises(KeyError):
        lazy["lm_head.weight"]


def _reference(cand, base_sd, expert_sds):
    """The whole-model in-memory merge the search did before streaming: one merge_state_dicts call."""
    m = _method(cand)
    ids, base = _layout(m, list(expert_sds))
    models = {i: (base_sd if i == "base" else expert_sds[i]) for i in ids}
    params = {**cand.shared, **_per_model_params(cand, m, list(expert_sds), base)}
    with torch.no_grad():
        return merge_state_dicts(models, m.name, parameters=params, base=base)


CASES = [
    ("linear", {}, {"weight": 0.7}),
    ("task_arithmetic", {"lambda": 0.8}, {"weight": 0.6}),
    ("ties", {}, {"weight": 0.9, "density": 0.4}),
    ("tsv_m", {"alpha": 0.9}, {"weight": 1.0}),
    ("iso_cts", {"alpha": 1.1, "common_space_fraction": 0.7}, {"weight": 1.0}),
    ("regmean", {"alpha": 0.8, "prompts": 8, "inputs": "prompt"}, {"weight": 1.0}),
]


@pytest.mark.parametrize("method, shared, per", CASES, ids=[c[0] for c in CASES])
def test_streamed_merge_equals_the_whole_model_merge_bit_for_bit(lab3, tmp_path, monkeypatch, method, shared, per):
    """Lazy inputs, one tensor per mergekit call, and the candidate written to disk all give the very
    tensors of one whole-model merge_state_dicts call: each method merges tensor by tensor (a group is
    one tensor name), and mergekit's batching of same-shaped tensors computes each element alike.
    With a run smaller than any tensor, every tensor is merged one input (or one block of rows) at a
    time (opd.weights.lazy.merge_streamed): the elementwise merges (linear, task arithmetic, the subspace
    methods' and RegMean's averages of vectors and vocabulary matrices) and TIES (after each task
    vector's cut) a block of rows at a time, TSV-M and Iso-CTS from each task's singular factors,
    RegMean from running sums: the same numbers."""
    lab, sds = lab3
    by_rows = set()
    rows = LazyStateDict.rows
    monkeypatch.setattr(LazyStateDict, "rows", lambda self, n, lo, hi: by_rows.add(n) or rows(self, n, lo, hi))
    experts = list(lab["experts"])
    paths = {e: str(lab["experts"][e]) for e in experts}
    cand = Candidate(strategy=method, shared=shared, per_model={e: dict(per) for e in experts})
    eager = merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in experts})  # prepares
    ref = _reference(cand, sds["base"], {e: sds[e] for e in experts})
    lazy_base = LazyStateDict(lab["base"], names=list(sds["base"]))
    lazy = {e: LazyStateDict(lab["experts"][e], names=list(sds[e])) for e in experts}
    one_by_one = merge_in_memory(cand, lazy_base, lazy, chunk_bytes=1)  # a run of one tensor each
    on_disk = merge_candidate(cand, str(lab["base"]), paths, lazy_base, lazy, out_dir=tmp_path / "cand")
    assert isinstance(on_disk, LazyStateDict) and sorted(p.name for p in (tmp_path / "cand").iterdir())
    assert list(eager) == list(ref) == list(one_by_one) == list(on_disk)
    for k in ref:
        assert torch.equal(eager[k], ref[k]) and torch.equal(one_by_one[k], ref[k]), k
        assert torch.equal(on_disk[k], ref[k]), k
    assert not torch.equal(ref["model.layers.0.mlp.up_proj.weight"], sds["base"]["model.layers.0.mlp.up_proj.weight"])
    subspace_rows = {k for k in ref if ref[k].ndim != 2 or "embed" in k}  # what TSV-M / Iso do not decompose
    # TIES reads every tensor by rows after its per-expert cut; RegMean its averaged tensors (no Gram)
    want = {"linear": set(ref), "task_arithmetic": set(ref), "tsv_m": subspace_rows, "iso_cts": subspace_rows,
            "ties": set(ref), "regmean": subspace_rows}
    assert by_rows == want.get(method, set()) and "model.embed_tokens.weight" in subspace_rows


def test_ties_over_the_sort_cache_sorts_one_tensor_at_a_time_with_the_same_result(lab3, monkeypatch):
    """Task vectors larger than the sort cache: the merge keeps a cache of one tensor's size instead
    (memory of one sorted tensor, not the default cache's full size); the tensors are the same."""
    from opd.weights import sort_cache

    lab, sds = lab3
    experts = list(lab["experts"])
    cand = Candidate(strategy="ties", per_model={e: {"weight": 0.9, "density": 0.4} for e in experts})
    ref = _reference(cand, sds["base"], {e: sds[e] for e in experts})
    monkeypatch.setattr(sort_cache.CACHE, "max_bytes", 1000)
    used = []
    original = sort_cache.SortedMagnitudes.get
    monkeypatch.setattr(sort_cache.SortedMagnitudes, "get", lambda self, w: used.append(self) or original(self, w))
    merged = merge_in_memory(cand, sds["base"], {e: sds[e] for e in experts})
    assert used and all(c is not sort_cache.CACHE and c.bytes <= c.max_bytes for c in used)
    for k in ref:
        assert torch.equal(merged[k], ref[k]), k


def test_regmean_statistics_are_held_on_disk(lab3):
    from opd.weights import regmean

    lab, _ = lab3
    regmean.prepare({e: str(p) for e, p in lab["experts"].items()}, {"prompts": 8, "inputs": "prompt"})
    assert regmean.STORE.stats and all(isinstance(s, LazyStateDict) for s in regmean.STORE.stats.values())
    assert all(isinstance(m[0], str) for m in regmean.STORE.models.values())  # no model kept in memory


def _inputs(lab, tmp_path, budget):
    from opd.merge.recipe import MergeRecipe, load_inputs

    recipe = MergeRecipe(name="mem", base=str(lab["base"]), experts=[str(p) for p in lab["experts"].values()],
                         strategies={"ties": {"density": 0.5}}, memory_budget=budget, out=str(tmp_path / "run"))
    return load_inputs(recipe)


def test_memory_budget_below_the_candidate_goes_through_disk_with_the_same_scores(lab3, tmp_path):
    from opd.merge.references import Scorer
    from opd.merge.strategies import get_strategy

    lab, sds = lab3
    roomy, tight = _inputs(lab, tmp_path / "a", "1GB"), _inputs(lab, tmp_path / "b", 1000)
    assert tight.memory_budget == 1000 and roomy.memory_budget == 10**9
    assert all(isinstance(s, LazyStateDict) for s in tight.expert_sds.values())  # experts read on access
    cand = Candidate(strategy="ties", shared={}, per_model={e: {"weight": 1.0, "density": 0.5} for e in lab["experts"]})
    in_memory, _ = get_strategy("ties").build(roomy, cand)
    spilled, _ = get_strategy("ties").build(tight, cand)
    assert isinstance(in_memory, dict) and isinstance(spilled, LazyStateDict)
    assert spilled.path == tmp_path / "b" / "run" / "spill" / "candidate"
    assert state_dict_bytes(spilled) > 1000
    for k in in_memory:
        assert torch.equal(in_memory[k], spilled[k]), k
    caps = roomy.capabilities
    a = Scorer(roomy, 64).score(in_memory, "val", limit=24, caps=caps)
    b = Scorer(tight, 64).score(spilled, "val", limit=24, caps=caps)
    assert {c: (s.score, s.n) for c, s in a.items()} == {c: (s.score, s.n) for c, s in b.items()}
    # the scorer's model holds the candidate, tied head included
    model = tight.base_model
    load_into(model, spilled)
    assert torch.equal(model.lm_head.weight, spilled["model.embed_tokens.weight"])


def test_memory_budget_takes_sizes_and_refuses_nonsense():
    from pydantic import ValidationError

    from opd.merge.recipe import MergeRecipe

    base = dict(name="m", experts=["x"], strategies={"linear": {}})
    assert MergeRecipe(**base, memory_budget="8GB").memory_budget == 8 * 10**9
    assert MergeRecipe(**base, memory_budget="512MiB").memory_budget == 512 << 20
    assert MergeRecipe(**base).memory_budget == 16 << 30
    with pytest.raises(ValidationError, match="not a size"):
        MergeRecipe(**base, memory_budget="lots")


def test_bench_scale_fast_path_prints_the_final_line(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "bench" / "bench_scale.py"), "--tiny", "--jobs", "2",
                          "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"peak_rss_over_model: \d+\.\d\d", lines[-1]), out.stdout[-2000:]
    for method in ("linear", "ties", "tsv_m", "iso_cts", "regmean"):
        assert any(line.split()[:1] == [method] for line in lines), (method, out.stdout)


def test_a_search_over_its_memory_budget_scores_from_disk_as_one_in_memory(tmp_path, monkeypatch):
    """The whole search with every candidate over memory_budget (merged to <out>/spill/, scored from
    there) gives the trials, scores and best model of the same search in memory; the spill directory
    is gone at the end."""
    import json

    from safetensors.torch import load_file
    from test_merge_fakes import build_fake_lab, write_recipe

    from opd.merge.recipe import load_recipe
    from opd.merge.search import run_recipe
    from opd.merge.strategies import mergekit_methods

    spilled = []
    original = mergekit_methods.merge_candidate
    monkeypatch.setattr(mergekit_methods, "merge_candidate",
                        lambda *a: spilled.append(a[-1]) or original(*a))  # a[-1]: out_dir (None: in memory)
    lab = build_fake_lab(tmp_path / "lab")
    results = {}
    for name, budget in (("roomy", "16GiB"), ("tight", 1000)):
        out = tmp_path / name
        recipe = load_recipe(write_recipe(tmp_path / f"{name}.yaml", lab, out, memory_budget=budget,
                                          budget={"n_trials": 2}, final_candidates=1, screening={"limit": None},
                                          strategies={"ties": {"density": [0.3, 1.0]}}))
        run_recipe(recipe, live=False, log=lambda _: None)
        assert not (out / "spill").exists()
        results[name] = json.loads((out / "results.json").read_text())
        results[name]["weights"] = load_file(next((out / "best").glob("*.safetensors")))
    n = len(spilled) // 2
    assert n and spilled[:n] == [None] * n
    assert all(p == tmp_path / "tight" / "spill" / "candidate" for p in spilled[n:])
    a, b = results["roomy"], results["tight"]
    assert [(t["candidate"], t["scores"]) for t in a["trials"]] == [(t["candidate"], t["scores"]) for t in b["trials"]]
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
