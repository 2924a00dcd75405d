"""Two search workers (`python -m opd.merge --worker storage=...`) share one Optuna RDB study on pico
experts: PostgreSQL started by the test where installed, SQLite always."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest
from conftest import skip_missing
from test_merge_fakes import build_fake_lab, write_recipe

from opd.merge import load_recipe
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


def _running(storage: optuna.storages.RDBStorage) -> list[optuna.trial.FrozenTrial]:
    names = optuna.get_all_study_names(storage)
    if not names:
        return []
    return optuna.load_study(study_name=names[0], storage=storage).get_trials(
        states=(optuna.trial.TrialState.RUNNING,))


def _workers_of(trials) -> set[int]:
    return {int(read(t).worker.rpartition(":")[2]) for t in trials if read(t).worker}


def _stopped(procs: list[subprocess.Popen], timeout_s: float = 10) -> bool:
    """Whether every process is in the stopped state ('T' in /proc/<pid>/stat) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [Path(f"/proc/{p.pid}/stat").read_text().rpartition(")")[2].split()[0] for p in procs]
        if all(s == "T" for s in states):
            return True
        time.sleep(0.01)
    return False


def _storage_idle(storage: str) -> bool:
    """No session holds the storage mid-transaction (a worker stopped inside one would block the
    --resume's writes): SQLite grants an exclusive lock, PostgreSQL shows every other session idle."""
    if storage.startswith("sqlite"):
        import sqlite3

        c = sqlite3.connect(storage.removeprefix("sqlite:///"), timeout=0.1, isolation_level=None)
        try:
            c.execute("begin exclusive")
            c.execute("rollback")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            c.close()
    import sqlalchemy

    engine = sqlalchemy.create_engine(storage)
    try:
        with engine.connect() as c:
            return not c.execute(sqlalchemy.text(
                "select count(*) from pg_stat_activity where pid <> pg_backend_pid() and backend_type = "
                "'client backend' and state <> 'idle'")).scalar()
    finally:
        engine.dispose()


def _stop_mid_trial(workers: list[subprocess.Popen], storage: str, timeout_s: float = 300) -> list:
    """SIGSTOP the workers at a moment each is inside a trial it has tagged, with no transaction open;
    returns the RUNNING trials."""
    # one connection pool for all the polling; SQLite readers wait out a worker's commit as opd's own do
    rdb = optuna.storages.RDBStorage(
        storage, engine_kwargs={"connect_args": {"timeout": 60}} if storage.startswith("sqlite") else None)
    deadline = time.monotonic() + timeout_s
    pids = {w.pid for w in workers}
    while time.monotonic() < deadline:
        assert all(w.poll() is None for w in workers), "a worker ended before the --resume started"
        if _workers_of(_running(rdb)) >= pids:
            for w in workers:
                w.send_signal(signal.SIGSTOP)
            # a worker stopped inside a commit holds SQLite's exclusive lock, and reading now would wait
            # for it for ever: look at the trials only once every worker has stopped (a signal is not
            # delivered at once) and no transaction is open
            if _stopped(workers) and _storage_idle(storage):
                running = _running(rdb)
                if all(read(t).worker for t in running) and _workers_of(running) >= pids:
                    rdb.engine.dispose()
                    return running
            for w in workers:
                w.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError(f"the workers were not both inside a trial within {timeout_s} s")


def test_two_workers_and_a_resume_share_one_study(tmp_path, storage):
    """Two workers run; while both are inside a trial, `--resume` starts from a third process (the
    workers are paused until it has opened the study, so it certainly sees their trials running).
    The resume keeps their trials, runs trials of its own and writes the report; every trial ends
    once, with one result, and every OPD trial directory is trained by one process."""
    lab = build_fake_lab(tmp_path / "lab")
    path = write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", budget={
        "n_trials": N_TRIALS, "per_strategy": {"ties": 3, "linear": 3}},  # the rest are OPD trials
        strategies={"ties": {"density": [0.3, 1.0], "weight": [0.5, 1.0]}, "linear": {"weight": [0.2, 1.0]},
                    "opd": {"lr": [5e-4, 2e-3]}},
        distill={"steps": 2, "prompts_per_step": 4, "group_size": 2, "checkpoint_every": 1})
    # Optuna creates its tables on first connect; two processes doing it at once can collide in
    # PostgreSQL's catalog (optuna/optuna#2164), so the schema is made before the workers start.
    optuna.storages.RDBStorage(storage)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "OPD_CACHE": str(tmp_path / "cache"),
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "opd.merge", "--recipe", str(path), "--no-live", f"storage={storage}"]
    logs = [tmp_path / f"{n}.log" for n in ("worker0", "worker1", "resume")]

    def start(argv, log):
        with open(log, "w") as f:
            return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)

    workers = [start([*cmd, "--worker"], log) for log in logs[:2]]
    try:
        live = _stop_mid_trial(workers, storage)
        resume = start(cmd, logs[2])  # the plain command resumes the study
        try:
            deadline = time.monotonic() + 300
            while "resume: " not in logs[2].read_text() and resume.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            for w in workers:
                w.send_signal(signal.SIGCONT)
        codes = [p.wait(timeout=600) for p in (*workers, resume)]
    finally:
        for p in workers + ([resume] if "resume" in locals() else []):
            p.kill()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0, 0], texts
    assert f"resume: {len(live)} running trials kept (their workers are alive), 0 abandoned ones failed" in texts[2]

    (name,) = optuna.get_all_study_names(storage)
    study = optuna.load_study(study_name=name, storage=storage)
    states = {t.number: t.state for t in study.trials}
    assert sorted(states) == list(range(len(states)))
    # every trial ended once, with one result: none failed (neither a live one by the resume nor one
    # that found its OPD directory held by another process), none left running
    assert set(states.values()) == {optuna.trial.TrialState.COMPLETE}, states
    assert all(study.trials[t.number].state == optuna.trial.TrialState.COMPLETE for t in live)
    done = study.trials
    assert all(len(t.values) == len(study.directions) for t in done)
    # each worker finished the trial it was paused in; the resume may have run some too
    assert {w.pid for w in workers} <= _workers_of(done) <= {w.pid for w in workers} | {resume.pid}
    # MaxTrialsCallback stops a process once N trials are complete, but trials the others are running
    # then still finish: Optuna's documented overshoot is at most processes - 1.
    assert N_TRIALS <= len(done) <= N_TRIALS + 2

    # each OPD trial trained its steps once, in its own directory, and left no checkpoint behind
    opd = {t.number: t for t in done if read(t).candidate.strategy == "opd"}
    assert opd and all([h["step"] for h in read(t).opd_history] == [1, 2] for t in opd.values())
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "opd").glob("trial-*")) == sorted(f"trial-{n}" for n in opd)
    assert not list(out.glob("opd/*/state.pt"))

    # the --resume wrote the report over the trials finished when its own search stopped
    summary = json.loads((out / "results.json").read_text())
    assert summary["study"] == name and (out / "report.md").exists()
    assert len(summary["trials"]) >= N_TRIALS


def test_resume_fails_only_abandoned_trials(tmp_path, monkeypatch):
    """--resume from a third process: a RUNNING trial whose worker is alive keeps running (its result
    will be accepted); one whose worker is gone is failed and redone. A trial not yet tagged with its
    worker (Optuna created it a moment ago) is waited for: kept once a live worker tags it, failed
    if nothing tags it within WORKER_TAG_WAIT_S."""
    import socket
    import threading

    from opd.merge import study as study_mod
    from opd.merge.study import open_study

    monkeypatch.setattr(study_mod, "WORKER_TAG_WAIT_S", 2.0)
    doc = {"name": "r", "experts": ["a", "b"], "strategies": {"linear": {}}, "out": str(tmp_path / "out")}
    (tmp_path / "r.yaml").write_text(__import__("yaml").safe_dump(doc))
    recipe = load_recipe(tmp_path / "r.yaml")
    study = open_study(recipe, 1, resume=False, worker=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    live_t, dead_t, late_t, never_t = study.ask(), study.ask(), study.ask(), study.ask()
    update(live_t, worker=f"{host}:{os.getpid()}")
    dead_t.set_user_attr("worker", f"{host}:{int(dead.stdout)}")  # a study from before the trial record
    # a live worker that tags its new trial while the resume looks
    tagger = threading.Timer(0.5, update, (late_t,), {"worker": f"{host}:{os.getpid()}"})
    tagger.start()
    lines = []
    t0 = time.monotonic()
    study = open_study(recipe, 1, resume=True, worker=False, log=lines.append)
    tagger.join()
    assert 1.5 < time.monotonic() - t0 < 10  # it waited for the untagged trials, not for ever
    R, F = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL
    states = {t.number: t.state for t in study.trials}
    assert states == {live_t.number: R, dead_t.number: F, late_t.number: R, never_t.number: F}
    assert lines == ["resume: 2 running trials kept (their workers are alive), 2 abandoned ones failed"]
    study.tell(live_t.number, [0.5])  # the live worker's result is still accepted
    assert study.trials[live_t.number].state == optuna.trial.TrialState.COMPLETE
