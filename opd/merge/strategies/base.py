"""The strategy interface the search and the report ask, and the one registry of strategies.

A strategy turns the search's inputs (a base and its experts, `MergeInputs`) and one trial's
parameters (a `Candidate`) into a candidate model's weights. The search asks it whether it waits
for merges, what it records before building, how it builds weights (`build`) and whether a killed
trial resumes; the report asks it how the chosen model was made (`card`), the export whether a
trial is a merge (`check_export`). Neither ever branches on a strategy's name or kind: adding a
strategy is registering one more object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd.distill.config import DistillConfig
from opd.errors import OpdError
from opd.weights.merge import Candidate, merge_keys

# The stage a strategy's trial minutes count towards unless it names another (the report's split).
SEARCH_STAGE = "merge search"
# Where strategies that train keep their trials' runs: <out>/<RUNS_DIR>/trial-<n>/ (a fresh search
# deletes it; a rerun after an input changed moves it to the run directory's history).
RUNS_DIR = "opd"


class MergeInputs:
    """A recipe's base and experts, loaded and checked compatible: the search's fixed inputs
    (opd.merge.recipe.load_inputs loads them)."""

    def __init__(self, base_path: Path, base_model, tokenizer, base_hash: str,
                 experts: dict[str, Path], manifests: dict, expert_sds: Mapping, capabilities: list[str],
                 base_sd: Mapping | None = None, memory_budget: int | None = None, spill_dir: Path | None = None):
        # expert_sds: name -> Mapping tensor name -> tensor; load_inputs gives lazy ones
        # (opd.weights.lazy.LazyStateDict) that read a tensor from disk when indexed, so merges stream
        # and nothing holds every expert's weights. base_sd likewise; by default a copy (base_model is
        # the scorer's working model, its weights change with each candidate).
        self.base_sd = base_sd if base_sd is not None else {
            k: v.detach().clone() for k, v in merge_keys(base_model.state_dict()).items()}
        self.base_path, self.base_model, self.tokenizer, self.base_hash = base_path, base_model, tokenizer, base_hash
        self.expert_paths, self.manifests, self.expert_sds = experts, manifests, expert_sds
        self.capabilities = capabilities
        # a merged candidate larger than memory_budget bytes is written under spill_dir and scored from there
        self.memory_budget, self.spill_dir = memory_budget, spill_dir


@dataclass(frozen=True)
class BuildContext:
    """What a trained strategy needs beyond its inputs: the recipe's distillation settings, its run
    directory and name, its trial's record (`opd_init`), the trial number its run directory is named
    by, and the scorer for keep-best checks."""

    distill: DistillConfig  # the recipe's: the settings of a student's run its parameters do not set
    out_dir: Path
    name: str
    opd_init: Candidate | None
    number: int
    evaluate_fn: Callable | None = None
    references: dict[str, float] | None = None
    live: bool = False  # show the student's bars in the live display (opd.display)
    device: Any = None  # torch.device a student and its teachers train on (None: the base model's, the CPU)
    dtype: Any = None  # torch.dtype of their weights (None: the base model's, float32)


@dataclass(frozen=True)
class ModelCard:
    """How the best model's directory says it was made (opd.merge.report.save_best_model)."""

    kind: str  # manifest kind: "merged" or "distilled"
    recipe_file: str  # the file beside the weights that records how they were made
    recipe: dict  # that file's content
    how: str  # the card's "... {how}." sentence
    reproduce: str  # the sentence above the recipe's YAML
    tags: tuple[str, ...] = ()  # model-card tags beyond merge, mergekit, opd


@dataclass(frozen=True)
class Strategy:
    """A strategy as the search sees it: its inputs, its searchable parameters, and how it turns a
    candidate into weights. The search and report ask these methods, never the name."""

    name: str
    inputs: str  # opd.weights.merge.METHOD_INPUTS, or "distill" for a student from the base or best
    shared: dict[str, Any]  # parameter -> default (None when required)
    per_model: dict[str, Any]
    pretty: str
    # The float parameters a recipe may search per layer group (opd.weights.layers)
    layerwise: frozenset[str] = frozenset()

    # What the search asks of every strategy; each family gives its own answers.
    weight_space = False  # its weights are a mergekit merge of the inputs (it exports as a YAML)
    waits_for_merges = False  # it starts from the search's best merge, so it waits for one
    resumable = False  # a killed trial is queued again with its record (its run resumes)
    stage = SEARCH_STAGE  # the report's stage its trials' minutes count towards

    @property
    def parameters(self) -> list[str]:
        return list(self.shared) + list(self.per_model)

    def merge_part(self, cand: Candidate) -> Candidate | None:
        """The weight-space candidate its weights are or start from (None: the base or the best)."""
        return None

    def check_inputs(self, n_experts: int) -> None:
        """Refuse a strategy that cannot take this many experts, before any work is done."""

    def check_params(self, params: dict[str, Any], distill) -> None:
        """Refuse (ValueError) fixed parameters that cannot work with the recipe's `distill` block."""

    def reward_setting(self, params: dict[str, Any]) -> str | None:
        """The setting by which the strategy (with the recipe's `params`) would call a capability's
        reward, or None: a recipe with `verifier: none` refuses it. Weight-space merges read none."""
        return None

    def start(self, cand: Candidate, best_merge: Callable[[], Candidate | None]) -> dict[str, Any]:
        """Trial-record fields to set before the first build (`best_merge`: the search's best so far)."""
        return {}

    def build(self, inputs: MergeInputs, cand: Candidate, ctx: BuildContext | None = None
              ) -> tuple[dict, dict[str, Any]]:
        """(weights, trial-record fields) of the candidate."""
        raise NotImplementedError

    def card(self, cand: Candidate, base_path: str, expert_paths: dict[str, str], ctx: BuildContext) -> ModelCard:
        """How the chosen candidate (trial `ctx.number`, started from `ctx.opd_init`) was made."""
        raise NotImplementedError

    def check_export(self, number: int, run_dir: Path, run: int) -> None:
        """Refuse (OpdError) to export trial `number` (run directory number `run`) as a mergekit merge."""


# The registry: every strategy the search can run, by name.
STRATEGIES: dict[str, Strategy] = {}
_DESCRIBED: list[str] = []  # families listed in an error as one phrase, not name by name
_UNLISTED: set[str] = set()


def register(*strategies: Strategy, described_as: str | None = None) -> None:
    """Add strategies to the registry. A family too large to list name by name in an error (the
    `<method>+opd` hybrids) is `described_as` one phrase instead."""
    for s in strategies:
        if s.name in STRATEGIES:
            raise ValueError(f"strategy {s.name!r} is registered twice")
        STRATEGIES[s.name] = s
    if described_as is not None:
        _DESCRIBED.append(described_as)
        _UNLISTED.update(s.name for s in strategies)


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise OpdError(f"merge strategy {name!r} is unknown; strategies opd can search: "
                       f"{sorted(n for n in STRATEGIES if n not in _UNLISTED)}"
                       + "".join(f" and {d}" for d in _DESCRIBED))
    return STRATEGIES[name]


def stages() -> list[str]:
    """The report's stages that strategies' trial minutes count towards, in order (SEARCH_STAGE first)."""
    return list(dict.fromkeys([SEARCH_STAGE, *(s.stage for s in STRATEGIES.values())]))


def merge_part(cand: Candidate) -> Candidate | None:
    """The weight-space candidate a strategy starts from: itself for a merge method, the merge
    half of a `<method>+opd` hybrid, None for OPD from the base or from the search's best."""
    return get_strategy(cand.strategy).merge_part(cand)
