"""Merge recipes: a YAML file (plus `key=value` overrides) becomes a frozen, validated model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_serializer,
    field_validator,
    model_validator,
)

from opd.capabilities import get_capability
from opd.capabilities.lm_eval_task import resolve_tasks
from opd.config import load_yaml_model
from opd.devices import DeviceName, DtypeName
from opd.distill.config import VERIFIER_HELP, DistillConfig, Verifier, one_verifier
from opd.errors import OpdError
from opd.evaluation.backends import require_backend
from opd.io import state_dict_hash
from opd.merge.strategies import MergeInputs, get_strategy
from opd.model_inputs import ExpertEntry, ExpertInput, cached_hash, open_experts, read_header, weights_hash
from opd.paths import NAME_PATTERN, redact_url, require_model_dir
from opd.weights.lazy import LazyStateDict
from opd.weights.merge import merge_keys

Scalar = bool | int | float | str


class Choices(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    choices: list[Scalar] = Field(min_length=1, description="values the search picks from")


class LayerRange(BaseModel):
    """A float parameter searched per layer group: the embeddings, `layer_groups` points over the
    blocks, the head; it exports as mergekit's filtered, gradient-valued setting (opd.weights.layers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    range: tuple[float, float] = Field(description="[low, high] each group's value is drawn from")
    layer_groups: int = Field(ge=1, le=64, description="points the blocks' gradient passes through, evenly "
                              "spaced from the first block to the last (mergekit interpolates between them); "
                              "set it to the number of layers for one value per block")


def _spec_kind(v) -> str:
    # Tell the forms apart by shape, so that an error names the one the user wrote, not all four.
    if isinstance(v, LayerRange) or (isinstance(v, dict) and "layer_groups" in v):
        return "layers"
    if isinstance(v, Choices | dict):
        return "choices"
    return "range" if isinstance(v, list | tuple) else "scalar"


# A parameter is fixed (a scalar), a [low, high] range, a set of choices, or a range per layer group.
ParamSpec = Annotated[
    Annotated[Scalar, Tag("scalar")] | Annotated[tuple[float, float], Tag("range")]
    | Annotated[Choices, Tag("choices")] | Annotated[LayerRange, Tag("layers")],
    Discriminator(_spec_kind)]


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    n_trials: int | None = Field(40, gt=0, description="finished trials the study stops at (all workers together)")
    timeout_s: float | None = Field(None, gt=0, description="wall-clock limit for this process's search")
    per_strategy: dict[str, int] = Field(default_factory=dict, description="most trials a strategy may take "
                                         "(e.g. {opd: 4}: OPD trials cost minutes, a merge trial seconds)")
    warm_fraction: float = Field(0.25, gt=0, le=1, description="a study warm-started from an earlier run of "
                                 "the recipe (an expert was retrained) stops at this fraction of n_trials: it "
                                 "tries that run's best settings first instead of searching from scratch")

    @model_validator(mode="after")
    def _some_limit(self):
        if self.n_trials is None and self.timeout_s is None:
            raise ValueError("give n_trials, timeout_s or both")
        return self


class Screening(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    limit: int | None = Field(50, gt=0, description="val items per capability in the cheap first pass (null: off)")
    margin: float = Field(0.1, ge=0, description="promote to the full val split when min retention on the "
                          "screen is within this of the best full-val min retention so far")
    warmup: int = Field(3, ge=0, description="trials always promoted before the margin rule starts")


class Objectives(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    per_capability: bool = Field(True, description="one objective per capability: its retention")
    aggregates: list[Literal["min", "mean"]] = Field(["min"], description="aggregate retention objectives")

    @model_validator(mode="after")
    def _nonempty(self):
        if not self.per_capability and not self.aggregates:
            raise ValueError("no objective left: set per_capability or list an aggregate")
        return self


class Scoring(BaseModel):
    """How candidates are scored: in process (hf) or by lm-eval's own vLLM / SGLang model types on a
    candidate written to disk (GPU only; opd.evaluation.backends)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    backend: Literal["hf", "vllm", "sglang"] = Field("hf", description="hf: the in-process model object; vllm / "
                                                      "sglang: lm-eval's VLLM / SGLangLM on the candidate's directory")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field("auto", description="engine weights dtype")
    tensor_parallel: int = Field(1, gt=0, description="GPUs one engine spans (vllm tensor_parallel_size, "
                                 "sglang tp_size)")
    memory_fraction: float | None = Field(None, gt=0, le=1, description="GPU memory share of the engine "
                                          "(vllm gpu_memory_utilization, sglang mem_fraction_static)")
    max_model_len: int | None = Field(None, gt=0, description="context length the engine allocates for")
    batch_size: int | Literal["auto"] = Field("auto", description="requests per engine call")

    @model_validator(mode="after")
    def _can_run(self):
        require_backend(self.backend)
        return self


class MergeRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="names the run directory and the merged model (one "
                      "path component: letters, digits, _ - .)")
    base: str = Field("runs/base", description="the base model directory all experts were trained from")
    experts: list[ExpertInput] = Field(
        min_length=1, description="opd experts (a name, experts/<name>/, or a path holding manifest.json), or "
        "any HF causal-LM directory fine-tuned from the base as {path: DIR, tasks: [...]} (opd.model_inputs)")
    capabilities: list[str] | None = Field(None, description="old name of `tasks` (give one of the two)")
    tasks: list[str] | None = Field(None, description="what to score (default: every task the experts list): opd "
                                    "capabilities (sort, rg:gcd), stock lm-eval tasks (gsm8k, arc_challenge) or tasks "
                                    "defined by the YAMLs in include_path, each on its primary metric")
    include_path: str | None = Field(None, description="a directory of lm-eval task YAMLs that `tasks` may name")
    scoring: Scoring = Field(default_factory=Scoring, description="which engine scores candidates")
    strategies: dict[str, dict[str, ParamSpec]] = Field(
        min_length=1, description="mergekit method, 'opd', 'merge_opd' or '<method>+opd' -> "
        "{parameter: value | [low, high] | {choices: [...]} | {range: [low, high], layer_groups: n}}")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="settings of the OPD strategies' "
                                   "runs that their parameters do not set")
    verifier: Verifier = Field("capability", description=VERIFIER_HELP + "; a strategy that needs the reward "
                               "(gspo, reward_weight > 0) is refused with 'none'; the same setting as "
                               "distill.verifier")
    budget: Budget = Field(default_factory=Budget)
    train: dict[str, Any] = Field(default_factory=dict, description="the lab's section: how `opd lab` trains the "
                                  "experts ([LabTraining](#labtraining), checked by opd.lab.recipe when the lab "
                                  "loads the file); the merge search keeps it as written and does not read it")
    objectives: Objectives = Field(default_factory=Objectives)
    sampler: Literal["tpe", "nsga2", "random"] = Field("tpe", description="Optuna sampler")
    seed: int = Field(0, description="sampler seed; trial n's randomised merges use seed + n")
    split: Literal["val", "test"] = Field("val", description="split the search scores on (val only)")
    screening: Screening = Field(default_factory=Screening)
    final_candidates: int = Field(8, gt=0, description="most Pareto candidates re-scored on the test split")
    out: str | None = Field(None, description="run directory (default runs/merge/<name>)")
    storage: str | None = Field(None, description="Optuna storage URL (default sqlite in the run directory; "
                                "an RDB URL such as postgresql://... lets several workers share the study, and "
                                "so does journal:<file> on a file system they all mount)")
    eval_batch_size: int = Field(200, gt=0, le=4096, description="prompts per generate call when scoring "
                                 "(200: less CPU time per candidate than 64 on the lab, same answers there)")
    threads: int = Field(1, gt=0, description="torch CPU threads")
    device: DeviceName = Field("auto", description="where candidates are scored and OPD trials train: 'auto' (the "
                               "GPU when there is one, else the CPU), 'cpu', 'cuda' or 'cuda:N'; merges stay on the CPU")
    dtype: DtypeName = Field("auto", description="the scorer's and OPD students' weights: 'float32', 'bfloat16' or "
                             "'auto' (bfloat16 on a GPU that computes in it, else float32); merges run in float32")

    _one_verifier = model_validator(mode="before")(one_verifier)

    @field_validator("verifier")
    @classmethod
    def _no_reward_readers(cls, verifier, info):
        # a field validator, after `strategies` and `distill`: the error names the field `verifier`
        for name, params in (info.data.get("strategies") or {}).items() if verifier == "none" else ():
            strategy = get_strategy(name)
            reward = strategy.reward_setting(params)
            if reward is not None:
                raise ValueError(f"strategy {name!r} ({strategy.pretty}) reads the capability's reward ({reward}), "
                                 "which verifier: none rules out: drop it from strategies, or set verifier: capability")
        return verifier

    memory_budget: int = Field(16 << 30, gt=0, description="most bytes a merged candidate may take in memory "
                               "(bytes, or a string such as '8GB', '512MiB'); a larger one is merged tensor by "
                               "tensor to disk (<out>/spill/) and scored from there (docs/memory.md)")

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _bytes(cls, v):
        return parse_bytes(v)

    @model_validator(mode="after")
    def _check(self):
        if self.split != "val":
            raise ValueError("the search scores on 'val' only: tuning on the test split would leak it "
                             "into the scores the report gives")
        if self.tasks is not None and self.capabilities is not None:
            raise ValueError("give `tasks` or its old name `capabilities`, not both")
        if self.include_path is not None and not self.tasks and not self.capabilities:
            raise ValueError("include_path is set but no `tasks` name a task from it")
        names = self.tasks or self.capabilities or []
        if names:
            include = str(Path(self.include_path).resolve()) if self.include_path else None
            resolve_tasks(names, include)
        for c in names:
            get_capability(c)
        for i, e in enumerate(self.experts):
            for t in (e.tasks or []) if isinstance(e, ExpertEntry) else []:
                if names and t not in names:
                    raise ValueError(f"experts.{i}.tasks: {t!r} is not scored by this recipe (tasks: "
                                     f"{names}); add it there or drop it from the expert's tasks")
                try:
                    get_capability(t)
                except OpdError as err:
                    raise ValueError(f"experts.{i}.tasks: {err}") from None
        for name, params in self.strategies.items():
            strategy = get_strategy(name)
            for p in params:
                if p not in strategy.parameters:
                    raise ValueError(f"strategy {name!r} has no parameter {p!r}; it takes {strategy.parameters}")
            for p, default in strategy.shared.items():
                if default is None and p not in params:
                    raise ValueError(f"strategy {name!r} needs a value or range for {p!r}")
            for p, v in params.items():
                if isinstance(v, tuple) and not v[0] <= v[1]:
                    raise ValueError(f"strategy {name!r}: range for {p!r} must be [low, high]")
                if isinstance(v, LayerRange):
                    if p not in strategy.layerwise:
                        can = (f"its float parameters can: {sorted(strategy.layerwise)}" if strategy.layerwise
                               else "only a weight-space merge method's float parameters can")
                        raise ValueError(f"strategy {name!r}: {p!r} cannot be searched per layer group; {can}")
                    if not v.range[0] <= v.range[1]:
                        raise ValueError(f"strategy {name!r}: range for {p!r} must be [low, high]")
            strategy.check_params(params, self.distill)
        for name in self.budget.per_strategy:
            if name not in self.strategies:
                raise ValueError(f"budget.per_strategy names {name!r}, which is not among the strategies")
        return self

    @property
    def out_dir(self) -> Path:
        return Path(self.out or f"runs/merge/{self.name}")

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.out_dir / 'study.db').resolve()}"

    @property
    def storage_label(self) -> str:
        """`storage_url` as it may be printed or stored: without a password."""
        return redact_url(self.storage_url)

    @field_serializer("storage")
    def _redact_storage(self, v: str | None) -> str | None:
        # Every dump (results.json, best/manifest.json, the model card, the study's own record) leaves
        # the password out: give it with PGPASSWORD or ~/.pgpass instead.
        return redact_url(v)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_bytes(v):
    """'8GB' -> 8e9, '512MiB' -> 512 * 2**20, an int as it is (ValueError naming the units otherwise)."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", v)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"{v!r} is not a size: give bytes or a number with one of {sorted(_UNITS)[1:]}")
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    return v


def load_recipe(path: str | Path, overrides: list[str] = ()) -> MergeRecipe:
    return load_yaml_model(path, MergeRecipe, "merge recipe", list(overrides), defaults={"name": Path(path).stem})


def load_inputs(recipe: MergeRecipe) -> MergeInputs:
    """Load base and experts; refuse incompatible ones. Every expert is checked against the base
    (architecture, tensor names and shapes, tokenizer content) before any weights load
    (opd.model_inputs); an opd expert's manifest must name this base's hash and its weights' hash."""
    # lazy: the Auto classes add ~0.4 s to `opd merge`'s start, a bad recipe's included
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # absolute: mergekit reads a relative path that is not a directory as a hub model id
    base_path = require_model_dir(recipe.base, "base", "build it with scripts/build_base.py or set base= to a "
                                  "model directory").resolve()
    opened = open_experts(list(recipe.experts), base_path)
    paths = {n: e.path for n, e in opened.items()}
    manifests = {n: e.record for n, e in opened.items()}
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    base_model = AutoModelForCausalLM.from_pretrained(base_path, dtype="float32")
    # the value opd's manifests record for their base, computed once per version of the base's files
    base_hash = cached_hash("state_dict", base_path, read_header(base_path, "the base").files,
                            lambda: state_dict_hash(base_model))
    for n, m in manifests.items():
        if m.base is not None and m.base.content_hash != base_hash:
            raise OpdError(f"expert {n!r} was trained from base {m.base.content_hash}, not {base_path} ({base_hash})")
    base_sd = merge_keys(base_model.state_dict())
    sds = {}
    for n, p in paths.items():
        # an opd expert's weights against its manifest: the streamed hash, cached per version of the files
        # (opd.model_inputs.weights_hash equals state_dict_hash of the model loaded in float32); no load
        if not opened[n].byo and weights_hash(read_header(p, f"expert {n!r}")) != manifests[n].content_hash:
            raise OpdError(f"expert {n!r}: weights in {p} do not match its manifest's content_hash "
                           f"{manifests[n].content_hash} (changed after training?)")
        sds[n] = _held(p, list(base_sd))  # the tensor names and shapes were checked equal to the base's
    caps = list(recipe.tasks or recipe.capabilities or dict.fromkeys(t for m in manifests.values() for t in m.tasks))
    return MergeInputs(base_path, base_model, tokenizer, base_hash, paths, manifests, sds, caps,
                       base_sd=_held(base_path, list(base_sd), copy_of=base_sd), memory_budget=recipe.memory_budget,
                       spill_dir=recipe.out_dir / "spill")


def _held(path: Path, names: list[str], copy_of: dict | None = None):
    """How the search holds a model's weights: a lazy state dict over its safetensors (a tensor read on
    access, opd.weights.lazy) with `names` in order; a model stored otherwise (pytorch .bin) is loaded
    and kept in memory (`copy_of`: a live model's state dict, copied instead of loaded)."""
    try:
        return LazyStateDict(path, names=names)
    except (ValueError, KeyError, RuntimeError, FileNotFoundError):
        if copy_of is not None:
            return {k: v.detach().clone() for k, v in copy_of.items()}
        from transformers import AutoModelForCausalLM  # lazy: as in load_inputs

        return merge_keys(AutoModelForCausalLM.from_pretrained(path, dtype="float32").state_dict())
