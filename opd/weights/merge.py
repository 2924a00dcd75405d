"""Weight-space merges of a base and its experts with mergekit, in memory or as a YAML.

A candidate (`Candidate`) names a merge method and its concrete parameters. The same candidate
becomes either an in-memory `mergekit.merge_methods.merge_state_dicts` call (the search's fast path)
or a mergekit YAML that `mergekit-yaml` / `run_merge` reproduces tensor for tensor.

The methods are mergekit's own and opd's: the subspace merges `tsv_m`, `iso_c`, `iso_cts`
(opd.weights.subspace), the data-aware `regmean` (opd.weights.regmean) and `wudi`
(opd.weights.wudi, data-free unless its `data` is set), registered with mergekit when this module
is imported: a separate `mergekit-yaml` process does not know them, `run_mergekit`
here does. The search's strategies (opd.merge.strategies) and a distillation student started from
a merge (opd.distill.run) both merge through here.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import safetensors.torch
import torch
from mergekit import merge_methods as mm
from mergekit.merge_methods import PerGroupValues, merge_state_dicts
from mergekit.merge_methods.base import ParameterScope
from pydantic import BaseModel, ConfigDict, Field

from opd.errors import OpdError
from opd.weights import adamerging, regmean, subspace, wudi
from opd.weights.layers import LayerLayout, LayerValues, layout_for, resolve, setting
from opd.weights.lazy import TEMPORARIES, LazyStateDict, merge_streamed, read_tensors
from opd.weights.sort_cache import CACHE as SORT_CACHE
from opd.weights.sort_cache import SortedMagnitudes, cached_magnitude
from opd.weights.state import merge_keys as merge_keys  # re-exported: its callers import it here

BASE_ID = "base"
# Which models a method takes: "base+experts" (base is the reference), "experts" (base unused),
# "pair" (exactly two models; the first is mergekit's base_model). Methods left out (passthrough)
# stack layers rather than consolidate experts.
METHOD_INPUTS = {
    "linear": "experts", "karcher": "experts",
    "task_arithmetic": "base+experts", "ties": "base+experts", "dare_ties": "base+experts",
    "dare_linear": "base+experts", "della": "base+experts", "della_linear": "base+experts",
    "breadcrumbs": "base+experts", "breadcrumbs_ties": "base+experts", "model_stock": "base+experts",
    "sce": "base+experts", "ram": "base+experts", "ramplus_tl": "base+experts",
    "nuslerp": "base+experts",
    "tsv_m": "base+experts", "iso_c": "base+experts", "iso_cts": "base+experts",  # opd.weights.subspace
    "regmean": "experts",  # opd.weights.regmean
    "wudi": "base+experts",  # opd.weights.wudi
    "adamerging": "base+experts",  # opd.weights.adamerging
    "slerp": "pair", "nearswap": "pair", "arcee_fusion": "pair",
}
# Methods whose result depends on torch's global RNG (DARE's random drop, DELLA's sampling).
RANDOM_METHODS = {"dare_ties", "dare_linear", "della", "della_linear"}
# Required per-model parameters get a neutral value when a recipe leaves them out.
_REQUIRED_DEFAULTS = {"weight": 1.0}
# opd's own methods: registered with mergekit here, so that both merge paths find them.
_OPD_METHODS = (*subspace.METHODS, *regmean.METHODS, *wudi.METHODS, *adamerging.METHODS)
OPD_METHODS = tuple(m.spec.name for m in _OPD_METHODS)


def _register_opd_methods() -> None:
    """Make opd's methods known to `mergekit.merge_methods.get` (once; mergekit refuses a repeat)."""
    known = {m.spec.name for m in mm.registered_methods()}
    for method in _OPD_METHODS:
        if method.spec.name not in known:
            mm.register(method)


_register_opd_methods()
# Data-aware methods: method -> hook(paths, shared, per_model, base) that reads the experts' (and the
# base's) directories before either merge path runs: RegMean's Gram matrices, AdaMerging's fit.
PREPARE = {**regmean.PREPARE, **wudi.PREPARE, **adamerging.PREPARE}
# Float parameters that a method takes once for the whole model, never per layer group.
WHOLE_MODEL = {"adamerging": adamerging.WHOLE_MODEL}


@dataclass(frozen=True)
class Method:
    """A merge method as mergekit declares it: the models it takes and its parameters."""

    name: str
    inputs: str  # METHOD_INPUTS
    shared: dict[str, Any]  # parameter -> mergekit default (None when required)
    per_model: dict[str, Any]
    pretty: str
    floats: frozenset[str]  # the float parameters that may take a value per layer group
    native: bool  # shipped with mergekit (a plain `mergekit-yaml` runs it), not one of opd's own


def methods() -> list[Method]:
    """Every method opd merges with, in mergekit's registration order (its own, then opd's)."""
    return [method(m.spec.name) for m in mm.registered_methods() if m.spec.name in METHOD_INPUTS]


@functools.cache
def method(name: str) -> Method:
    """One method as mergekit declares it; OpdError for a name opd does not merge with."""
    if name not in METHOD_INPUTS:
        raise OpdError(f"{name!r} is not a weight-space merge method; the methods are {sorted(METHOD_INPUTS)}")
    spec = mm.get(name).spec
    shared, per_model = {}, {}
    for p in spec.parameters:
        default = None if p.required else p.default
        (shared if p.scope == ParameterScope.SHARED else per_model)[p.name] = default
    whole = WHOLE_MODEL.get(spec.name, frozenset())
    floats = frozenset(p.name for p in spec.parameters if _is_float(p.value_type) and p.name not in whole)
    return Method(spec.name, METHOD_INPUTS[spec.name], shared, per_model, spec.pretty_name or spec.name, floats,
                  spec.name not in OPD_METHODS)


def _is_float(value_type) -> bool:
    """Whether a mergekit parameter's type is float (possibly Annotated with bounds)."""
    if get_origin(value_type) is Annotated:
        value_type = get_args(value_type)[0]
    return value_type is float


# A parameter's value: a scalar, or one value per layer group (opd.weights.layers).
Value = LayerValues | bool | int | float | str


class Candidate(BaseModel):
    """One point of the search space: a strategy, its shared parameters, per-expert parameters. The
    functions here take a merge method's; the search's other strategies (OPD, opd.merge.strategies)
    use the same shape, and name the merge they start from with one."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    strategy: str
    shared: dict[str, Value] = Field(default_factory=dict)
    per_model: dict[str, dict[str, Value]] = Field(default_factory=dict, description="expert -> {param: value}")
    seed: int = Field(0, description="torch seed for the randomised methods (DARE, DELLA)")

    @property
    def layerwise(self) -> bool:
        """Whether some parameter has a value per layer group."""
        values = [*self.shared.values(), *(v for ps in self.per_model.values() for v in ps.values())]
        return any(isinstance(v, LayerValues) for v in values)

    def label(self) -> str:
        parts = [f"{k}={_fmt(v)}" for k, v in sorted(self.shared.items())]
        for e, ps in self.per_model.items():
            parts.append(f"{e}:" + ",".join(f"{k}={_fmt(v)}" for k, v in sorted(ps.items())))
        return f"{self.strategy}(" + " ".join(parts) + ")"


def _method(cand: Candidate) -> Method:
    if cand.strategy not in METHOD_INPUTS:
        raise OpdError(f"strategy {cand.strategy!r} is not a weight-space merge method: it has no mergekit form "
                       f"(the methods are {sorted(METHOD_INPUTS)})")
    return method(cand.strategy)


def _fmt(v):
    if isinstance(v, LayerValues):
        return v.label()
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _layout(m: Method, experts: list[str]) -> tuple[list[str], str | None]:
    """(input ids in order, base id) as mergekit sees them."""
    if m.inputs == "experts":
        return list(experts), None
    if m.inputs == "pair" and len(experts) == 2:
        return list(experts), experts[0]
    return [BASE_ID, *experts], BASE_ID


def _per_model_params(cand: Candidate, m: Method, experts: list[str], base: str | None):
    """{param: {id: value}}; the pair methods' base model takes no per-model values."""
    out = {}
    for p in m.per_model:
        vals = {e: cand.per_model.get(e, {}).get(p, _REQUIRED_DEFAULTS.get(p)) for e in experts if e != base}
        vals = {e: v for e, v in vals.items() if v is not None}
        if vals:
            out[p] = vals
    return out


# Input bytes (all inputs' tensors together, float32) one call of mergekit's merge_state_dicts takes:
# a merge visits the tensor names in order, a run of names at a time, so it holds one run of every
# input's tensors plus the method's temporaries on them, not whole models. Small models fit in one
# run (mergekit batches same-shaped tensors within a run); a tensor larger than this alone is a run.
CHUNK_BYTES = 64 << 20


def merge_in_memory(cand: Candidate, base_sd: Mapping[str, torch.Tensor],
                    expert_sds: Mapping[str, Mapping[str, torch.Tensor]],
                    layers: LayerLayout | None = None, sink: Callable[[str, torch.Tensor], None] | None = None,
                    chunk_bytes: int = CHUNK_BYTES) -> dict[str, torch.Tensor] | None:
    """Merge state dicts with mergekit's tensor functions; same tensors as `run_merge` on the YAML.
    A layer-wise candidate needs the models' `layers` (opd.weights.layers.layout_for).

    Streams: the inputs may be lazy mappings (opd.weights.lazy.LazyStateDict) that read a tensor on
    access; names are merged a run of at most `chunk_bytes` input bytes at a time with mergekit's
    `merge_state_dicts`, so nothing holds all of the inputs' tensors at once; a tensor whose copies
    over the inputs exceed a run is merged one input, or one block of rows, at a time
    (opd.weights.lazy.merge_streamed), where the method has such a path. With `sink`, each merged
    tensor goes to `sink(name, tensor)` as it is made (and None is returned); else the merged state
    dict is returned."""
    m = _method(cand)
    experts = list(expert_sds)
    ids, base = _layout(m, experts)
    models = {i: (base_sd if i == BASE_ID else expert_sds[i]) for i in ids}
    params = {**cand.shared, **_per_model_params(cand, m, experts, base)}
    names = list(models[ids[0]])
    if cand.layerwise:
        params = _per_tensor(params, m.name, names, layers)
    sizes = _tensor_bytes(base_sd if BASE_ID in models else models[ids[0]], names)
    out: dict[str, torch.Tensor] = {}
    # Each task vector's magnitudes sorted once per search, when they all fit the sort cache. Past its
    # size the LRU would evict every entry before its next use (a merge visits the tensors in order)
    # and hold its full size in memory for nothing: then a cache of one tensor's size (the largest a
    # run merges; larger ones are cut without sorting) keeps only the faster sort
    # (opd.weights.sort_cache), and memory stays one sorted tensor.
    # a run holds inputs and the method's temporaries on them within chunk_bytes (opd.weights.lazy);
    # a tensor too large for one (N copies over `budget`) is merged one input at a time, unsorted
    budget = chunk_bytes // TEMPORARIES.get(m.name, 1)
    in_runs = [size for size in sizes if size * len(ids) <= budget]
    fits = sum(sizes) * len(experts) <= SORT_CACHE.max_bytes
    sorted_once = cached_magnitude() if fits else cached_magnitude(SortedMagnitudes(max(in_runs, default=0)))
    torch.manual_seed(cand.seed)
    with torch.no_grad(), sorted_once:
        for run in _runs(names, sizes, len(ids), budget):
            # mergekit's PerGroupValues hold one value per tensor of the state dicts it is given
            p = {k: PerGroupValues([v.values[i] for i in run]) if isinstance(v, PerGroupValues) else v
                 for k, v in params.items()}
            name = names[run[0]]
            merged = None
            if len(run) == 1 and sizes[run[0]] * len(ids) > budget:  # N copies too large: one input at a time
                t = merge_streamed(models, ids, name, m.name, p, base, chunk_bytes)
                merged = None if t is None else {name: t}
            if merged is None:
                chunk = {i: read_tensors(models[i], [names[j] for j in run]) for i in ids}
                merged = merge_state_dicts(chunk, m.name, parameters=p, base=base)
                del chunk
            for k, t in merged.items():
                if sink is None:
                    out[k] = t
                else:
                    sink(k, t)
            del merged
    return out if sink is None else None


def _tensor_bytes(sd: Mapping[str, torch.Tensor], names: list[str]) -> list[int]:
    """Each named tensor's float32 bytes, without reading a lazy state dict's tensors."""
    if isinstance(sd, LazyStateDict):
        return [4 * sd.numel(n) for n in names]
    return [4 * sd[n].numel() for n in names]


def _runs(names: list[str], sizes: list[int], n_inputs: int, chunk_bytes: int) -> list[list[int]]:
    """Consecutive index runs of `names` whose tensors, over all `n_inputs` inputs, stay within `chunk_bytes`."""
    runs, cur, used = [], [], 0
    for i, size in enumerate(sizes):
        if cur and used + size * n_inputs > chunk_bytes:
            runs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += size * n_inputs
    return runs + ([cur] if cur else [])


def _per_tensor(params: dict[str, Any], name: str, names: list[str], layers: LayerLayout | None) -> dict:
    """Layer-wise values resolved tensor by tensor (mergekit's PerGroupValues, one per state-dict
    tensor in order) with the same mergekit function and gradient position as `run_merge`."""
    validate = {p.name: p.validate for p in mm.get(name).spec.parameters}
    out = {}
    for p, v in params.items():
        if isinstance(v, LayerValues):
            out[p] = PerGroupValues([resolve(v, n, layers, validate[p]) for n in names])
        elif isinstance(v, dict) and any(isinstance(x, LayerValues) for x in v.values()):
            out[p] = PerGroupValues([{i: resolve(x, n, layers, validate[p]) for i, x in v.items()} for n in names])
        else:
            out[p] = v
    return out


def _as_setting(value: Any, base_path: str) -> Any:
    return setting(value, layout_for(base_path)) if isinstance(value, LayerValues) else value


def mergekit_config(cand: Candidate, base_path: str, expert_paths: dict[str, str]) -> dict:
    """The candidate as a mergekit YAML document (run it with `mergekit-yaml --random-seed <seed>`)."""
    m = _method(cand)
    experts = list(expert_paths)
    ids, base = _layout(m, experts)
    paths = {BASE_ID: base_path, **expert_paths}
    per = _per_model_params(cand, m, experts, base)
    models = []
    for i in ids:
        entry: dict[str, Any] = {"model": paths[i]}
        ps = {p: _as_setting(v[i], base_path) for p, v in per.items() if i in v}
        if ps:
            entry["parameters"] = ps
        models.append(entry)
    doc: dict[str, Any] = {"merge_method": m.name, "models": models, "dtype": "float32"}
    if base is not None:
        doc["base_model"] = paths[base]
    shared = dict(cand.shared)
    if m.name in PREPARE:  # what its statistics are taken on: the YAML names every setting
        shared = {**{p: v for p, v in m.shared.items() if v is not None}, **shared}
    if shared:
        doc["parameters"] = {p: _as_setting(v, base_path) for p, v in shared.items()}
    # No `tokenizer_source`: the inputs were checked to share one tokenizer (opd.paths.
    # require_same_tokenizer), so mergekit copies the donor's tokenizer files as they are, and with
    # them generation_config.json, whose eos list holds the "\n" stop. With `tokenizer_source: base`
    # mergekit re-saves the tokenizer and drops generation_config.json: the merged model then
    # generated past the end of its answers.
    return doc


def merge_candidate(cand: Candidate, base_path: str, expert_paths: dict[str, str],
                    base_sd: Mapping[str, torch.Tensor], expert_sds: Mapping[str, Mapping[str, torch.Tensor]],
                    out_dir: str | Path | None = None) -> Mapping[str, torch.Tensor]:
    """The candidate's merged weights, equal to what `mergekit-yaml` writes for its YAML.

    Deterministic methods run in memory, streamed tensor by tensor from the inputs (`merge_in_memory`).
    The randomised ones draw from torch's RNG tensor by tensor in mergekit's own schedule order, which
    the in-memory batching does not follow, so they run through `run_merge` into a directory (about
    0.05 s on the lab's models).

    With `out_dir`, the merged tensors are written there as they are made (safetensors shards, by
    mergekit's TensorWriter) and a lazy state dict over them is returned: the candidate is never whole
    in memory (the search's `memory_budget`). Without it, the merged state dict is returned.
    """
    _method(cand)
    _prepare(cand.strategy, expert_paths, cand.shared, cand.per_model, base_path)
    layers = layout_for(base_path) if cand.layerwise else None
    if cand.strategy not in RANDOM_METHODS:
        if out_dir is None:
            return merge_in_memory(cand, base_sd, expert_sds, layers)
        from mergekit.io.tensor_writer import TensorWriter  # lazy: loads accelerate

        # shards of at most CHUNK_BYTES: each is written (and dropped) once full
        with TensorWriter(str(out_dir), max_shard_size=CHUNK_BYTES) as writer:
            merge_in_memory(cand, base_sd, expert_sds, layers, sink=writer.save_tensor)
        return LazyStateDict(out_dir, names=list(base_sd))  # every input has the base's tensor names
    if out_dir is not None:
        run_mergekit(mergekit_config(cand, base_path, expert_paths), str(out_dir), seed=cand.seed,
                     copy_tokenizer=False)
        return LazyStateDict(out_dir)

    with tempfile.TemporaryDirectory(prefix="opd-merge-") as tmp:
        run_mergekit(mergekit_config(cand, base_path, expert_paths), tmp, seed=cand.seed, copy_tokenizer=False)
        out = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            out.update(safetensors.torch.load_file(f))
        return out


def run_mergekit(config: dict, out_dir: str, seed: int = 0, copy_tokenizer: bool = True) -> None:
    """Run a candidate's YAML through mergekit's own `run_merge` (the reference path)."""
    from mergekit.config import MergeConfiguration  # lazy: loads transformers and huggingface_hub
    from mergekit.merge import run_merge  # lazy: loads transformers and huggingface_hub
    from mergekit.options import MergeOptions  # lazy: loads transformers and huggingface_hub

    cfg = MergeConfiguration.model_validate(config)
    # statistics are the experts' own: a method that takes a base (WUDI) reads none of it
    models = [m for m in config.get("models", []) if m["model"] != config.get("base_model")]
    _prepare(config["merge_method"], {m["model"]: m["model"] for m in models}, config.get("parameters"),
             {m["model"]: m.get("parameters") or {} for m in models}, config.get("base_model"))
    # no model card for a search's temporary merge: writing one looks its inputs up on the Hub
    run_merge(cfg, out_dir, options=MergeOptions(device="cpu", random_seed=seed, quiet=True,
                                                 copy_tokenizer=copy_tokenizer, write_model_card=copy_tokenizer))


def _prepare(method: str, paths: dict[str, str], shared: dict | None, per_model: dict | None = None,
             base: str | None = None) -> None:
    """Data-aware methods (RegMean's and WUDI's Gram matrices, AdaMerging's fit) read their experts'
    directories (and the base's, `base`, which only AdaMerging reads) before merging; `per_model`
    (input id -> its parameters) carries the importances RegMean++'s statistics depend on."""
    if method in PREPARE:
        PREPARE[method](paths, shared or {}, per_model or {}, base)
