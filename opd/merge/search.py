"""The merge search: an Optuna study over strategies (opd.merge.strategies), scored in-process, cheap first.

`run_recipe(recipe)` is the whole run: load and check inputs, score the references, search
(resumable from the study's storage), re-score the Pareto set on test, write the report and
the best merged model. Its parts live beside it: the study (storage, workers, resume) in
opd.merge.study, the search space in opd.merge.space, the references and the scorer in
opd.merge.references, the summary (results.json) in opd.merge.summary.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import time
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from opd.devices import resolve_device, resolve_dtype
from opd.display import LiveBoard
from opd.evaluation.api import Score, evaluate
from opd.io import atomic_write_json
from opd.merge import history, trials
from opd.merge.interference import MIN_GAIN_Z, interference_matrix, retention
from opd.merge.recipe import MergeRecipe, load_inputs
from opd.merge.references import References, Scorer, score_references
from opd.merge.report import best_table, headline, save_best_model, trial_line, write_report
from opd.merge.space import suggest
from opd.merge.strategies import RUNS_DIR, BuildContext, MergeInputs, get_strategy
from opd.merge.study import (
    best_merge,
    final_candidates,
    finished,
    open_study,
    run_number,
    start_over,
    trial_budget,
    warm_budget,
)
from opd.merge.summary import earlier_seconds, stage_minutes, summarize
from opd.merge.weightspace import weightspace_interference
from opd.paths import check_output
from opd.weights.merge import Candidate

# What an existing run directory of a merge recipe holds (one of them at least).
RUN_DIR_MARKERS = ("current.json", "study.db", "results.json", RUNS_DIR, "lab_stages.json", "workers")


def aggregate_retention(ret: dict[str, float], counted: list[str] | None = None) -> dict[str, float]:
    """min and mean retention over the `counted` capabilities (all of `ret` when None or none)."""
    vals = [ret[c] for c in (counted or ret) if c in ret] or list(ret.values())
    return {"min": min(vals), "mean": sum(vals) / len(vals)}


def objective_names(recipe: MergeRecipe, caps: list[str]) -> list[str]:
    return ([f"retention:{c}" for c in caps] if recipe.objectives.per_capability else []) + \
           [f"{a}_retention" for a in recipe.objectives.aggregates]


def objective_values(recipe: MergeRecipe, ret: dict[str, float], counted: list[str] | None = None) -> list[float]:
    aggs = aggregate_retention(ret, counted)
    return ([ret[c] for c in ret] if recipe.objectives.per_capability else []) + \
           [aggs[a] for a in recipe.objectives.aggregates]


def run_search(recipe: MergeRecipe, inputs: MergeInputs, scorer: Scorer, refs: References, study: optuna.Study,
               *, live: bool = True, log=None) -> None:
    """The search loop: merge in memory, screen on a val subset, promote to full val, record. Without
    the live display, `log` gets one line per finished trial."""
    experts, caps = list(inputs.expert_paths), inputs.capabilities
    screen = recipe.screening
    two_stage = screen.limit is not None

    def objective(trial: optuna.Trial) -> list[float]:
        # first: a --resume from another process tells a live worker's trial from an abandoned one by it
        # (several workers may share a study)
        trials.update(trial, worker=f"{socket.gethostname()}:{os.getpid()}")
        cand = suggest(trial, recipe, experts)
        rec = trials.update(trial, candidate=cand)
        if rec.resume_of is None:  # a resumed trial keeps the start it was queued with
            start = get_strategy(cand.strategy).start(cand, lambda: best_merge(trial.study))
            rec = trials.update(trial, **start) if start else rec
        sd = merge(inputs, cand, recipe, trial, refs, live=live)
        stage, scores = "full", None
        if two_stage and rec.warm_start_of is None:  # an earlier best goes straight to full val
            scores = scorer.score(sd, "val", screen.limit)
            ret = {c: retention(scores[c].score, refs.screen[c]) for c in caps}
            full = [r for t in finished(trial.study) if (r := trials.read(t)).stage == "full"]
            best = max((r.min_retention for r in full), default=-math.inf)
            worst = aggregate_retention(ret, refs.counted)["min"]
            stage = "full" if len(full) < screen.warmup or worst >= best - screen.margin else "screen"
        if stage == "full":
            scores = scorer.score(sd, "val")
            ret = {c: retention(scores[c].score, refs.val[c]) for c in caps}
        trials.update(trial, stage=stage, scores={c: (s.score, s.stderr, s.n) for c, s in scores.items()},
                      retention=ret, min_retention=aggregate_retention(ret, refs.counted)["min"])
        return objective_values(recipe, ret, refs.counted)

    done = len(finished(study))
    n_trials = trial_budget(recipe, study)
    # An OPD trial a killed worker left is requeued (open_study) and redone even when the other
    # workers have met the budget meanwhile: it gets its one result and its checkpoint is used up,
    # not left WAITING for ever. Optuna hands out waiting trials first.
    requeued = sum(trials.read(t).resume_of is not None
                   for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    if n_trials is not None:
        n_trials = max(n_trials, done + requeued)
    remaining = None if n_trials is None else n_trials - done
    if remaining is not None and remaining <= 0:
        return
    callbacks = []
    if n_trials is not None:
        callbacks.append(optuna.study.MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE,)))
    board = LiveBoard("merge search", n_trials, done, lambda: best_table(study), enabled=live, log=log)

    def advance(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        # the study's count, so that workers sharing it agree
        board.advance(lambda: trial_line(trial, len(finished(study)), n_trials))

    callbacks.append(advance)
    with board:
        study.optimize(objective, n_trials=remaining, timeout=recipe.budget.timeout_s, callbacks=callbacks,
                       catch=(ValueError, RuntimeError))


def merge(inputs: MergeInputs, cand: Candidate, recipe: MergeRecipe | None = None, trial=None,
          refs: References | None = None, live: bool = False) -> dict:
    """The candidate's weights, built by its strategy: a mergekit merge, or for a trained strategy the
    student trained (once per trial, then read from <out>/opd/trial-<n>/, n the trial it resumes if
    requeued) from the init recorded in the trial. What the build reports goes into the trial's record."""
    ctx = None
    if recipe is not None and trial is not None:
        evaluate_fn = None
        if recipe.distill.eval_every and refs is not None:
            def evaluate_fn(m):
                return {c: s.score for c, s in evaluate(m, inputs.tokenizer, inputs.capabilities, "val",
                                                        limit=recipe.distill.eval_limit,
                                                        batch_size=recipe.eval_batch_size).items()}
        device = resolve_device(recipe.device)
        ctx = BuildContext(recipe.distill, recipe.out_dir, recipe.name, trials.read(trial).opd_init, run_number(trial),
                           evaluate_fn, {c: refs.val[c] for c in refs.counted or refs.val} if refs else None, live,
                           device, resolve_dtype(recipe.dtype, device))
    sd, record = get_strategy(cand.strategy).build(inputs, cand, ctx)
    if record and isinstance(trial, optuna.Trial):
        trials.update(trial, **record)
    return sd


def rescore_final(inputs: MergeInputs, scorer: Scorer, refs: References, finals: list,
                  recipe: MergeRecipe | None = None) -> tuple[dict, dict]:
    """Score the final candidates on test; the interference matrix on val and test, with the
    experts and the base as reference rows. Returns ({label: (trial, candidate)}, {split: cells})."""
    val, test, cands = {}, {}, {}
    for t in finals:
        rec = trials.read(t)
        label = f"#{t.number} {rec.candidate.strategy}"
        cands[label] = (t, rec.candidate)
        val[label] = {c: Score(*rec.scores[c]) for c in inputs.capabilities}
        test[label] = scorer.score(merge(inputs, cands[label][1], recipe, t), "test")
    for e in inputs.expert_paths:
        val[f"expert {e}"], test[f"expert {e}"] = refs.experts["val"][e], refs.experts["test"][e]
    val["base"], test["base"] = refs.base["val"], refs.base["test"]
    base = {split: {c: s.score for c, s in refs.base[split].items()} for split in ("val", "test")}
    return cands, {"val": interference_matrix(val, refs.val, base["val"], "val"),
                   "test": interference_matrix(test, refs.test, base["test"], "test")}


def run_recipe(recipe: MergeRecipe, *, resume: bool = False, worker: bool = False, live: bool = True,
               fresh: bool = False, log=print) -> dict:
    """Run a merge recipe end to end; returns the summary as written to <out>/results.json
    (opd.merge.summary.SearchSummary as JSON; a --worker: {"trials": its study's finished trials}).

    `resume` continues the study where a killed or finished run left it; `fresh` deletes the study
    and its OPD students first and starts over (the command line resumes unless --fresh).

    The study is named by the inputs' content hashes: after an expert changed, a rerun opens a new
    study that starts from the earlier run's best settings, and the report opens with what changed.
    """
    torch.set_num_threads(recipe.threads)
    t0 = time.time()
    check_output(recipe.out_dir, "out", markers=RUN_DIR_MARKERS)
    inputs = load_inputs(recipe)
    for name in recipe.strategies:
        get_strategy(name).check_inputs(len(inputs.expert_paths))
    study, prev = start_study(recipe, inputs, resume, worker, fresh, log)
    device = resolve_device(recipe.device)
    dtype = resolve_dtype(recipe.dtype, device)
    scorer = Scorer(inputs, recipe.eval_batch_size, device, dtype, recipe.scoring)
    log(f"scoring on {device} in {str(dtype).removeprefix('torch.')}")
    log(f"scoring base and {len(inputs.expert_paths)} experts on {inputs.capabilities}")
    refs = score_references(inputs, scorer, recipe.screening.limit)
    left_out = [c for c in inputs.capabilities if c not in refs.counted]
    if left_out:
        log(f"not counted in min/mean retention (the expert does not beat the base by {MIN_GAIN_Z:g} stderr on "
            f"val): {', '.join(left_out)}")
    t_search = time.time()
    run_search(recipe, inputs, scorer, refs, study, live=live, log=log)
    if worker:
        return {"trials": len(finished(study))}
    return finish(recipe, inputs, study, scorer, refs, prev, t0, t_search, log)


def start_study(recipe: MergeRecipe, inputs: MergeInputs, resume: bool, worker: bool, fresh: bool,
                log) -> tuple[optuna.Study, dict | None]:
    """The study named by the inputs' hashes, and the earlier study's results.json when the inputs
    changed since (None after --fresh): a new study starts from its best settings."""
    hashes = {e: m.content_hash for e, m in inputs.manifests.items()}
    name = history.study_name(recipe, inputs.base_hash, hashes)
    recipe.out_dir.mkdir(parents=True, exist_ok=True)
    prev = history.previous_results(recipe.out_dir, history.switch_study(recipe.out_dir, name, recipe.name))
    if fresh:
        start_over(recipe, name, log)
        prev = None  # no warm start from an earlier study either
    warm = None
    if prev is not None and recipe.budget.n_trials is not None:
        params = history.warm_params(prev, recipe, list(inputs.expert_paths), warm_budget(recipe))
        warm = (prev.get("study", prev["recipe"]["name"]), params) if params else None
    study = open_study(recipe, len(objective_names(recipe, inputs.capabilities)), resume, worker,
                       name=name, warm=warm, log=log)
    if warm:
        log(f"inputs changed since study {warm[0]}: new study {name}, starting from its {len(warm[1])} best settings")
    return study, prev


def finish(recipe: MergeRecipe, inputs: MergeInputs, study: optuna.Study, scorer: Scorer, refs: References,
           prev: dict | None, t0: float, t_search: float, log) -> dict:
    """After the search: re-score the finalists on test, save the best (chosen on val) and write the
    report and results.json; returns what results.json holds."""
    t_final = time.time()
    finals = final_candidates(recipe, study)
    log(f"re-scoring {len(finals)} final candidates on test")
    cands, matrix = rescore_final(inputs, scorer, refs, finals, recipe)
    # The best model is chosen on val (the search's split, Pareto set ordered by min retention); test only reports.
    best_label, (best_trial, best_cand) = next(iter(cands.items()))
    minutes = stage_minutes(recipe, study, t_search - t0, t_final - t_search, time.time() - t_final)
    summary = summarize(recipe, study, inputs, refs, objective_names(recipe, inputs.capabilities), cands, matrix,
                        best_label, scorer.calls, minutes)
    if len(inputs.expert_sds) >= 2:  # the report's weight-space heatmaps: why a capability was lost
        summary = summary.model_copy(update={"weightspace": weightspace_interference(inputs.base_sd,
                                                                                     inputs.expert_sds)})
    if prev is not None:
        summary = summary.model_copy(update={"what_changed": history.what_changed(prev, summary.to_json())})
    best_dir = save_best_model(recipe, inputs, best_cand, merge(inputs, best_cand, recipe, best_trial),
                               summary.to_json())
    summary = summary.model_copy(update={"best_model": str(best_dir)})
    if inputs.spill_dir is not None:  # the last over-budget candidate (memory_budget): saved as best/ if it won
        shutil.rmtree(inputs.spill_dir, ignore_errors=True)
    write_report(recipe, summary.to_json(), matrix)
    seconds = time.time() - t0
    # A resumed or re-run study adds this invocation's time to the earlier ones' (the report of a
    # study that was killed halfway and resumed shows what the whole search cost).
    summary = summary.model_copy(update={"seconds": seconds, "total_seconds": seconds + earlier_seconds(
        recipe.out_dir / "results.json", study.study_name)})
    results = summary.to_json()
    atomic_write_json(recipe.out_dir / "results.json", results)
    log(headline(results))
    log(f"best: {best_label} -> {best_dir}; report: {Path(recipe.out_dir) / 'report.html'}")
    return results
