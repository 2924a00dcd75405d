"""Merge strategies: mergekit's methods, keyed by mergekit's name, run in memory or as a YAML
(mergekit's own, plus opd's subspace methods `tsv_m`, `iso_c`, `iso_cts` from opd.merge.subspace
and the data-aware `regmean` from opd.merge.regmean, registered with mergekit when this module is
imported: a separate `mergekit-yaml` process does not know them, `run_mergekit` here does);
and on-policy distillation (OPD) strategies that train a student from the experts as teachers.

A candidate is one method plus concrete parameters. The same candidate becomes either an
in-memory `mergekit.merge_methods.merge_state_dicts` call (the search's fast path) or a
mergekit YAML that `mergekit-yaml` / `run_merge` reproduces tensor for tensor.

OPD strategies (`DistillStrategy`, trained by `opd.distill.strategy`): `opd` (student from the base),
`merge_opd` (student from the best weight-space candidate the search has scored so far) and a
registered `<method>+opd` hybrid per method (student from that method's merge, whose parameters are
searched with the OPD settings).

Every strategy is one object in `STRATEGIES` with one interface (`Strategy`): the search asks it
whether it waits for merges, what it records before building, how it builds weights (`build`) and
whether a killed trial resumes; it never branches on a strategy's name or kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import torch
from pydantic import BaseModel, ConfigDict, Field

from opd.errors import OpdError
from opd.merge.layers import LayerLayout, LayerValues, layout_for, resolve, setting

BASE_ID = "base"
# Which models a method takes: "base+experts" (base is the reference), "experts" (base unused),
# "pair" (exactly two models; the first is mergekit's base_model).
_INPUTS = {
    "linear": "experts", "karcher": "experts",
    "task_arithmetic": "base+experts", "ties": "base+experts", "dare_ties": "base+experts",
    "dare_linear": "base+experts", "della": "base+experts", "della_linear": "base+experts",
    "breadcrumbs": "base+experts", "breadcrumbs_ties": "base+experts", "model_stock": "base+experts",
    "sce": "base+experts", "ram": "base+experts", "ramplus_tl": "base+experts",
    "nuslerp": "base+experts",
    "tsv_m": "base+experts", "iso_c": "base+experts", "iso_cts": "base+experts",  # opd.merge.subspace
    "regmean": "experts",  # opd.merge.regmean
    "slerp": "pair", "nearswap": "pair", "arcee_fusion": "pair",
}
# Methods whose result depends on torch's global RNG (DARE's random drop, DELLA's sampling).
RANDOM_METHODS = {"dare_ties", "dare_linear", "della", "della_linear"}
# Required per-model parameters get a neutral value when a recipe leaves them out.
_REQUIRED_DEFAULTS = {"weight": 1.0}


@dataclass(frozen=True)
class Strategy:
    """A strategy as the search sees it: its inputs, its searchable parameters, and how it turns a
    candidate into weights (`build`). The search and report ask these methods, never the name."""

    name: str
    inputs: str
    shared: dict[str, Any]  # parameter -> mergekit default (None when required)
    per_model: dict[str, Any]
    pretty: str
    # OPD strategies: the distillation settings they take, and how the student starts ("base",
    # "best", or a mergekit method's name for a hybrid). None for plain weight-space methods.
    distill_shared: dict[str, Any] | None = None
    init: str | None = None
    # DistillConfig settings that define the strategy itself (not searchable), e.g. GSPO's kl_weight 0
    distill_fixed: dict[str, Any] | None = None
    # The float parameters a recipe may search per layer group (opd.merge.layers)
    layerwise: frozenset[str] = frozenset()

    @property
    def distill(self) -> bool:
        return self.distill_shared is not None

    @property
    def parameters(self) -> list[str]:
        return list(self.shared) + list(self.per_model)

    # What the search asks of every strategy (a weight-space merge's answers here; OPD overrides).
    weight_space = True  # its weights are a mergekit merge of the inputs (it exports as a YAML)
    waits_for_merges = False  # it starts from the search's best merge, so it waits for one
    resumable = False  # a killed trial is queued again with its record (its run resumes)
    stage = "merge search"  # the report's stage its trials' minutes count towards

    def merge_part(self, cand: Candidate) -> Candidate | None:
        """The weight-space candidate its weights are or start from (None: the base or the best)."""
        return cand

    def check_inputs(self, n_experts: int) -> None:
        """Refuse a method that cannot take this many experts, before any work is done."""
        from mergekit import merge_methods as mm

        ids = [f"e{i}" for i in range(n_experts)]
        if self.inputs == "pair":
            if n_experts not in (1, 2):
                raise OpdError(f"strategy {self.name!r} merges exactly two models (base + 1 expert, or 2 experts);"
                               f" the recipe has {n_experts} experts")
            return
        base = BASE_ID if self.inputs == "base+experts" else None
        try:
            mm.get(self.name).spec.contract.validate_ids(ids + ([BASE_ID] if base else []), base)
        except ValueError as e:
            raise OpdError(f"strategy {self.name!r} cannot merge {n_experts} experts: {e}") from None

    def check_params(self, params: dict[str, Any], distill) -> None:
        """Refuse (ValueError) fixed parameters that cannot work with the recipe's `distill` block."""

    def start(self, cand: Candidate, best_merge: Callable[[], Candidate | None]) -> dict[str, Any]:
        """Trial-record fields to set before the first build (`best_merge`: the search's best so far)."""
        return {}

    def build(self, inputs, cand: Candidate, ctx: BuildContext | None = None) -> tuple[dict, dict[str, Any]]:
        """(weights, trial-record fields) of the candidate; a merge needs no context."""
        paths = {e: str(p) for e, p in inputs.expert_paths.items()}
        return merge_candidate(cand, str(inputs.base_path), paths, inputs.base_sd, inputs.expert_sds), {}


@dataclass(frozen=True)
class BuildContext:
    """What a trained strategy needs beyond its inputs: the recipe, its trial's record (`opd_init`),
    the trial number its run directory is named by, and the scorer for keep-best checks."""

    recipe: Any
    opd_init: Candidate | None
    number: int
    evaluate_fn: Callable | None = None
    references: dict[str, float] | None = None
    live: bool = False  # show the student's bars in the live display (opd.display)


@dataclass(frozen=True)
class DistillStrategy(Strategy):
    """OPD (and its off-policy and GSPO baselines): a student trained from the experts as teachers,
    starting from the base, the search's best merge, or a mergekit method's merge (a hybrid)."""

    weight_space = False
    resumable = True
    stage = "OPD"

    @property
    def waits_for_merges(self) -> bool:
        return self.init == "best"

    def merge_part(self, cand: Candidate) -> Candidate | None:
        if self.init in ("base", "best"):
            return None
        method = get_strategy(self.init)
        return Candidate(strategy=method.name, shared={k: v for k, v in cand.shared.items() if k in method.shared},
                         per_model={e: {k: v for k, v in ps.items() if k in method.per_model}
                                    for e, ps in cand.per_model.items()}, seed=cand.seed)

    def check_inputs(self, n_experts: int) -> None:
        if self.init not in ("base", "best"):
            get_strategy(self.init).check_inputs(n_experts)

    def check_params(self, params: dict[str, Any], distill) -> None:
        from pydantic import ValidationError

        fixed = {p: v for p, v in params.items() if p in self.distill_shared and isinstance(v, bool | int | float | str)}
        try:
            type(distill).model_validate({**distill.model_dump(), **fixed, **(self.distill_fixed or {})})
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"strategy {self.name!r}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None

    def start(self, cand: Candidate, best_merge: Callable[[], Candidate | None]) -> dict[str, Any]:
        init = self.merge_part(cand)
        return {"opd_init": best_merge() if init is None and self.init == "best" else init}

    def build(self, inputs, cand: Candidate, ctx: BuildContext | None = None) -> tuple[dict, dict[str, Any]]:
        from opd.distill.strategy import opd_student

        if ctx is None:
            raise ValueError(f"strategy {cand.strategy!r} trains a student: build() needs its trial's context")
        init = ctx.opd_init
        init_sd = get_strategy(init.strategy).build(inputs, init)[0] if init else inputs.base_sd
        sd, history = opd_student(inputs, cand, ctx.recipe, init_sd, ctx.recipe.out_dir / "opd" / f"trial-{ctx.number}",
                                  evaluate_fn=ctx.evaluate_fn, references=ctx.references, live=ctx.live)
        return sd, {"opd_history": history}


def _build_registry() -> dict[str, Strategy]:
    from mergekit import merge_methods as mm
    from mergekit.merge_methods.base import ParameterScope

    from opd.merge import regmean, subspace

    subspace.register_methods()  # opd's own mergekit methods, so both paths find them
    regmean.register_methods()
    out = {}
    for method in mm.registered_methods():
        spec = method.spec
        if spec.name not in _INPUTS:
            continue  # passthrough stacks layers, it does not consolidate experts
        shared, per_model = {}, {}
        for p in spec.parameters:
            default = None if p.required else p.default
            (shared if p.scope == ParameterScope.SHARED else per_model)[p.name] = default
        floats = frozenset(p.name for p in spec.parameters if _is_float(p.value_type))
        out[spec.name] = Strategy(spec.name, _INPUTS[spec.name], shared, per_model, spec.pretty_name or spec.name,
                                  layerwise=floats)
    return out


def _is_float(value_type) -> bool:
    """Whether a mergekit parameter's type is float (possibly Annotated with bounds)."""
    if get_origin(value_type) is Annotated:
        value_type = get_args(value_type)[0]
    return value_type is float


STRATEGIES: dict[str, Strategy] = _build_registry()
# The DistillConfig fields an OPD strategy searches (defaults: the recipe's `distill` block), and
# its per-teacher weight: the teacher's share of its capability's KL target and of the prompts.
OPD_SHARED = {"steps": 50, "lr": 3e-4, "estimator": "sampled", "reward_weight": 0.0, "temperature": 1.0,
              "prompts_per_step": 16, "group_size": 4, "updates_per_batch": 1, "lr_schedule": "constant",
              "adaptive_mix": 0.0, "kl_weight": 1.0, "warmstart_steps": 0, "warmstart_prompts": 256,
              "warmstart_lr": 1e-3}
OPD_PER_MODEL = {"teacher_weight": 1.0}
HYBRID_SUFFIX = "+opd"
_OPD = (dict(OPD_SHARED), dict(OPD_PER_MODEL))
STRATEGIES["opd"] = DistillStrategy("opd", "distill", *_OPD, "OPD from the base", dict(OPD_SHARED), "base")
STRATEGIES["merge_opd"] = DistillStrategy("merge_opd", "distill", *_OPD, "OPD from the best merge so far",
                                          dict(OPD_SHARED), "best")
# What a user would do instead of OPD, run by the same loop so that tokens and minutes compare:
# supervised training on teacher samples the verifier accepts (off-policy distillation, no
# on-policy steps), and multi-task GSPO from the base on verifier rewards alone (no teacher).
STRATEGIES["offpolicy"] = DistillStrategy("offpolicy", "distill", *_OPD,
                                          "off-policy distillation (SFT on verified teacher samples)",
                                          dict(OPD_SHARED), "base", {"steps": 0})
STRATEGIES["gspo"] = DistillStrategy("gspo", "distill", *_OPD, "multi-task GSPO on verifier rewards",
                                     dict(OPD_SHARED), "base", {"kl_weight": 0.0, "reward_weight": 1.0,
                                                                "warmstart_steps": 0})
# `<method>+opd`: OPD from that method's merge, its parameters searched with the OPD settings.
HYBRIDS = {f"{m.name}{HYBRID_SUFFIX}": DistillStrategy(
    f"{m.name}{HYBRID_SUFFIX}", m.inputs, {**m.shared, **OPD_SHARED}, {**m.per_model, **OPD_PER_MODEL},
    f"OPD from {m.pretty}", dict(OPD_SHARED), m.name, layerwise=m.layerwise)
    for m in list(STRATEGIES.values()) if m.weight_space}
STRATEGIES.update(HYBRIDS)
# The report's stages that strategies' trial minutes count towards, in order ("merge search" first).
STAGES = list(dict.fromkeys([Strategy.stage, *(s.stage for s in STRATEGIES.values())]))


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise OpdError(f"merge strategy {name!r} is unknown; strategies opd can search: "
                       f"{sorted(n for n in STRATEGIES if n not in HYBRIDS)} and '<method>{HYBRID_SUFFIX}' "
                       "hybrids of a mergekit method with OPD")
    return STRATEGIES[name]


def merge_part(cand: Candidate) -> Candidate | None:
    """The weight-space candidate a strategy starts from: itself for a mergekit method, the merge
    half of a `<method>+opd` hybrid, None for OPD from the base or from the search's best."""
    return get_strategy(cand.strategy).merge_part(cand)


def distill_part(cand: Candidate) -> tuple[dict[str, Any], dict[str, float]]:
    """An OPD candidate's DistillConfig settings and its teacher weights (expert -> weight)."""
    strategy = get_strategy(cand.strategy)
    settings = {k: v for k, v in cand.shared.items() if k in (strategy.distill_shared or {})}
    settings.update(strategy.distill_fixed or {})
    weights = {e: float(ps["teacher_weight"]) for e, ps in cand.per_model.items() if "teacher_weight" in ps}
    return settings, weights


def check_inputs(strategy: Strategy, n_experts: int) -> None:
    """Refuse a method that cannot take this many experts, before any work is done."""
    strategy.check_inputs(n_experts)


# A parameter's value: a scalar, or one value per layer group (opd.merge.layers).
Value = LayerValues | bool | int | float | str


class Candidate(BaseModel):
    """One point of the search space: a method, its shared parameters, per-expert parameters."""

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


def _weight_space(cand: Candidate) -> Candidate:
    part = merge_part(cand)
    if part is None:
        raise OpdError(f"strategy {cand.strategy!r} trains a student from the base or the search's best merge: "
                       "it has no mergekit form")
    return part


def _fmt(v):
    if isinstance(v, LayerValues):
        return v.label()
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _layout(strategy: Strategy, experts: list[str]) -> tuple[list[str], str | None]:
    """(input ids in order, base id) as mergekit sees them."""
    if strategy.inputs == "experts":
        return list(experts), None
    if strategy.inputs == "pair" and len(experts) == 2:
        return list(experts), experts[0]
    return [BASE_ID, *experts], BASE_ID


def _per_model_params(cand: Candidate, strategy: Strategy, experts: list[str], ids: list[str], base: str | None):
    """{param: {id: value}}; the pair methods' base model takes no per-model values."""
    out = {}
    for p in strategy.per_model:
        vals = {e: cand.per_model.get(e, {}).get(p, _REQUIRED_DEFAULTS.get(p)) for e in experts if e != base}
        vals = {e: v for e, v in vals.items() if v is not None}
        if vals:
            out[p] = vals
    return out


def merge_in_memory(cand: Candidate, base_sd: dict[str, torch.Tensor],
                    expert_sds: dict[str, dict[str, torch.Tensor]],
                    layers: LayerLayout | None = None) -> dict[str, torch.Tensor]:
    """Merge state dicts with mergekit's tensor functions; same tensors as `run_merge` on the YAML.
    A layer-wise candidate needs the models' `layers` (opd.merge.layers.layout_for)."""
    from mergekit.merge_methods import merge_state_dicts

    cand = _weight_space(cand)
    strategy = get_strategy(cand.strategy)
    experts = list(expert_sds)
    ids, base = _layout(strategy, experts)
    models = {i: (base_sd if i == BASE_ID else expert_sds[i]) for i in ids}
    params = {**cand.shared, **_per_model_params(cand, strategy, experts, ids, base)}
    if cand.layerwise:
        params = _per_tensor(params, strategy.name, list(models[ids[0]]), layers)
    torch.manual_seed(cand.seed)
    with torch.no_grad():
        return merge_state_dicts(models, strategy.name, parameters=params, base=base)


def _per_tensor(params: dict[str, Any], method: str, names: list[str], layers: LayerLayout | None) -> dict:
    """Layer-wise values resolved tensor by tensor (mergekit's PerGroupValues, one per state-dict
    tensor in order) with the same mergekit function and gradient position as `run_merge`."""
    from mergekit import merge_methods as mm
    from mergekit.merge_methods import PerGroupValues

    validate = {p.name: p.validate for p in mm.get(method).spec.parameters}
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
    """The candidate as a mergekit YAML document (run it with `mergekit-yaml --random-seed <seed>`);
    for a `<method>+opd` hybrid, the YAML of the merge its student starts from."""
    cand = _weight_space(cand)
    strategy = get_strategy(cand.strategy)
    experts = list(expert_paths)
    ids, base = _layout(strategy, experts)
    paths = {BASE_ID: base_path, **expert_paths}
    per = _per_model_params(cand, strategy, experts, ids, base)
    models = []
    for i in ids:
        entry: dict[str, Any] = {"model": paths[i]}
        ps = {p: _as_setting(v[i], base_path) for p, v in per.items() if i in v}
        if ps:
            entry["parameters"] = ps
        models.append(entry)
    doc: dict[str, Any] = {"merge_method": strategy.name, "models": models, "dtype": "float32"}
    if base is not None:
        doc["base_model"] = paths[base]
    shared = dict(cand.shared)
    if strategy.name in _data_aware():  # what its statistics are taken on: the YAML names every setting
        shared = {**{p: v for p, v in strategy.shared.items() if v is not None}, **shared}
    if shared:
        doc["parameters"] = {p: _as_setting(v, base_path) for p, v in shared.items()}
    # No `tokenizer_source`: the inputs were checked to share one tokenizer (opd.paths.
    # require_same_tokenizer), so mergekit copies the donor's tokenizer files as they are, and with
    # them generation_config.json, whose eos list holds the "\n" stop. With `tokenizer_source: base`
    # mergekit re-saves the tokenizer and drops generation_config.json: the merged model then
    # generated past the end of its answers.
    return doc


def merge_candidate(cand: Candidate, base_path: str, expert_paths: dict[str, str], base_sd: dict[str, torch.Tensor],
                    expert_sds: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The candidate's merged weights, equal to what `mergekit-yaml` writes for its YAML.

    Deterministic methods run in memory. The randomised ones draw from torch's RNG tensor by
    tensor in mergekit's own schedule order, which the in-memory batching does not follow, so
    they run through `run_merge` into a temporary directory (about 0.05 s on the lab's models).
    """
    cand = _weight_space(cand)
    _prepare(cand.strategy, expert_paths, cand.shared, cand.per_model)
    if cand.strategy not in RANDOM_METHODS:
        return merge_in_memory(cand, base_sd, expert_sds, layout_for(base_path) if cand.layerwise else None)
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="opd-merge-") as tmp:
        run_mergekit(mergekit_config(cand, base_path, expert_paths), tmp, seed=cand.seed, copy_tokenizer=False)
        out = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            out.update(load_file(f))
        return out


def run_mergekit(config: dict, out_dir: str, seed: int = 0, copy_tokenizer: bool = True) -> None:
    """Run a candidate's YAML through mergekit's own `run_merge` (the reference path)."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    cfg = MergeConfiguration.model_validate(config)
    models = config.get("models", [])
    _prepare(config["merge_method"], {m["model"]: m["model"] for m in models}, config.get("parameters"),
             {m["model"]: m.get("parameters") or {} for m in models})
    # no model card for a search's temporary merge: writing one looks its inputs up on the Hub
    run_merge(cfg, out_dir, options=MergeOptions(device="cpu", random_seed=seed, quiet=True,
                                                 copy_tokenizer=copy_tokenizer, write_model_card=copy_tokenizer))


def _data_aware() -> dict:
    from opd.merge.regmean import PREPARE

    return PREPARE


def _prepare(method: str, paths: dict[str, str], shared: dict | None, per_model: dict | None = None) -> None:
    """Data-aware methods (RegMean's Gram matrices) read their inputs' directories before merging;
    `per_model` (input id -> its parameters) carries the importances RegMean++'s statistics depend on."""
    from opd.merge.regmean import PREPARE

    if method in PREPARE:
        PREPARE[method](paths, shared or {}, per_model or {})
