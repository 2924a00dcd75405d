"""The search's Optuna study: its storage, creating or continuing it, the workers that share it, and
what it holds so far (finished trials, the best merge, the final candidates).

Optuna's public API only (tests/test_merge_study.py checks that opd/ reads no private attribute): a
trial is named by its `number`, a dead worker on another machine is found by Optuna's heartbeats
(`optuna.storages.fail_stale_trials`), one on this machine by its process id.
"""

from __future__ import annotations

import math
import shutil
import socket
import time
import warnings
from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from opd.errors import OpdError
from opd.io import pid_alive
from opd.merge import trials
from opd.merge.interference import pareto_front
from opd.merge.recipe import MergeRecipe
from opd.merge.strategies import RUNS_DIR, get_strategy
from opd.paths import redact_url
from opd.weights.merge import Candidate

# Fields that define the search space and its objectives: a study cannot continue under others.
SEARCH_FIELDS = ("base", "experts", "capabilities", "strategies", "objectives", "split", "verifier")
# SEARCH_FIELDS added later: a study recorded before one existed was made with its default (a study
# made with the verifier must not pick its best among students trained without one, or the reverse).
SEARCH_FIELD_DEFAULTS = {"verifier": "capability"}

JOURNAL = "journal:"

# A worker tags its trial with itself (user attr "worker") first thing after Optuna creates it, but
# the two are separate writes: a RUNNING trial without the tag is either just created by a live worker
# or cut short before it could tag. --resume waits this long for the tag before taking the latter.
WORKER_TAG_WAIT_S = 5.0


def study_storage(recipe: MergeRecipe):
    """The recipe's Optuna storage: an RDB (SQLite, PostgreSQL, ...), or `journal:<path>`, Optuna's
    JournalStorage on a file (optuna/storages/journal/_file.py: appends under a lock file, so workers on
    several machines can share it over a shared file system, where SQLite's locks are unreliable)."""
    url = recipe.storage_url
    try:
        if url.startswith(JOURNAL):
            return optuna.storages.JournalStorage(JournalFileBackend(str(Path(url.removeprefix(JOURNAL)).resolve())))
        # SQLite lets one writer in at a time and, by default, gives up after 5 s ("database is locked"):
        # workers on a loaded machine wait longer than that for each other, so they wait up to a minute.
        engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
        # Each running trial's worker records a heartbeat every 30 s (optuna/study/_optimize.py runs a
        # heartbeat thread per trial); one silent for 2 min is stale (optuna/storages/_heartbeat.py).
        return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=30, grace_period=120)
    except Exception as e:  # a wrong URL, an unreachable server, a refused login
        raise storage_error(recipe, "cannot open the study storage", e) from None


def storage_error(recipe: MergeRecipe, what: str, e: Exception) -> OpdError:
    """One line for a storage that fails (a wrong URL, an unreachable server, a refused login), with
    any password in the message redacted."""
    first = (str(e).strip().splitlines() or [""])[0]
    return OpdError(f"storage {recipe.storage_label}: {what} ({type(e).__name__}: {redact_url(first)}); check "
                    "the 'storage' URL (a password goes in PGPASSWORD or ~/.pgpass, not in the URL)")


def start_over(recipe: MergeRecipe, name: str, log) -> None:
    """--fresh: delete the study `name` from the recipe's storage and the OPD students trained for it."""
    try:
        optuna.delete_study(study_name=name, storage=study_storage(recipe))
        log(f"--fresh: deleted study {name!r} from {recipe.storage_label}")
    except KeyError:
        pass  # no such study yet
    except Exception as e:
        raise storage_error(recipe, f"cannot delete study {name!r}", e) from None
    shutil.rmtree(recipe.out_dir / RUNS_DIR, ignore_errors=True)


def make_sampler(recipe: MergeRecipe, offset: int = 0) -> optuna.samplers.BaseSampler:
    """`offset` (trials already in the study) shifts the seed, so a resumed or second worker's
    sampler does not replay the first run's draws."""
    seed = recipe.seed + offset
    if recipe.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=8)
    if recipe.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=6)


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
        fail_abandoned(study, log)
    if warm and not exists and not theirs:
        # Two workers creating the study at once may both get here: a duplicate costs one trial.
        study.set_user_attr("warm_start", {"from": warm[0], "trials": [n for n, _ in warm[1]]})
        for number, params in warm[1]:
            study.enqueue_trial(params, user_attrs=trials.queued(warm_start_of=number), skip_if_exists=True)
    study.set_user_attr("recipe", mine)
    return study


def fail_abandoned(study: optuna.Study, log) -> None:
    """--resume: fail the RUNNING trials whose worker is gone; another worker's live trial is left
    running (its result must be accepted).

    A killed single-worker run leaves its trial RUNNING forever; it is redone, not kept. An OPD trial
    is queued again with its own parameters, seed and init, so its run continues from its checkpoint
    instead of starting over. A worker is gone when it is a process of this machine that no longer
    exists, or (another machine's) its heartbeat is older than the storage's grace period, or it did
    not tag its trial within WORKER_TAG_WAIT_S.
    """
    running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    if not running:
        return
    # Optuna fails the trials whose heartbeat is stale (optuna/storages/_heartbeat.py). A journal keeps
    # none (optuna 5.1's JournalStorage is no BaseHeartbeat: optuna/storages/journal/_storage.py): there
    # this does nothing, and another machine's trial is kept as if alive.
    optuna.storages.fail_stale_trials(study)
    stale = [t for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if t.number in running]
    left = tagged(study, running - {t.number for t in stale}, time.monotonic() + WORKER_TAG_WAIT_S)
    gone = [study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            for t in left if t.state == TrialState.RUNNING and not worker_alive(t)]
    abandoned = stale + [t for t in gone if t.state == TrialState.FAIL]  # not those that finished meanwhile
    log(f"resume: {len(running) - len(abandoned)} running trials kept (their workers are alive), "
        f"{len(abandoned)} abandoned ones failed")
    for t in abandoned:
        rec = trials.read(t)
        if rec.candidate and get_strategy(rec.candidate.strategy).resumable:
            study.enqueue_trial(t.params, user_attrs=trials.queued(resume_of=run_number(t), opd_init=rec.opd_init))


def tagged(study: optuna.Study, numbers: set[int], deadline: float) -> list[FrozenTrial]:
    """The trials `numbers`, read again until each one still RUNNING is tagged with its worker or
    `deadline` (time.monotonic()) passes."""
    while True:
        now = [t for t in study.get_trials(deepcopy=False) if t.number in numbers]
        if time.monotonic() >= deadline or all(t.state != TrialState.RUNNING or trials.read(t).worker for t in now):
            return now
        time.sleep(0.1)


def worker_alive(t: FrozenTrial) -> bool:
    """Whether the worker that tagged a RUNNING trial may still run it: a process of this machine that
    exists, or any of another machine's (whose heartbeat `fail_abandoned` checked). Untagged: no."""
    host, _, pid = (trials.read(t).worker or "").rpartition(":")
    if not host:
        return False  # killed before it recorded its worker
    if host == socket.gethostname() and pid.isdigit():
        return pid_alive(int(pid))
    return True


def trial_budget(recipe: MergeRecipe, study: optuna.Study) -> int | None:
    """Finished trials the study stops at: n_trials, or its warm_fraction for a warm-started study."""
    return warm_budget(recipe) if "warm_start" in study.user_attrs else recipe.budget.n_trials


def warm_budget(recipe: MergeRecipe) -> int | None:
    n = recipe.budget.n_trials
    return None if n is None else max(1, math.ceil(n * recipe.budget.warm_fraction))


def finished(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


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


def final_candidates(recipe: MergeRecipe, study: optuna.Study) -> list[FrozenTrial]:
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
