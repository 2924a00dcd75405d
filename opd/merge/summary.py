"""A search run's summary: what <out>/results.json holds, and what the report, `opd report`, the
history of earlier studies and the lab's tables read back (as JSON: see `SearchSummary.to_json`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
from pydantic import BaseModel, ConfigDict, Field

from opd.merge import trials
from opd.merge.interference import to_records
from opd.merge.recipe import MergeRecipe
from opd.merge.references import References
from opd.merge.strategies import SEARCH_STAGE, MergeInputs, get_strategy, stages
from opd.merge.study import finished
from opd.model_inputs import hub_id

FROZEN = ConfigDict(frozen=True, extra="forbid")


class BaseInput(BaseModel):
    model_config = FROZEN

    path: str = Field(description="the base model's directory")
    content_hash: str = Field(description="opd.io.state_dict_hash of its weights")
    hub_id: str | None = Field(description="the Hub repo it came from, when known (opd.model_inputs.hub_id)")


class ExpertInput(BaseModel):
    model_config = FROZEN

    path: str = Field(description="the expert's directory")
    content_hash: str = Field(description="opd.io.state_dict_hash of its weights (its manifest's)")
    version: int = Field(description="its manifest's version")
    capability: str = Field(description="the capability it was trained on (a BYO expert: its first task)")
    tasks: list[str] = Field(description="the tasks it is an expert in (routing and retention)")
    kind: str = Field(description="'expert' (trained by opd) or 'byo' (a fine-tune)")
    hub_id: str | None = Field(description="the Hub repo its weights came from, when known")


class Inputs(BaseModel):
    model_config = FROZEN

    base: BaseInput = Field(description="the base model every expert was trained from")
    experts: dict[str, ExpertInput] = Field(description="expert name -> the expert the search merged")


class Final(BaseModel):
    model_config = FROZEN

    trial: int = Field(description="the trial's number in the study")
    candidate: dict[str, Any] = Field(description="its candidate (opd.weights.merge.Candidate as JSON)")
    label: str = Field(description="the candidate in one line (Candidate.label)")


# Fields a summary has only at some point of the run or for some runs: results.json leaves them out
# while unset (the report is written before best_model and the seconds are known).
OPTIONAL = ("weightspace", "what_changed", "best_model", "seconds", "total_seconds")


class SearchSummary(BaseModel):
    """One run of a merge recipe: its inputs, every finished trial, the final candidates re-scored on
    test and the best one (chosen on val), the interference matrices and the time per stage."""

    model_config = FROZEN

    recipe: dict[str, Any] = Field(description="the recipe as run (MergeRecipe as JSON)")
    study: str = Field(description="the Optuna study's name (the recipe's name and its inputs' hashes)")
    inputs: Inputs = Field(description="the base and experts, with their content hashes")
    objectives: list[str] = Field(description="the study's objective names, in the order of a trial's values")
    counted: list[str] = Field(description="the capabilities that count in min/mean retention")
    owners: dict[str, str] = Field(description="capability -> the expert whose score is its reference")
    split_rules: dict[str, str] = Field(description="lm-eval task -> how its val/test were split from one split")
    trials: list[dict[str, Any]] = Field(description="each finished trial: number, values, params and its "
                                         "record's fields (opd.merge.trials.TrialRecord)")
    final: dict[str, Final] = Field(description="label -> a final candidate, re-scored on test")
    best: str = Field(description="the label of the best final candidate (by val)")
    matrix: dict[str, list[dict[str, Any]]] = Field(description="split -> the interference matrix's cells "
                                                    "(opd.merge.interference.Cell as dicts)")
    scorer_calls: int = Field(description="state dicts the scorer scored in this invocation")
    stages: dict[str, float] = Field(description="minutes per stage of this invocation")
    weightspace: dict[str, Any] | None = Field(None, description="task-vector statistics per layer group "
                                               "(opd.merge.weightspace; two experts or more)")
    what_changed: dict[str, Any] | None = Field(None, description="what changed since the earlier study of "
                                                "this recipe (opd.merge.history.what_changed)")
    best_model: str | None = Field(None, description="the directory the best candidate was saved to")
    seconds: float | None = Field(None, description="seconds this invocation took")
    total_seconds: float | None = Field(None, description="seconds every invocation of this study took")

    def to_json(self) -> dict[str, Any]:
        """As results.json holds it: the fields above, less the optional ones not set yet."""
        return self.model_dump(exclude={k for k in OPTIONAL if getattr(self, k) is None})


def earlier_seconds(results: Path, study: str) -> float:
    """Seconds the earlier invocations of `study` took (0 when results.json is another study's)."""
    try:
        prev = json.loads(results.read_text())
    except (OSError, ValueError):
        return 0.0
    return float(prev.get("total_seconds", prev.get("seconds", 0.0))) if prev.get("study") == study else 0.0


def stage_minutes(recipe: MergeRecipe, study: optuna.Study, refs_s: float, search_s: float,
                  final_s: float) -> dict[str, float]:
    """Minutes per stage of this invocation: the lab's base and experts when the lab pipeline recorded
    them (<out>/lab_stages.json), scoring the references, the search split into weight-space trials and
    OPD trials (by trial durations), and the test re-scoring of the finalists."""
    try:
        lab = json.loads((recipe.out_dir / "lab_stages.json").read_text())
    except (OSError, ValueError):
        lab = {}
    spent = dict.fromkeys(stages(), 0.0)  # each strategy's trials count towards its stage
    for t in finished(study):
        cand = trials.read(t).candidate
        if t.duration is not None and cand is not None:
            spent[get_strategy(cand.strategy).stage] += t.duration.total_seconds()
    # the rest of the search's time (sampling, screening, bookkeeping) is the weight-space search's
    spent[SEARCH_STAGE] = max(0.0, search_s - sum(v for k, v in spent.items() if k != SEARCH_STAGE))
    return {**{k: float(v) for k, v in lab.items()}, "reference scoring": refs_s / 60,
            **{k: v / 60 for k, v in spent.items()}, "test scoring": final_s / 60}


def summarize(recipe: MergeRecipe, study: optuna.Study, inputs: MergeInputs, refs: References,
              objectives: list[str], cands: dict, matrix: dict, best: str, scorer_calls: int,
              minutes: dict[str, float]) -> SearchSummary:
    """The summary of a search whose final candidates `cands` ({label: (trial, candidate)}, best first)
    were re-scored into `matrix` ({split: cells})."""
    manifests = inputs.manifests
    return SearchSummary(
        recipe=recipe.model_dump(mode="json"),
        study=study.study_name,
        inputs=Inputs(base=BaseInput(path=str(inputs.base_path), content_hash=inputs.base_hash,
                                     hub_id=hub_id(inputs.base_path)),
                      experts={e: ExpertInput(path=str(p), content_hash=manifests[e].content_hash,
                                              version=manifests[e].version, capability=manifests[e].capability,
                                              tasks=manifests[e].tasks, kind=manifests[e].kind,
                                              hub_id=manifests[e].hub_id)
                               for e, p in inputs.expert_paths.items()}),
        objectives=objectives,
        counted=refs.counted,
        owners=refs.owner,
        # lm-eval tasks whose val/test are a hash split of one split (the report says so)
        split_rules={c: s.split_rule for c, s in refs.base["test"].items() if s.split_rule},
        trials=[{"number": t.number, "values": t.values, "params": t.params, **trials.read(t).fields()}
                for t in finished(study)],
        final={label: Final(trial=t.number, candidate=c.model_dump(mode="json"), label=c.label())
               for label, (t, c) in cands.items()},
        best=best,
        matrix={s: to_records(cells) for s, cells in matrix.items()},
        scorer_calls=scorer_calls,
        stages=minutes,
    )
