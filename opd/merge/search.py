"""The merge search: an Optuna study over strategies (opd.merge.strategies), scored in-process, cheap first.

`run_recipe(recipe)` is the whole run: load and check inputs, score the references, search
(resumable from the study's storage), re-score the Pareto set on test, write the report and
the best merged model.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import torch

from opd.devices import place, resolve_device, resolve_dtype
from opd.display import LiveBoard
from opd.errors import OpdError
from opd.evaluation.api import Score, evaluate
from opd.io import atomic_write_json, pid_alive, state_dict_hash
from opd.merge import history, trials
from opd.merge.interference import (
    MIN_GAIN_Z,
    gain_z,
    interference_matrix,
    pareto_front,
    retention,
    to_records,
)
from opd.merge.recipe import Choices, LayerRange, MergeRecipe, load_inputs
from opd.merge.report import best_table, headline, save_best_model, trial_line, write_report
from opd.merge.strategies import RUNS_DIR, SEARCH_STAGE, BuildContext, MergeInputs, get_strategy, stages
from opd.merge.weightspace import weightspace_interference
from opd.model_inputs import hub_id
from opd.paths import check_output, redact_url
from opd.weights.layers import LayerValues
from opd.weights.lazy import load_into
from opd.weights.merge import Candidate

# What an existing run directory of a merge recipe holds (one of them at least).
RUN_DIR_MARKERS = ("current.json", "study.db", "results.json", RUNS_DIR, "lab_stages.json", "workers")


class Scorer:
    """Scores state dicts on one reusable model object (no model rebuilt, no subprocess)."""

    def __init__(self, inputs: MergeInputs, batch_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, scoring=None):
        """Scores on `device` in `dtype`: on the base model itself on the CPU in float32, else on a copy
        there (the base stays on the CPU in float32, where the merges read it). `scoring` (the recipe's):
        vllm / sglang score each candidate from disk."""
        device = torch.device(device)
        self.scoring = scoring
        self.model = inputs.base_model if (device.type, dtype) == ("cpu", torch.float32) else \
            place(copy.deepcopy(inputs.base_model), device, dtype)
        self.base_sd = inputs.base_sd
        self.tokenizer, self.caps, self.batch_size = inputs.tokenizer, inputs.capabilities, batch_size
        self.calls = 0

    def score(self, sd: dict, split: str, limit: int | None = None, caps: list[str] | None = None) -> dict[str, Score]:
        # tensor by tensor (sd may be lazy); a tied lm_head follows the embedding. The merged weights stay on
        # the CPU in float32: copy_ moves each onto the scorer's device and dtype
        load_into(self.model, sd)
        self.calls += 1
        if self.scoring is not None and self.scoring.backend != "hf":
            from opd.evaluation.backends import evaluate_on_disk

            return evaluate_on_disk(self.model, self.tokenizer, self.scoring, caps or self.caps, split, limit,
                                    state_dict_hash(self.model))
        return evaluate(self.model, self.tokenizer, caps or self.caps, split, limit=limit,
                        batch_size=self.batch_size, model_hash=state_dict_hash(self.model))


@dataclass
class References:
    """Per-capability reference scores: the owning expert's, else the base's."""

    screen: dict[str, float] = field(default_factory=dict)
    val: dict[str, float] = field(default_factory=dict)
    test: dict[str, float] = field(default_factory=dict)
    base: dict[str, dict[str, Score]] = field(default_factory=dict)  # split -> cap -> score
    experts: dict[str, dict[str, dict[str, Score]]] = field(default_factory=dict)  # split -> expert -> cap
    # The capabilities whose expert beats the base on full val (MIN_GAIN_Z): the min/mean objectives and
    # OPD's keep-best checkpoint count only these (all capabilities when none does).
    counted: list[str] = field(default_factory=list)
    owner: dict[str, str] = field(default_factory=dict)  # capability -> the expert its reference is


def score_references(inputs: MergeInputs, scorer: Scorer, screen_limit: int | None) -> References:
    refs = References()
    for split in ("val", "test"):
        refs.base[split] = scorer.score(scorer.base_sd, split)
        refs.experts[split] = {e: scorer.score(sd, split) for e, sd in inputs.expert_sds.items()}
    owner = {}
    for e, m in inputs.manifests.items():
        for cap in m.tasks:  # a task several experts list is owned by the best of them on val
            if cap in inputs.capabilities:
                best = owner.get(cap)
                if best is None or refs.experts["val"][e][cap].score > refs.experts["val"][best][cap].score:
                    owner[cap] = e
    for cap in inputs.capabilities:
        e = owner.get(cap)
        val, test = (refs.experts["val"][e], refs.experts["test"][e]) if e else (refs.base["val"], refs.base["test"])
        refs.val[cap], refs.test[cap] = val[cap].score, test[cap].score
        sd = inputs.expert_sds[e] if e else scorer.base_sd
        refs.screen[cap] = scorer.score(sd, "val", screen_limit, [cap])[cap].score if screen_limit else refs.val[cap]
    refs.owner = owner
    b = refs.base["val"]
    refs.counted = [c for c in inputs.capabilities if owner.get(c) and gain_z(
        refs.experts["val"][owner[c]][c].score, refs.experts["val"][owner[c]][c].stderr, b[c].score, b[c].stderr)
        >= MIN_GAIN_Z] or list(inputs.capabilities)
    return refs


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


def open_strategies(trial: optuna.Trial, recipe: MergeRecipe) -> list[str]:
    """The strategies whose `budget.per_strategy` trial cap is not used up (finished or running trials)."""
    caps = recipe.budget.per_strategy
    names = list(recipe.strategies)
    if not caps:
        return names
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
    used: dict[str, int] = {}
    for t in trial.study.get_trials(deepcopy=False, states=states):
        cand = trials.read(t).candidate
        if t.number != trial.number and cand is not None:
            s = cand.strategy
            used[s] = used.get(s, 0) + 1
    return [n for n in names if used.get(n, 0) < caps.get(n, math.inf)]


def merges_ready(study: optuna.Study, recipe: MergeRecipe) -> bool:
    """Whether a strategy that starts from the best merge so far (`waits_for_merges`) may run: once a
    weight-space candidate was scored on full val and half of budget.n_trials have finished, so its
    student starts from a searched merge rather than the first one (or the base)."""
    done = finished(study)
    merged = best_merge(study) is not None
    return merged and len(done) >= (recipe.budget.n_trials or 0) // 2


def available_strategies(trial: optuna.Trial, recipe: MergeRecipe) -> list[str]:
    """`open_strategies`, less those that wait for merges (unless nothing else is left)."""
    names = open_strategies(trial, recipe)
    if merges_ready(trial.study, recipe):
        return names
    ready = [n for n in names if not get_strategy(n).waits_for_merges]
    return ready or names


def suggest(trial: optuna.Trial, recipe: MergeRecipe, experts: list[str]) -> Candidate:
    """Sample one candidate; every parameter is named `<strategy>.<param>[.<expert>]`, a layer-wise
    one `<strategy>.<param>[.<expert>]@<group>` (embed, block0, block1, ..., head)."""
    names = available_strategies(trial, recipe)
    if not names:
        trial.study.stop()
        raise optuna.TrialPruned("every strategy has used its budget.per_strategy trials")
    # Optuna refuses a categorical whose choices change under one name: once a strategy's cap is
    # reached, the remaining choice set gets a name of its own.
    key = "strategy" if names == list(recipe.strategies) else f"strategy[{'|'.join(names)}]"
    name = trial.suggest_categorical(key, names) if len(names) > 1 else names[0]
    strategy = get_strategy(name)

    def pick(key: str, spec):
        if isinstance(spec, tuple):
            lo, hi = spec
            default = strategy_default(key)
            if isinstance(default, int) and not isinstance(default, bool):
                return trial.suggest_int(key, math.ceil(lo), math.floor(hi))
            return trial.suggest_float(key, lo, hi)
        if isinstance(spec, Choices):
            return trial.suggest_categorical(key, spec.choices)
        if isinstance(spec, LayerRange):  # one value per group: <key>@embed, <key>@block<i>, <key>@head
            lo, hi = spec.range
            return LayerValues(embed=trial.suggest_float(f"{key}@embed", lo, hi),
                               blocks=[trial.suggest_float(f"{key}@block{i}", lo, hi) for i in range(spec.layer_groups)],
                               head=trial.suggest_float(f"{key}@head", lo, hi))
        return spec

    def strategy_default(key):
        p = key.split(".")[1]
        return strategy.shared.get(p, strategy.per_model.get(p))

    params = recipe.strategies[name]
    shared = {p: pick(f"{name}.{p}", v) for p, v in params.items() if p in strategy.shared}
    per_model = {e: {p: pick(f"{name}.{p}.{e}", v) for p, v in params.items() if p in strategy.per_model}
                 for e in experts}
    number = run_number(trial)  # a requeued OPD trial keeps its seed
    return Candidate(strategy=name, shared=shared, per_model=per_model, seed=recipe.seed + number)


def make_sampler(recipe: MergeRecipe, offset: int = 0) -> optuna.samplers.BaseSampler:
    """`offset` (trials already in the study) shifts the seed, so a resumed or second worker's
    sampler does not replay the first run's draws."""
    seed = recipe.seed + offset
    if recipe.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=8)
    if recipe.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=6)


# Fields that define the search space and its objectives: a study cannot continue under others.
SEARCH_FIELDS = ("base", "experts", "capabilities", "strategies", "objectives", "split", "verifier")
# SEARCH_FIELDS added later: a study recorded before one existed was made with its default (a study
# made with the verifier must not pick its best among students trained without one, or the reverse).
SEARCH_FIELD_DEFAULTS = {"verifier": "capability"}


def open_study(recipe: MergeRecipe, n_objectives: int, resume: bool, worker: bool, *, name: str | None = None,
               warm: tuple[str, list[tuple[int, dict]]] | None = None, log=lambda *_: None) -> optuna.Study:
    """Create the study `name` (default: the recipe's name), or continue it with `resume` (or join it
    as a --worker). A study created with `warm` = (earlier study, [(its trial number, params)]) runs
    those params first and stops at `budget.warm_fraction` of the trials (`trial_budget`)."""
    name = name or recipe.name
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    recipe.out_dir.mkdir(parents=True, exist_ok=True)
    storage = study_storage(recipe)
    summary = {s.study_name: s for s in optuna.get_all_study_summaries(storage)}.get(name)
    exists = summary is not None
    if exists and not (resume or worker):
        raise OpdError(f"study {name!r} already exists in {recipe.storage_label}: pass resume=True to continue it"
                       " or fresh=True to start over (the command line resumes unless --fresh)")
    offset = summary.n_trials if exists else 0
    study = optuna.create_study(study_name=name, storage=storage, sampler=make_sampler(recipe, offset),
                                directions=["maximize"] * n_objectives, load_if_exists=True)
    mine = recipe.model_dump(mode="json")
    theirs = study.user_attrs.get("recipe")
    changed = [f for f in SEARCH_FIELDS if theirs and theirs.get(f, SEARCH_FIELD_DEFAULTS.get(f)) != mine[f]]
    if changed:
        raise OpdError(f"study {name!r} in {recipe.storage_label} was made with other {changed}: "
                       "restore them, or give the recipe another name or out directory")
    if exists and resume and not worker:
        # A killed single-worker run leaves its trial RUNNING forever; it is redone, not kept. An OPD
        # trial is queued again with its own parameters, seed and init, so its run continues from its
        # checkpoint instead of starting over.
        running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        deadline = time.monotonic() + WORKER_TAG_WAIT_S
        abandoned = [t for t in running if _abandoned(t, storage, study, deadline)]
        if running:
            log(f"resume: {len(running) - len(abandoned)} running trials kept (their workers are alive), "
                f"{len(abandoned)} abandoned ones failed")
        for t in abandoned:  # another worker's live trial is left running: its result must be accepted
            storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
            rec = trials.read(t)
            if rec.candidate and get_strategy(rec.candidate.strategy).resumable:
                study.enqueue_trial(t.params, user_attrs=trials.queued(resume_of=run_number(t), opd_init=rec.opd_init))
    if warm and not exists and not theirs:
        # Two workers creating the study at once may both get here: a duplicate costs one trial.
        study.set_user_attr("warm_start", {"from": warm[0], "trials": [n for n, _ in warm[1]]})
        for number, params in warm[1]:
            study.enqueue_trial(params, user_attrs=trials.queued(warm_start_of=number), skip_if_exists=True)
    study.set_user_attr("recipe", mine)
    return study


JOURNAL = "journal:"


def study_storage(recipe: MergeRecipe):
    """The recipe's Optuna storage: an RDB (SQLite, PostgreSQL, ...), or `journal:<path>`, Optuna's
    JournalStorage on a file (optuna/storages/journal/_file.py: appends under a lock file, so workers on
    several machines can share it over a shared file system, where SQLite's locks are unreliable)."""
    url = recipe.storage_url
    try:
        if url.startswith(JOURNAL):
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(str(Path(url.removeprefix(JOURNAL)).resolve())))
        # SQLite lets one writer in at a time and, by default, gives up after 5 s ("database is locked"):
        # workers on a loaded machine wait longer than that for each other, so they wait up to a minute.
        engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
        return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=30, grace_period=120)
    except Exception as e:  # a wrong URL, an unreachable server, a refused login
        raise _storage_error(recipe, "cannot open the study storage", e) from None


# A worker tags its trial with itself (user attr "worker") first thing after Optuna creates it, but
# the two are separate writes: a RUNNING trial without the tag is either just created by a live worker
# or cut short before it could tag. --resume waits this long for the tag before taking the latter.
WORKER_TAG_WAIT_S = 5.0


def _abandoned(t: optuna.trial.FrozenTrial, storage, study: optuna.Study, deadline: float) -> bool:
    """Whether a RUNNING trial's worker is gone: a process of this machine that no longer exists, or
    (another machine's) a heartbeat older than the storage's grace period, or no worker tagged it by
    `deadline` (time.monotonic())."""
    while trials.read(t).worker is None and time.monotonic() < deadline:
        time.sleep(0.1)
        t = storage.get_trial(t._trial_id)
    if t.state != optuna.trial.TrialState.RUNNING:
        return False  # it finished while we waited: nothing to fail
    host, _, pid = (trials.read(t).worker or "").rpartition(":")
    if not host:
        return True  # killed before it recorded its worker
    if host == socket.gethostname() and pid.isdigit():
        return not pid_alive(int(pid))
    if not hasattr(storage, "_get_stale_trial_ids"):  # a journal keeps no heartbeats: kept, as if alive
        return False
    return t._trial_id in set(storage._get_stale_trial_ids(study._study_id))


def trial_budget(recipe: MergeRecipe, study: optuna.Study) -> int | None:
    """Finished trials the study stops at: n_trials, or its warm_fraction for a warm-started study."""
    return warm_budget(recipe) if "warm_start" in study.user_attrs else recipe.budget.n_trials


def warm_budget(recipe: MergeRecipe) -> int | None:
    n = recipe.budget.n_trials
    return None if n is None else max(1, math.ceil(n * recipe.budget.warm_fraction))


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


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
                   for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))
    if n_trials is not None:
        n_trials = max(n_trials, done + requeued)
    remaining = None if n_trials is None else n_trials - done
    if remaining is not None and remaining <= 0:
        return
    callbacks = []
    if n_trials is not None:
        callbacks.append(optuna.study.MaxTrialsCallback(n_trials, states=(optuna.trial.TrialState.COMPLETE,)))
    board = LiveBoard("merge search", n_trials, done, lambda: best_table(study), enabled=live, log=log)

    def advance(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        # the study's count, so that workers sharing it agree
        board.advance(lambda: trial_line(trial, len(finished(study)), n_trials))

    callbacks.append(advance)
    with board:
        study.optimize(objective, n_trials=remaining, timeout=recipe.budget.timeout_s, callbacks=callbacks,
                       catch=(ValueError, RuntimeError))


def final_candidates(recipe: MergeRecipe, study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The full-val Pareto set (best min retention first, capped) plus each strategy's best."""
    done = finished(study)  # once: workers may still be finishing trials of a shared study
    recs = {t.number: trials.read(t) for t in done}
    full = {t.number: t for t in done if recs[t.number].stage == "full"}
    if not full:
        raise OpdError(f"study {recipe.name!r} has no trial scored on the full val split; raise the budget")
    key = {n: (recs[n].min_retention, sum(t.values)) for n, t in full.items()}
    front = sorted(pareto_front({n: t.values for n, t in full.items()}), key=lambda n: key[n], reverse=True)
    chosen = front[: recipe.final_candidates]
    per_strategy: dict[str, int] = {}
    for n in sorted(full, key=lambda n: key[n], reverse=True):
        per_strategy.setdefault(recs[n].candidate.strategy, n)
    chosen += [n for n in per_strategy.values() if n not in chosen]
    return [full[n] for n in chosen]


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


def run_number(trial) -> int:
    """The number naming a trial's run directory and seed: the trial it resumes, else its own."""
    resumed = trials.read(trial).resume_of
    return trial.number if resumed is None else resumed


def best_merge(study: optuna.Study) -> Candidate | None:
    """The best weight-space candidate scored on full val so far (None before there is one)."""
    merges = [(t, r) for t in finished(study) if (r := trials.read(t)).stage == "full"
              and get_strategy(r.candidate.strategy).weight_space]
    if not merges:
        return None
    return max(merges, key=lambda tr: (tr[1].min_retention, sum(tr[0].values)))[1].candidate


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


def _earlier_seconds(results: Path, study: str) -> float:
    """Seconds the earlier invocations of `study` took (0 when results.json is another study's)."""
    try:
        prev = json.loads(results.read_text())
    except (OSError, ValueError):
        return 0.0
    return float(prev.get("total_seconds", prev.get("seconds", 0.0))) if prev.get("study") == study else 0.0


def _stage_minutes(recipe: MergeRecipe, study, refs_s: float, search_s: float, final_s: float) -> dict[str, float]:
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


def _storage_error(recipe: MergeRecipe, what: str, e: Exception) -> OpdError:
    """One line for a storage that fails (a wrong URL, an unreachable server, a refused login), with
    any password in the message redacted."""
    first = (str(e).strip().splitlines() or [""])[0]
    return OpdError(f"storage {recipe.storage_label}: {what} ({type(e).__name__}: {redact_url(first)}); check "
                    "the 'storage' URL (a password goes in PGPASSWORD or ~/.pgpass, not in the URL)")


def _start_over(recipe: MergeRecipe, name: str, log) -> None:
    """--fresh: delete the study `name` from the recipe's storage and the OPD students trained for it."""
    try:
        optuna.delete_study(study_name=name, storage=study_storage(recipe))
        log(f"--fresh: deleted study {name!r} from {recipe.storage_label}")
    except KeyError:
        pass  # no such study yet
    except Exception as e:
        raise _storage_error(recipe, f"cannot delete study {name!r}", e) from None
    shutil.rmtree(recipe.out_dir / RUNS_DIR, ignore_errors=True)


def run_recipe(recipe: MergeRecipe, *, resume: bool = False, worker: bool = False, live: bool = True,
               fresh: bool = False, log=print) -> dict:
    """Run a merge recipe end to end; returns the summary also written to <out>/results.json.

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
    hashes = {e: m.content_hash for e, m in inputs.manifests.items()}
    name = history.study_name(recipe, inputs.base_hash, hashes)
    recipe.out_dir.mkdir(parents=True, exist_ok=True)
    prev = history.previous_results(recipe.out_dir, history.switch_study(recipe.out_dir, name, recipe.name))
    if fresh:
        _start_over(recipe, name, log)
        prev = None  # no warm start from an earlier study either
    warm = None
    if prev is not None and recipe.budget.n_trials is not None:
        params = history.warm_params(prev, recipe, list(inputs.expert_paths), warm_budget(recipe))
        warm = (prev.get("study", prev["recipe"]["name"]), params) if params else None
    study = open_study(recipe, len(objective_names(recipe, inputs.capabilities)), resume, worker,
                       name=name, warm=warm, log=log)
    if warm:
        log(f"inputs changed since study {warm[0]}: new study {name}, starting from its {len(warm[1])} best settings")
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

    t_final = time.time()
    finals = final_candidates(recipe, study)
    log(f"re-scoring {len(finals)} final candidates on test")
    cands, matrix = rescore_final(inputs, scorer, refs, finals, recipe)
    # The best model is chosen on val (the search's split, Pareto set ordered by min retention); test only reports.
    best_label, (best_trial, best_cand) = next(iter(cands.items()))
    summary = {
        "recipe": recipe.model_dump(mode="json"),
        "study": name,
        "inputs": {"base": {"path": str(inputs.base_path), "content_hash": inputs.base_hash,
                            "hub_id": hub_id(inputs.base_path)},
                   "experts": {e: {"path": str(p), "content_hash": inputs.manifests[e].content_hash,
                                   "version": inputs.manifests[e].version,
                                   "capability": inputs.manifests[e].capability,
                                   "tasks": inputs.manifests[e].tasks, "kind": inputs.manifests[e].kind,
                                   "hub_id": inputs.manifests[e].hub_id}
                               for e, p in inputs.expert_paths.items()}},
        "objectives": objective_names(recipe, inputs.capabilities),
        "counted": refs.counted,
        "owners": refs.owner,
        # lm-eval tasks whose val/test are a hash split of one split (the report says so)
        "split_rules": {c: s.split_rule for c, s in refs.base["test"].items() if s.split_rule},
        "trials": [{"number": t.number, "values": t.values, "params": t.params, **trials.read(t).fields()}
                   for t in finished(study)],
        "final": {label: {"trial": t.number, "candidate": c.model_dump(mode="json"), "label": c.label()}
                  for label, (t, c) in cands.items()},
        "best": best_label,
        "matrix": {s: to_records(cells) for s, cells in matrix.items()},
        "scorer_calls": scorer.calls,
        "stages": _stage_minutes(recipe, study, t_search - t0, t_final - t_search, time.time() - t_final),
    }
    if len(inputs.expert_sds) >= 2:  # the report's weight-space heatmaps: why a capability was lost
        summary["weightspace"] = weightspace_interference(inputs.base_sd, inputs.expert_sds)
    if prev is not None:
        summary["what_changed"] = history.what_changed(prev, summary)
    best_dir = save_best_model(recipe, inputs, best_cand, merge(inputs, best_cand, recipe, best_trial), summary)
    summary["best_model"] = str(best_dir)
    if inputs.spill_dir is not None:  # the last over-budget candidate (memory_budget): saved as best/ if it won
        shutil.rmtree(inputs.spill_dir, ignore_errors=True)
    write_report(recipe, summary, matrix)
    summary["seconds"] = time.time() - t0
    # A resumed or re-run study adds this invocation's time to the earlier ones' (the report of a
    # study that was killed halfway and resumed shows what the whole search cost).
    summary["total_seconds"] = summary["seconds"] + _earlier_seconds(recipe.out_dir / "results.json", name)
    atomic_write_json(recipe.out_dir / "results.json", summary)
    log(headline(summary))
    log(f"best: {best_label} -> {best_dir}; report: {Path(recipe.out_dir) / 'report.html'}")
    return summary
