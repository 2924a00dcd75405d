"""Merges of one tensor read one input (or one block of rows) at a time (opd.weights.lazy.merge_streamed):
the same numbers as mergekit's method on the whole tensor, and what they hold does not grow with the
number of experts. RegMean's float32 statistics against float64, and its statistics store (#31)."""

from __future__ import annotations

import weakref
from collections import OrderedDict

import pytest
import safetensors
import torch
from mergekit.merge_methods import merge_state_dicts
from safetensors.torch import save_file

from opd.weights import lazy, regmean, subspace
from opd.weights.lazy import LazyStateDict, TensorInputs
from opd.weights.merge import Candidate, merge_in_memory

SHAPES = {"model.embed_tokens.weight": (64, 16), "model.layers.0.mlp.up_proj.weight": (48, 16),
          "model.layers.0.mlp.down_proj.weight": (16, 48), "model.norm.weight": (16,)}


def _models(tmp_path, n: int, seed: int = 0) -> dict[str, LazyStateDict]:
    """A base and n experts (base + a dense random update) as safetensors directories, read lazily."""
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    out = {}
    for i in ["base", *(f"e{j}" for j in range(n))]:
        d = tmp_path / f"{i}-{n}"
        d.mkdir()
        sd = base if i == "base" else {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        save_file(sd, str(d / "model.safetensors"))
        out[i] = LazyStateDict(d, names=list(SHAPES))
    return out


def _whole(models: dict, method: str, params: dict, base: str | None = "base") -> dict[str, torch.Tensor]:
    """mergekit's method over the whole model, every input in memory."""
    ids = list(models) if base else [i for i in models if i != "base"]
    return merge_state_dicts({i: dict(models[i].items()) for i in ids}, method, parameters=params, base=base)


TIES = [({"weight": 0.9, "density": 0.4}, {}),
        ({"weight": 1.3, "density": 0.15}, {"normalize": False, "lambda": 0.7}),
        ({"weight": 0.5, "density": 0.6}, {"rescale": True}),
        ({"weight": 1.0, "density": 1.0}, {})]


@pytest.mark.parametrize("per, shared", TIES)
def test_ties_by_rows_is_mergekits_ties_on_the_whole_tensor(tmp_path, per, shared):
    """Each task vector's cut taken over the whole tensor one expert at a time, then blocks of a few
    rows through mergekit's TIES with density 1: element for element mergekit's TIES."""
    models = _models(tmp_path, 3)
    experts = [i for i in models if i != "base"]
    params = {**shared, **{p: {e: v for e in experts} for p, v in per.items()}}
    want = _whole(models, "ties", params)
    for name in SHAPES:
        got = lazy.ties(TensorInputs(models, list(models), name, "base"), params, budget=2000)  # 1-2 rows a block
        if shared.get("rescale"):  # its L1 sums are added block by block
            torch.testing.assert_close(got, want[name], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want[name]), name


def test_ties_cut_keeps_the_first_tied_magnitudes_in_row_order():
    # |δ| = 2 once and 1 five times; density 0.5 keeps k = 3: the 2 and the first two 1s in row-major
    # order, as a stable argsort keeps them; a block of one row at a time gives the same mask.
    delta = torch.tensor([[1.0, -1.0, 0.0], [1.0, 2.0, -1.0], [0.0, 0.0, 1.0]])
    zero = torch.zeros_like(delta)
    inp = TensorInputs({"base": {"x": zero}, "e": {"x": delta}}, ["base", "e"], "x", "base")
    trim = lazy._trim(inp, "e", density=3 / 9, rescale=False, step=1)
    got = torch.cat([trim.apply(delta[r:r + 1]) for r in range(3)])
    keep = torch.argsort(delta.abs().reshape(-1), descending=True, stable=True)[:3]
    want = torch.zeros(9)
    want[keep] = 1
    assert torch.equal(got, delta * want.reshape(3, 3))
    assert torch.equal(got, torch.tensor([[1.0, -1.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("density", [0.001, 0.3, 0.5, 0.8])
def test_ties_cut_is_the_kth_largest_magnitude(density):
    """The two-histogram search finds the k-th largest |δ| exactly, also at zero (half of δ is 0)."""
    g = torch.Generator().manual_seed(3)
    delta = torch.randn(40, 25, generator=g) * (torch.rand(40, 25, generator=g) < 0.5)
    inp = TensorInputs({"base": {"x": torch.zeros_like(delta)}, "e": {"x": delta}}, ["base", "e"], "x", "base")
    trim = lazy._trim(inp, "e", density=density, rescale=False, step=3)
    whole = lazy._trim(inp, "e", density=density, rescale=False, step=3, budget=10**6)  # kthvalue
    assert (whole.t, whole.ties) == (trim.t, trim.ties)
    k = max(1, int(density * delta.numel()))
    w = delta.abs().reshape(-1)
    assert trim.t == torch.kthvalue(w, w.numel() - k + 1).values.item()
    assert trim.ties == k - int((w > trim.t).sum())
    kept = torch.cat([trim.apply(delta[r:r + 3]) for r in range(0, 40, 3)])
    assert int((kept != 0).sum()) == min(k, int((delta != 0).sum()))


def test_read_gives_the_indexed_tensors_opening_each_file_once(tmp_path, monkeypatch):
    sd = _models(tmp_path, 1)["e0"]
    opened = []
    original = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **kw: opened.append(a[0]) or original(*a, **kw))
    names = list(sd)[::-1]  # any order: the mapping keeps it
    got = sd.read(names)
    assert list(got) == names and len(opened) == 1 and sd.reads == len(names)
    for name in names:
        assert torch.equal(got[name], sd[name]) and got[name].dtype == torch.float32
    with pytest.raises(KeyError):
        sd.read(["lm_head.weight"])


class _Live:
    """Bytes of tensors read from the lazy inputs that are still alive, and the most at once."""

    def __init__(self, monkeypatch):
        self.now = self.peak = 0
        get, rows, read = LazyStateDict.__getitem__, LazyStateDict.rows, LazyStateDict.read
        monkeypatch.setattr(LazyStateDict, "__getitem__", lambda sd, n: self.track(get(sd, n)))
        monkeypatch.setattr(LazyStateDict, "rows", lambda sd, n, lo, hi: self.track(rows(sd, n, lo, hi)))
        monkeypatch.setattr(LazyStateDict, "read", lambda sd, ns: {k: self.track(t) for k, t in read(sd, ns).items()})

    def track(self, t: torch.Tensor) -> torch.Tensor:
        size = t.numel() * t.element_size()
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._free, size)
        return t

    def _free(self, size: int) -> None:
        self.now -= size


BUDGET = 12_000  # bytes of a run: below 3 copies of the embedding (4 KiB each)
CASES = [("linear", {}, {"weight": 0.7}), ("ties", {}, {"weight": 0.9, "density": 0.4}),
         ("tsv_m", {"alpha": 0.9}, {"weight": 1.0}), ("iso_c", {"alpha": 1.0}, {"weight": 1.0}),
         ("iso_cts", {"alpha": 1.1, "common_space_fraction": 0.7}, {"weight": 1.0})]


@pytest.mark.parametrize("method, shared, per", CASES, ids=[c[0] for c in CASES])
def test_streamed_merge_holds_the_same_input_bytes_for_2_and_8_experts(tmp_path, monkeypatch, method, shared, per):
    """A merge holds at most its run's bytes of inputs, whatever N: a tensor whose N copies exceed
    them is read one input at a time (the subspace methods' matrices), or one block of rows of every
    input, the block's height shrinking as N grows. The merged tensors are mergekit's whole-model
    merge's, up to float rounding (1 ulp seen at N = 8: torch orders a block's sum over the inputs
    by its shape)."""
    peaks = {}
    for n in (2, 8):
        models = _models(tmp_path, n, seed=n)
        experts = [i for i in models if i != "base"]
        cand = Candidate(strategy=method, shared=shared, per_model={e: dict(per) for e in experts})
        live = _Live(monkeypatch)
        got = merge_in_memory(cand, models["base"], {e: models[e] for e in experts}, chunk_bytes=BUDGET)
        peaks[n] = live.peak
        monkeypatch.undo()
        params = {**shared, **{p: {e: v for e in experts} for p, v in per.items()}}
        want = _whole(models, method, params, base=None if method == "linear" else "base")
        for k in SHAPES:  # torch's sum over N rows of a block may add in another order than over the whole
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=f"{method} {n} {k}")
    assert max(peaks.values()) <= BUDGET and peaks[8] <= 1.25 * peaks[2], peaks


def test_subspace_streamed_reads_each_task_matrix_once_or_twice():
    g = torch.Generator().manual_seed(1)
    ds = [torch.randn(30, 20, generator=g) for _ in range(6)]
    reads = []

    def delta(t):
        reads.append(t)
        return ds[t]

    assert torch.equal(subspace.tsv_m_streamed(delta, 6, 0.8), subspace.tsv_m(ds, 0.8))
    assert reads.count(3) == 1 or reads.count(3) == 2  # the first is read once more for its shape
    reads.clear()
    assert torch.equal(subspace.iso_cts_streamed(delta, 6, 1.2, 0.6), subspace.iso_cts(ds, 1.2, 0.6))
    assert reads.count(3) == 2  # the sum and tolerance, then the task-specific factors
    assert torch.equal(subspace.iso_cts_streamed(delta, 6, 1.2, iso_c_rule=True), subspace.iso_c(ds, 1.2))


def test_regmean_running_sums_are_regmean_merge():
    g = torch.Generator().manual_seed(2)
    ws = [torch.randn(5, 4, generator=g) for _ in range(3)]
    xs = [torch.randn(9, 4, generator=g) for _ in range(3)]
    grams = [regmean.grams_from_inputs(x) for x in xs]
    models = {f"e{i}": {"w": w, "b": w[0]} for i, w in enumerate(ws)}
    inp = TensorInputs(models, list(models), "w")
    got = regmean._regmean_streamed(inp, [{"w": gr} for gr in grams], 0.8, [2.0, 1.0, 0.5])
    assert torch.equal(got, regmean.regmean_merge(ws, grams, 0.8, [2.0, 1.0, 0.5]))
    avg = regmean._average_rows(TensorInputs(models, list(models), "b"), [2.0, 1.0, 0.5], budget=16)
    assert torch.equal(avg, regmean.merge_tensor([w[0] for w in ws], [None] * 3, 0.8, [2.0, 1.0, 0.5]))


def test_float32_statistics_merge_within_tolerance_of_float64(lab3, monkeypatch):
    """RegMean with its statistics stored in float32 (half the bytes) against float64, on the pico
    lab: the merged weights differ by at most 2e-6 (measured here: 9.5e-8, on weights of magnitude up to 1)."""
    lab, sds = lab3
    experts = list(lab["experts"])
    paths = {e: str(lab["experts"][e]) for e in experts}
    cand = Candidate(strategy="regmean", shared={"alpha": 0.9, "prompts": 8, "inputs": "prompt"},
                     per_model={e: {"weight": 1.0} for e in experts})
    from opd.weights.merge import merge_candidate

    merged = {}
    for dtype in (torch.float64, torch.float32):
        monkeypatch.setattr(regmean, "STATS_DTYPE", dtype)
        monkeypatch.setattr(regmean, "STORE", regmean.StatsStore())
        merged[dtype] = merge_candidate(cand, str(lab["base"]), paths, sds["base"], {e: sds[e] for e in experts})
        assert next(iter(regmean.STORE.stats.values()))["model.layers.0.mlp.up_proj.weight"].dtype == dtype
    diff = max((merged[torch.float64][k] - merged[torch.float32][k]).abs().max().item() for k in merged[torch.float32])
    assert 0 < diff < 2e-6, diff


def test_regmean_caches_belong_to_a_stats_store():
    """#31: the statistics and their bindings live on a StatsStore (the process's is STORE), not in
    module-level containers; two stores do not share anything, and clear() empties one."""
    mutable = (dict, list, set, OrderedDict)
    globals_ = {k: v for k, v in vars(regmean).items() if isinstance(v, mutable) and not k.startswith("__")}
    assert set(globals_) == {"PREPARE"}, sorted(globals_)  # the method's hook registry, no state
    a, b = regmean.StatsStore(), regmean.StatsStore()
    a.stats[("h",)] = {}
    a.canon["x"] = "x"
    assert not b.stats and not b.canon and isinstance(regmean.STORE, regmean.StatsStore)
    a.clear()
    assert not a.stats and not a.canon
