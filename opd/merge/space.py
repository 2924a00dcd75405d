"""The search space: which strategies a trial may draw, and each one's parameters drawn from the
recipe's ranges and choices (opd.merge.recipe), into a `Candidate`."""

from __future__ import annotations

import math

import optuna
from optuna.trial import TrialState

from opd.merge import trials
from opd.merge.recipe import Choices, LayerRange, MergeRecipe
from opd.merge.strategies import get_strategy
from opd.merge.study import best_merge, finished, run_number
from opd.weights.layers import LayerValues
from opd.weights.merge import Candidate


def open_strategies(trial: optuna.Trial, recipe: MergeRecipe) -> list[str]:
    """The strategies whose `budget.per_strategy` trial cap is not used up (finished or running trials)."""
    caps = recipe.budget.per_strategy
    names = list(recipe.strategies)
    if not caps:
        return names
    used: dict[str, int] = {}
    for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)):
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
