"""The search's study (opd.merge.study) on Optuna's public API only: a dead worker on another machine
is found by Optuna's heartbeats, and nothing in opd/ reads an Optuna private attribute."""

from __future__ import annotations

import ast
import re
import sqlite3
from pathlib import Path

import optuna
import yaml

from opd.merge import load_recipe
from opd.merge.trials import read, update
from opd.weights.merge import Candidate

ROOT = Path(__file__).resolve().parents[1]
# What an Optuna object is called in opd's code: a study, trial, storage or sampler (also `t`), or optuna.
OPTUNA_NAMES = re.compile(r"(?i)(trial|study|storage|sampler|optuna)|^t$")


def private_optuna_uses(source: str) -> list[str]:
    """`<optuna object>._name` attributes and `optuna..._module` imports in a module's source. In a
    module that imports optuna, any `x._name` but self's and cls's counts."""
    tree = ast.parse(source)
    found, imports_optuna = [], False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for m in (m for m in mods if m.split(".")[0] == "optuna"):
                imports_optuna = True
                if any(part.startswith("_") for part in m.split(".")):
                    found.append(f"{node.lineno}: import {m}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if (imports_optuna and owner not in ("self", "cls")) or OPTUNA_NAMES.search(owner.split(".")[-1]):
                found.append(f"{node.lineno}: {owner}.{node.attr}")
    return found


def test_the_check_finds_the_private_calls_the_search_used_to_make():
    old = ("import optuna\n"
           "def f(study, storage, t):\n"
           "    storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)\n"
           "    return t._trial_id in set(storage._get_stale_trial_ids(study._study_id))\n")
    assert sorted(private_optuna_uses(old)) == [
        "3: t._trial_id", "4: storage._get_stale_trial_ids", "4: study._study_id", "4: t._trial_id"]
    assert private_optuna_uses("from optuna.storages._heartbeat import is_heartbeat_enabled\n") == [
        "1: import optuna.storages._heartbeat"]
    # a module without optuna: its own objects' private attributes are not Optuna's
    assert private_optuna_uses("def f(x):\n    return x._cache, self_study._x\n") == ["2: self_study._x"]


def test_opd_uses_no_optuna_private_attribute():
    """optuna is not pinned to a minor version (pyproject.toml): opd may use its public API only."""
    bad = [f"{p.relative_to(ROOT)}:{use}" for p in sorted((ROOT / "opd").rglob("*.py"))
           for use in private_optuna_uses(p.read_text())]
    assert not bad, "Optuna private API in opd/ (use the public one):\n  " + "\n  ".join(bad)


def test_resume_fails_another_machines_trial_by_its_stale_heartbeat(tmp_path):
    """--resume: a RUNNING trial of another machine's worker whose heartbeat is older than the storage's
    grace period is failed (an OPD one queued again to continue its run); one with a fresh heartbeat
    is kept running, its result still accepted."""
    from opd.merge.study import open_study, study_storage

    doc = {"name": "r", "experts": ["a", "b"], "strategies": {"linear": {}}, "out": str(tmp_path / "out")}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(doc))
    recipe = load_recipe(tmp_path / "r.yaml")
    study = open_study(recipe, 1, resume=False, worker=False)
    stale_t, fresh_t = study.ask(), study.ask()
    update(stale_t, worker="elsewhere:1", candidate=Candidate(strategy="opd", shared={}, per_model={}, seed=0))
    update(fresh_t, worker="elsewhere:2")
    storage = study_storage(recipe)  # what a worker's heartbeat thread does each heartbeat_interval
    study_id = storage.get_study_id_from_name(study.study_name)
    ids = {t.number: storage.get_trial_id_from_study_id_trial_number(study_id, t.number) for t in (stale_t, fresh_t)}
    for trial_id in ids.values():
        storage.record_heartbeat(trial_id)
    db = recipe.storage_url.removeprefix("sqlite:///")
    with sqlite3.connect(db) as con:  # the stale worker's last heartbeat: 10 minutes ago (grace period 2)
        con.execute("UPDATE trial_heartbeats SET heartbeat = datetime('now', '-10 minutes') || '.000000' "
                    "WHERE trial_id = ?", (ids[stale_t.number],))
    lines = []
    study = open_study(recipe, 1, resume=True, worker=False, log=lines.append)
    R, F, W = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.WAITING
    states = {t.number: t.state for t in study.trials}
    assert states[stale_t.number] == F and states[fresh_t.number] == R
    assert lines == ["resume: 1 running trials kept (their workers are alive), 1 abandoned ones failed"]
    (queued,) = [t for t in study.trials if t.state == W]
    assert read(queued).resume_of == stale_t.number  # its run continues in the stale trial's directory
    study.tell(fresh_t.number, [0.5])
    assert study.trials[fresh_t.number].state == optuna.trial.TrialState.COMPLETE
