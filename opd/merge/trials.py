"""The typed record of one search trial, kept in one Optuna user attribute (`record`, JSON).

The search writes it as the trial goes (candidate and worker first, the scores last); the live
board, the report's results.json, the history and the export read it. `read` also reads a study
written before the record existed, whose trials kept the same fields as separate user attributes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from opd.weights.merge import Candidate

KEY = "record"


class TrialRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    candidate: Candidate | None = Field(None, description="what the trial ran (None until the sampler drew it)")
    worker: str | None = Field(None, description="host:pid of the process running it (several may share a study)")
    stage: Literal["screen", "full"] | None = Field(None, description="scored on the val subset or all of val")
    scores: dict[str, tuple[float, float, int]] | None = Field(None, description="capability -> (score, stderr, n)")
    retention: dict[str, float] | None = Field(None, description="capability -> score / reference score")
    min_retention: float | None = Field(None, description="min retention over the counted capabilities")
    opd_init: Candidate | None = Field(None, description="the merge a student started from (None: the base)")
    opd_history: list[dict[str, Any]] | None = Field(None, description="a trained strategy's run history")
    resume_of: int | None = Field(None, description="the killed trial this one continues (its run directory)")
    warm_start_of: int | None = Field(None, description="the earlier study's trial whose settings it retries")

    def fields(self) -> dict[str, Any]:
        """The fields set so far, as JSON (what results.json lists per trial); a field set to None
        (an OPD student from the base: opd_init None) is listed."""
        return self.model_dump(mode="json", include=set(self.model_fields_set))


def read(trial) -> TrialRecord:
    """The record of an Optuna trial (live or frozen)."""
    attrs = trial.user_attrs
    return TrialRecord.model_validate(attrs[KEY]) if KEY in attrs else from_results(attrs)


def from_results(entry: dict[str, Any]) -> TrialRecord:
    """The record of a trial entry of results.json (its record fields beside number, values, params)."""
    return TrialRecord.model_validate({k: v for k, v in entry.items() if k in TrialRecord.model_fields})


def update(trial, **fields) -> TrialRecord:
    """Set `fields` in a live trial's record; returns the new record."""
    record = TrialRecord.model_validate({**read(trial).fields(), **fields})
    trial.set_user_attr(KEY, record.fields())
    return record


def queued(**fields) -> dict[str, Any]:
    """`user_attrs` for `study.enqueue_trial`: the queued trial starts with this record."""
    return {KEY: TrialRecord(**fields).fields()}
