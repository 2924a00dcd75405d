"""The typed trial record (one user attribute) and the strategy interface the search asks instead of names."""

from __future__ import annotations

import json

import optuna
import pytest

from opd.errors import OpdError
from opd.merge.export import export_trial
from opd.merge.strategies import STRATEGIES, get_strategy
from opd.merge.strategies.distill import HYBRIDS
from opd.merge.trials import KEY, TrialRecord, from_results, queued, read, update
from opd.weights.merge import Candidate

CAND = Candidate(strategy="ties", shared={"lambda": 1.0}, per_model={"a": {"density": 0.5}}, seed=3)


def _trial():
    study = optuna.create_study(directions=["maximize"])
    return study, study.ask()


def test_record_is_one_user_attribute_written_in_steps():
    study, trial = _trial()
    update(trial, candidate=CAND, worker="h:1")
    rec = update(trial, opd_init=None, stage="full", scores={"add": (0.5, 0.1, 20)}, retention={"add": 0.9},
                 min_retention=0.9)
    assert list(trial.user_attrs) == [KEY] and read(trial) == rec and rec.candidate == CAND
    # only what was set is listed (results.json's trial entries): opd_init None is, resume_of is not
    assert rec.fields() == {"candidate": CAND.model_dump(mode="json"), "worker": "h:1", "stage": "full",
                            "scores": {"add": [0.5, 0.1, 20]}, "retention": {"add": 0.9}, "min_retention": 0.9,
                            "opd_init": None}
    study.tell(trial, [0.9])
    assert read(study.trials[0]) == rec  # a frozen trial reads the same


def test_queued_trial_starts_with_its_record_and_old_studies_still_read():
    study = optuna.create_study(directions=["maximize"])
    study.enqueue_trial({}, user_attrs=queued(resume_of=4, opd_init=CAND))
    trial = study.ask()
    assert read(trial).resume_of == 4 and read(trial).opd_init == CAND and read(trial).candidate is None
    # a study written before the record: the same fields as separate user attributes
    old = study.ask()
    for k, v in {"candidate": CAND.model_dump(mode="json"), "stage": "screen", "min_retention": 0.2,
                 "warm_start_of": 1}.items():
        old.set_user_attr(k, v)
    assert read(old) == TrialRecord(candidate=CAND, stage="screen", min_retention=0.2, warm_start_of=1)


def test_strategies_answer_the_search_without_names():
    merge, opd, best, hybrid = (get_strategy(n) for n in ("ties", "opd", "merge_opd", "ties+opd"))
    assert merge.weight_space and not opd.weight_space and not hybrid.weight_space
    assert best.waits_for_merges and not opd.waits_for_merges and not hybrid.waits_for_merges
    assert opd.resumable and not merge.resumable and {merge.stage, opd.stage} == {"merge search", "OPD"}
    # what each records before its first build: an OPD student's init, nothing for a merge
    assert merge.start(CAND, lambda: None) == {}
    assert opd.start(Candidate(strategy="opd"), lambda: CAND) == {"opd_init": None}
    assert best.start(Candidate(strategy="merge_opd"), lambda: CAND) == {"opd_init": CAND}
    cand = Candidate(strategy="ties+opd", shared={"lambda": 1.0, "steps": 2}, per_model={"a": {"density": 0.5}}, seed=3)
    assert hybrid.start(cand, lambda: None) == {"opd_init": CAND}
    # hybrids are registered, not parsed from the name: one per weight-space method
    assert set(HYBRIDS) == {f"{n}+opd" for n, s in STRATEGIES.items() if s.weight_space}
    assert all(STRATEGIES[h] is HYBRIDS[h] for h in HYBRIDS)


def test_results_entry_reads_back_as_the_record():
    rec = TrialRecord(candidate=CAND, stage="full", scores={"add": (0.5, 0.1, 20)}, resume_of=0)
    entry = {"number": 3, "values": [0.5], "params": {"x": 1}, **rec.fields()}
    assert from_results(entry) == rec


def test_export_refuses_a_student_naming_its_run(tmp_path):
    """The export asks the strategy (not its name) whether the trial is a merge; a resumed OPD trial's
    weights are in the run directory of the trial it resumed."""
    entry = {"number": 1, "values": [0.5], "params": {}, "candidate": {"strategy": "opd"}, "resume_of": 0}
    (tmp_path / "results.json").write_text(json.dumps({"trials": [entry]}))
    with pytest.raises(OpdError, match="trial 1 is a distilled student \\(opd\\).*opd/trial-0/student.safetensors"):
        export_trial(tmp_path, 1)


def test_strategies_say_how_the_best_model_was_made():
    """The best model's card comes from its strategy (the report has no per-kind branch): a mergekit
    merge's YAML, opd's own method's export command, a student's settings and initial merge."""
    from dataclasses import replace
    from pathlib import Path

    from opd.distill.config import DistillConfig
    from opd.merge.strategies import BuildContext

    ctx = BuildContext(DistillConfig(), Path("runs/merge/x"), "x", None, 7)
    paths = {"a": "/e/a"}
    ties = get_strategy("ties").card(CAND, "/b", paths, ctx)
    assert (ties.kind, ties.recipe_file, ties.recipe["merge_method"], ties.tags) == ("merged", "mergekit.yaml", "ties", ())
    assert "`mergekit-yaml mergekit.yaml OUT --random-seed 3`" in ties.reproduce
    iso = get_strategy("iso_c").card(Candidate(strategy="iso_c", seed=1), "/b", paths, ctx)
    assert "`python -m opd.merge export runs/merge/x 7`" in iso.reproduce and iso.recipe["merge_method"] == "iso_c"
    hybrid = Candidate(strategy="ties+opd", shared={"lambda": 1.0, "steps": 2}, per_model={"a": {"density": 0.5}})
    card = get_strategy("ties+opd").card(hybrid, "/b", paths, replace(ctx, opd_init=CAND))
    assert (card.kind, card.recipe_file, card.tags) == ("distilled", "distill.yaml", ("distillation",))
    assert card.recipe["init"]["merge_method"] == "ties" and card.recipe["opd"]["strategy"] == "ties+opd"
    assert get_strategy("opd").card(Candidate(strategy="opd"), "/b", paths, ctx).recipe["init"] == "base"


def test_final_candidates_reads_the_study_once_while_workers_finish_trials(tmp_path):
    """Another worker may complete a trial between two reads of a shared study: the final set is taken
    from one read (a second read once raised KeyError on the trial that appeared in between)."""
    import optuna
    import yaml

    from opd.merge import load_recipe
    from opd.merge.study import final_candidates
    from opd.merge.trials import update
    from opd.weights.merge import Candidate

    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"name": "r", "experts": ["a", "b"], "strategies": {"linear": {}},
                                                      "out": str(tmp_path / "out"), "final_candidates": 2}))
    recipe = load_recipe(tmp_path / "r.yaml")
    study = optuna.create_study(directions=["maximize", "maximize"])

    def complete(values):
        t = study.ask()
        update(t, candidate=Candidate(strategy="linear"), stage="full", min_retention=values[0])
        study.tell(t, values)

    complete([0.5, 0.9])
    complete([0.8, 0.2])
    get_trials = study.get_trials

    def growing(*args, **kwargs):  # each read sees one more trial, finished by another worker meanwhile
        trials = get_trials(*args, **kwargs)
        complete([0.1, 0.1])
        return trials

    study.get_trials = growing
    chosen = final_candidates(recipe, study)
    assert sorted(t.number for t in chosen) == [0, 1]
