"""Two search workers (`python -m opd.merge --worker storage=...`) share one Optuna RDB study on pico
experts: PostgreSQL started by the test where installed, SQLite always."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
import pytest
import torch
from conftest import skip_missing
from test_merge_fakes import build_fake_lab, write_recipe

from opd.merge import load_recipe, run_recipe
from opd.merge.trials import read, update

REPO = Path(__file__).resolve().parents[1]
N_TRIALS = 8


@pytest.fixture
def postgres():
    """A throwaway PostgreSQL cluster in a temp dir (unix socket only, no fsync); yields its URL."""
    pg_ctl = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if not pg_ctl:
        skip_missing("PostgreSQL is not installed (apt-get install postgresql); the SQLite case still runs")
    try:
        import psycopg  # noqa: F401  SQLAlchemy's postgresql+psycopg driver
    except ImportError:
        skip_missing("no PostgreSQL driver (pip install 'psycopg[binary]'); the SQLite case still runs")
    bindir = Path(pg_ctl[-1]).parent
    d = Path(tempfile.mkdtemp(prefix="opd-pg-"))  # 0700: trust auth, so only its owner may reach the socket
    user = None
    if os.geteuid() == 0:  # postgres refuses to run as root: use the account Debian's package made
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            skip_missing("running as root and there is no 'postgres' account to run PostgreSQL as")
        os.chown(d, pw.pw_uid, pw.pw_gid)
        user = "postgres"

    def pg(*cmd):
        subprocess.run([str(c) for c in cmd], user=user, check=True, capture_output=True, timeout=120)

    data = d / "data"
    pg(bindir / "initdb", "-D", data, "-A", "trust", "-U", "opd", "--no-sync")
    pg(bindir / "pg_ctl", "-D", data, "-l", d / "log", "-w", "-o", f"-k {d} -c listen_addresses='' -c fsync=off",
       "start")
    try:
        yield f"postgresql+psycopg://opd@/postgres?host={d}"
    finally:
        pg(bindir / "pg_ctl", "-D", data, "-m", "immediate", "stop")
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["postgresql", "sqlite"])
def storage(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    return request.getfixturevalue("postgres")


def test_two_workers_share_one_study(tmp_path, storage, monkeypatch):
    lab = build_fake_lab(tmp_path / "lab")
    path = write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", budget={"n_trials": N_TRIALS})
    # Optuna creates its tables on first connect; two processes doing it at once can collide in
    # PostgreSQL's catalog (optuna/optuna#2164), so the schema is made before the workers start.
    optuna.storages.RDBStorage(storage)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "OPD_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "opd.merge", "--recipe", str(path), "--worker", "--no-live", f"storage={storage}"]
    workers = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for _ in range(2)]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], logs

    (name,) = optuna.get_all_study_names(storage)
    study = optuna.load_study(study_name=name, storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    by = {read(t).worker for t in done}
    assert len(by) == 2 and {int(w.split(":")[1]) for w in by} == {w.pid for w in workers}
    # MaxTrialsCallback stops a worker once N trials are complete, but a trial the other worker is
    # running then still finishes: Optuna's documented overshoot is at most workers - 1.
    assert N_TRIALS <= len(done) <= N_TRIALS + 1
    assert sorted(t.number for t in study.trials) == list(range(len(study.trials)))

    # the coordinator's --resume writes the report over every worker's trials, running none itself
    monkeypatch.setenv("OPD_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    summary = run_recipe(load_recipe(path, [f"storage={storage}"]), resume=True, live=False, log=lambda *a: None)
    assert len(summary["trials"]) == len(done) and summary["study"] == name
    assert (tmp_path / "out" / "report.md").exists()


def test_resume_fails_only_abandoned_trials(tmp_path):
    """--resume from a third process: a RUNNING trial whose worker is alive keeps running (its result
    will be accepted); one whose worker is gone is failed and redone."""
    import socket

    from opd.merge.search import open_study

    doc = {"name": "r", "experts": ["a", "b"], "strategies": {"linear": {}}, "out": str(tmp_path / "out")}
    (tmp_path / "r.yaml").write_text(__import__("yaml").safe_dump(doc))
    recipe = load_recipe(tmp_path / "r.yaml")
    study = open_study(recipe, 1, resume=False, worker=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    live_t, dead_t = study.ask(), study.ask()
    update(live_t, worker=f"{host}:{os.getpid()}")
    dead_t.set_user_attr("worker", f"{host}:{int(dead.stdout)}")  # a study from before the trial record
    study = open_study(recipe, 1, resume=True, worker=False)
    states = {t.number: t.state for t in study.trials}
    assert states == {live_t.number: optuna.trial.TrialState.RUNNING, dead_t.number: optuna.trial.TrialState.FAIL}
    study.tell(live_t.number, [0.5])  # the live worker's result is still accepted
    assert study.trials[live_t.number].state == optuna.trial.TrialState.COMPLETE
