"""SIGKILL GSPO training, the merge search and OPD at random (seeded) moments; every rerun must resume.

    python bench/fault_injection.py [--kills 20] [--jobs train,search,opd] [--live-resumes 2] [--seed 0] [--base DIR]

The three jobs, each on pico models built here in seconds (a pico Qwen3 pre-trained on `count`, and
two "experts" that are small random task vectors on it):
  train   scripts/train_expert.py SPEC --out DIR          (GSPO, checkpoint every step)
  search  python -m opd.merge --recipe R.yaml             (Optuna over ties, task_arithmetic, opd and
                                                           ties+opd; the same command continues a study)
  opd     python -m opd.distill RUN.yaml                  (checkpoint every step, val checks)

For each job one uninterrupted run is the reference. Then episodes: start the command in a fresh
directory, SIGKILL it after a random delay, check what is on disk, rerun the same command, until it
finishes; new episodes start until the job's share of `--kills` happened. Checked:
  - after every kill, every artifact that exists loads (JSON, safetensors, torch checkpoints, the
    Optuna SQLite study, PNGs, model directories), and the job never went back: the checkpoint
    step never decreases, finished Optuna trials stay as they were;
  - every rerun resumes: it logs that it continues from the checkpoint the kill left (train, opd),
    or keeps every finished trial, same start time and values, instead of running it again (search);
  - after every episode, no temporary or backup file of an atomic write is left, and the result
    matches the reference. Training and OPD: the same steps and bit-identical weights (checkpoints
    carry every RNG state, and scoring leaves them alone). The search: as many finished trials, any
    candidate both runs tried scored identically, and the best's val and test scores within noise
    (not identical: a resumed study's sampler is reseeded and a trial the kill cut short is redone
    under a new number, so the candidates differ after the first kill; see `Search.compare`).
Once a kill leaves the finished output, the rerun is let finish. Every other episode also truncates
the checkpoints each kill left (GSPO's `state.pt`, half the time its previous one too; OPD's; each
OPD trial's), as a crash on a filesystem that does not order writes may: the rerun must warn, fall
back to the previous checkpoint or start fresh, and still match the reference.

Then `--live-resumes` searches of two `--worker` processes on one study: one worker is SIGKILLed
inside a trial and the plain command (a resume) starts from a third process while the other still runs. The resume must
fail exactly the killed worker's trials (requeueing an OPD one), never the live worker's; every other
trial completes once, each OPD student is trained once in one directory (see `live_resume_episode`).

Prints one row per job and exits 1 on any problem. tests/test_fault_injection.py runs a short version
of each job in CI; tests/test_merge_workers.py a --resume beside two live workers.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
JOBS = ("train", "search", "opd")


# --- the pico lab ---------------------------------------------------------------------------------

def build_pico_base(out: Path) -> Path:
    """A hidden-32, 2-layer Qwen3 trained on `count` for 120 steps: a base that scores above 0."""
    import torch

    from opd.lab.pico import build_trained_pico

    torch.set_num_threads(1)
    return build_trained_pico(out)


def build_lab(root: Path, base: Path, capabilities=("count", "rev"), scale: float = 0.05) -> dict:
    """root/base and root/experts/<cap>/: the base plus a seeded random task vector each, with manifests.
    The experts score near the base, so merges and students differ by a few items, as real ones do."""
    from opd.lab.pico import build_fake_lab

    return build_fake_lab(root, capabilities, scale=scale, base=base)


def write_spec(path: Path, base: Path, steps: int) -> Path:
    body = {"capability": "count", "base": str(base), "steps": steps, "eval_every": 2, "eval_limit": 20,
            "checkpoint_every": 1, "threads": 1, "score_capabilities": ["count"],
            "gspo": {"prompts_per_step": 4, "group_size": 4, "updates_per_batch": 2, "lr": 1e-3,
                     "eps_low": 0.2, "eps_high": 0.28, "min_informative": 0.0}}
    path.write_text(yaml.safe_dump(body))
    return path


def write_recipe(path: Path, lab: dict, out: Path, n_trials: int, opd_steps: int) -> Path:
    """A search of `n_trials` cheap trials: two merge methods, and one OPD and one ties+opd trial."""
    body = {"name": "faults", "base": str(lab["base"]), "experts": [str(p) for p in lab["experts"].values()],
            "strategies": {"ties": {"density": [0.3, 1.0], "weight": [0.5, 1.0]},
                           "task_arithmetic": {"weight": [0.2, 1.0]},
                           "opd": {"lr": [5e-4, 2e-3]}, "ties+opd": {"density": 0.5, "weight": 1.0}},
            "distill": {"steps": opd_steps, "prompts_per_step": 4, "group_size": 2, "checkpoint_every": 1},
            "budget": {"n_trials": n_trials, "per_strategy": {"opd": 1, "ties+opd": 1}},
            "sampler": "random", "out": str(out), "screening": {"limit": 50, "margin": 0.02, "warmup": 2},
            "final_candidates": 2, "eval_batch_size": 64}
    path.write_text(yaml.safe_dump(body))
    return path


def write_run(path: Path, lab: dict, out: Path, steps: int) -> Path:
    body = {"name": out.name, "base": str(lab["base"]), "teachers": [str(p) for p in lab["experts"].values()],
            "out": str(out), "distill": {"steps": steps, "prompts_per_step": 4, "group_size": 2, "lr": 1e-3,
                                         "checkpoint_every": 1, "eval_every": 4, "eval_limit": 40}}
    path.write_text(yaml.safe_dump(body))
    return path


# --- what is on disk ------------------------------------------------------------------------------

def is_temp(name: str) -> bool:
    """A temporary or backup entry of opd.io's atomic writes (`.<name>.tmp-*`, `.<name>.old-<pid>`)."""
    return name.startswith(".") and (".tmp-" in name or ".old-" in name)


def leftovers(root: Path) -> list[str]:
    """Temporary or backup files and directories of atomic writes under `root` (a kill mid-write)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if is_temp(p.name)) if root.exists() else []


@contextlib.contextmanager
def study_copy(path: Path) -> Iterator[Path]:
    """A copy of an SQLite file with its journal. A kill mid-transaction leaves a hot journal, and one
    while Optuna creates its tables a half-made schema; whoever opens the file next rolls the journal
    back and Optuna finishes its schema. Opening the copy does what the rerun's open will do, without
    changing the file the rerun is checked on."""
    with tempfile.TemporaryDirectory() as d:
        for f in path.parent.glob(f"{path.name}*"):  # study.db, study.db-journal (-wal, -shm)
            shutil.copy2(f, Path(d) / f.name)
        yield Path(d) / path.name


def load_study_db(path: Path) -> int:
    """Open the Optuna SQLite file as the rerun will and read every study and trial; returns the trial count."""
    import optuna

    with study_copy(path) as db:
        with sqlite3.connect(db) as c:
            ok = c.execute("pragma integrity_check").fetchone()[0]
        if ok != "ok":
            raise ValueError(f"sqlite integrity_check: {ok}")
        storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
        n = sum(len(optuna.load_study(study_name=s.study_name, storage=storage).trials)
                for s in optuna.get_all_study_summaries(storage))
        storage.engine.dispose()
        return n


def load_artifact(path: Path) -> None:
    """Read `path` the way its consumer does; raises if it is not whole."""
    if path.suffix == ".json":
        json.loads(path.read_text())
    elif path.suffix == ".safetensors":
        from safetensors.torch import load_file

        load_file(path)
    elif path.suffix == ".pt":
        import torch

        torch.load(path, weights_only=False)
    elif path.suffix == ".db":
        load_study_db(path)
    elif path.suffix == ".png":
        from PIL import Image

        with Image.open(path) as im:
            im.load()
    elif path.suffix in (".yaml", ".yml"):
        yaml.safe_load(path.read_text())
    elif path.suffix in (".md", ".html", ".jinja", ".txt"):
        path.read_text(encoding="utf-8")
    else:
        path.read_bytes()


def check_tree(root: Path, skip: set[Path] = frozenset()) -> list[str]:
    """Every artifact under `root` that exists, loaded (model directories as models): what does not load.
    Entries of unfinished atomic writes are not artifacts (see `leftovers`), nor the checkpoints in `skip`
    (torn on purpose, not yet rewritten), nor the torn ones a resume set aside."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    problems = []
    if not root.exists():
        return problems
    for p in sorted(root.rglob("*")):
        if any(is_temp(part) for part in p.relative_to(root).parts) or p.suffix == ".log" or p in skip:
            continue
        if p.stem.endswith(".torn"):  # a torn checkpoint the resume set aside (opd.io.torn_path): kept to inspect
            continue
        try:
            if p.is_file():
                load_artifact(p)
            elif (p / "config.json").exists():
                AutoModelForCausalLM.from_pretrained(p)
                AutoTokenizer.from_pretrained(p)
        except Exception as e:
            problems.append(f"{p.relative_to(root)} does not load: {type(e).__name__}: {str(e)[:200]}")
    return problems


def checkpoint_step(path: Path) -> int | None:
    """The step a rerun resumes from: the checkpoint's, else (torn) its previous version's (GSPO keeps
    one), else None (a fresh start)."""
    import torch

    for p in (path, path.with_name(f"{path.stem}.prev{path.suffix}")):
        if p.exists():
            try:
                return torch.load(p, weights_only=False)["state"]["step"]
            except Exception:  # torn: the run falls back the same way
                continue
    return None


def _signature(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def tear_checkpoints(job: Job, rng: random.Random) -> list[str]:
    """Truncate each checkpoint the kill left (`state.pt`, and half the time GSPO's previous one too) to a
    random length, as a crash on a filesystem that does not order writes may leave it. The rerun must
    warn, fall back to the previous checkpoint or start fresh, and still reach the reference's result."""
    torn = []
    for p in job.checkpoints():
        prev = p.with_name(f"{p.stem}.prev{p.suffix}")
        for q in [p] + ([prev] if prev.exists() and rng.random() < 0.5 else []):
            data = q.read_bytes()
            q.write_bytes(data[: rng.randrange(len(data))] if data else b"")
            job.torn[q] = _signature(q)
            torn.append(str(q.relative_to(job.work)))
    return torn


def within_noise(a: float, b: float, p: float, n: int) -> bool:
    """Two means over n pass/fail items differ by noise: under 2 standard errors of their difference."""
    se = (p * (1 - p) / n) ** 0.5
    return abs(a - b) <= max(2 * se, 1e-9) * 2**0.5


# --- the jobs -------------------------------------------------------------------------------------

@dataclass
class Job:
    """One job's directory (its config, output, checkpoints and run logs) and the command that (re)runs it.
    Subclasses say what progress a rerun must resume from and what matches the uninterrupted reference."""

    config: Path
    out: Path
    env: dict = field(default_factory=lambda: {**os.environ, "OMP_NUM_THREADS": "1"})
    runs: int = 0
    torn: dict = field(default_factory=dict)  # checkpoint torn on purpose -> its (size, mtime) then

    def still_torn(self) -> set[Path]:
        return {p for p, sig in self.torn.items() if p.exists() and _signature(p) == sig}

    def checkpoints(self) -> list[Path]:
        """The resumable checkpoints on disk now (what `tear_checkpoints` truncates)."""
        return []

    @property
    def work(self) -> Path:
        return self.out.parent

    def command(self) -> list[str]:
        raise NotImplementedError

    def run(self, kill_after: float | None = None, armed: Callable[[], bool] | None = None
            ) -> tuple[bool, float, str]:
        """(killed, seconds, log): SIGKILL `kill_after` s after the start, or after `armed()` first
        holds, unless it ends first. The log (stdout and stderr) is kept as run-<n>.log beside it."""
        self.runs += 1
        log_path = self.work / f"run-{self.runs}.log"
        env = {**self.env, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
        t0 = time.time()
        with open(log_path, "w") as f:
            proc = subprocess.Popen(self.command(), cwd=self.work, env=env, stdout=f, stderr=subprocess.STDOUT)
        armed_at = t0 if armed is None else None
        killed = False
        while proc.poll() is None:
            if kill_after is not None and armed_at is None and armed():
                armed_at = time.time()
            if armed_at is not None and kill_after is not None and time.time() - armed_at >= kill_after:
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.05)
        proc.wait()
        text = log_path.read_text(errors="replace")
        if not killed and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(self.command())} exited {proc.returncode}:\n{text[-3000:]}")
        return killed, time.time() - t0, text

    def run_here(self) -> tuple[bool, float, str]:
        """Like `run` without a kill, in this process: the command's code without the start-up of a new
        interpreter (a cheaper reference or last rerun, for CI)."""
        self.runs += 1
        lines: list[str] = []
        saved = os.environ.get("OPD_CACHE")
        os.environ["OPD_CACHE"] = self.env["OPD_CACHE"]
        t0 = time.time()
        try:
            self.call(lines.append)
        finally:
            os.environ.pop("OPD_CACHE") if saved is None else os.environ.__setitem__("OPD_CACHE", saved)
        text = "\n".join(map(str, lines))
        (self.work / f"run-{self.runs}.log").write_text(text)
        return False, time.time() - t0, text

    def call(self, log: Callable[[str], None]) -> None:
        raise NotImplementedError

    def progress(self):
        """What a rerun started now must continue from."""
        raise NotImplementedError

    def done(self, progress) -> bool:
        """Whether `progress` is the finished job (its last output written)."""
        raise NotImplementedError

    def check_rerun(self, before, log: str, finished: bool) -> tuple[str | None, list[str]]:
        """Did the run that started at progress `before` (and wrote `log`) continue from it?
        Returns (what it resumed from, for the table; None where the log shows nothing yet) and problems."""
        raise NotImplementedError

    def regressed(self, before, after) -> list[str]:
        """Progress lost between two kills (it must only grow)."""
        return []

    def summary(self) -> dict:
        raise NotImplementedError

    def compare(self, ep: dict, ref: dict) -> list[str]:
        """How the episode's result differs from the uninterrupted run's, beyond what is expected."""
        raise NotImplementedError


def _resume_from_ckpt(before: tuple[int | None, bool], log: str, finished: bool, resumed: re.Pattern,
                      fresh: re.Pattern, done: re.Pattern | None = None) -> tuple[str | None, list[str]]:
    """The start-up line of a checkpointed run (resumed at step k / fresh start / already done) must
    match the checkpoint step `before[0]` and finished output `before[1]` it found."""
    step, written = before
    if done is not None and done.search(log):
        return "done", [] if written else ["rerun said it was done, but no finished output was there"]
    m = resumed.search(log)
    if m:
        k = int(m.group(1))
        return f"step {k}", [] if k == step else [f"resumed at step {k}, the checkpoint held step {step}"]
    if fresh.search(log):
        if step is not None:
            return "step 0", [f"started over although the checkpoint held step {step}"]
        if written:
            return "step 0", ["trained again although the finished output was there"]
        return "step 0", []  # killed before its first checkpoint: nothing to resume
    return None, [f"finished without saying where it started:\n{log[-1500:]}"] if finished else []


@dataclass
class CheckpointedJob(Job):
    """A training run checkpointed beside its output (`.<out>.ckpt/state.pt`); its progress is
    (checkpoint step or None, whether the finished output is there)."""

    @property
    def ckpt(self) -> Path:
        return self.work / f".{self.out.name}.ckpt" / "state.pt"

    def progress(self) -> tuple[int | None, bool]:
        return checkpoint_step(self.ckpt), (self.out / "manifest.json").exists()

    def checkpoints(self) -> list[Path]:
        return [self.ckpt] if self.ckpt.exists() else []

    def done(self, progress) -> bool:
        return progress[1]

    def regressed(self, before, after):
        lost = before[0] is not None and after[0] is not None and after[0] < before[0]
        return [f"checkpoint went back from step {before[0]} to {after[0]}"] if lost else []


@dataclass
class Trainer(CheckpointedJob):
    """GSPO expert training: `scripts/train_expert.py SPEC --out OUT`."""

    kind = "train"

    def command(self) -> list[str]:
        return [sys.executable, str(ROOT / "scripts/train_expert.py"), str(self.config), "--out", str(self.out)]

    def call(self, log) -> None:
        import io

        from opd.expert.run import run_expert
        from opd.expert.spec import load_expert_spec

        err = io.StringIO()
        with contextlib.redirect_stderr(err):  # where run_expert's console writes
            run_expert(load_expert_spec(self.config), out=self.out)
        log(err.getvalue())

    def check_rerun(self, before, log, finished):
        return _resume_from_ckpt(before, log, finished, re.compile(r"resuming \S+ at step (\d+)"),
                                 re.compile(r"step 0: val"), re.compile(r"already holds this spec's expert"))

    def summary(self) -> dict:
        m = json.loads((self.out / "manifest.json").read_text())
        test = m["metrics"]["test"]["count"]
        return {"steps": m["train"]["steps"], "version": m["version"], "test": test["score"], "n": test["n"],
                "hash": m["content_hash"]}

    def compare(self, ep, ref):
        # Bit-identical, not just close: the checkpoint carries the model, the optimizer, the Python and
        # torch RNG states and the best model so far; rollouts are seeded per step and scoring leaves
        # the training RNG alone (cached or not), so a resumed run replays the uninterrupted one.
        problems = [f"{k} {ep[k]} != {v}" for k, v in (("steps", ref["steps"]), ("version", 1), ("hash", ref["hash"]))
                    if ep[k] != v]
        if not within_noise(ep["test"], ref["test"], ref["test"], ref["n"]):
            problems.append(f"test score {ep['test']:.3f} outside noise of the reference's {ref['test']:.3f}")
        return problems


@dataclass
class Distiller(CheckpointedJob):
    """Standalone OPD: `python -m opd.distill RUN.yaml`."""

    kind = "opd"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "opd.distill", str(self.config)]

    def call(self, log) -> None:
        from opd.distill.config import load_run
        from opd.distill.run import run_distill

        run_distill(load_run(self.config), log=log)

    def check_rerun(self, before, log, finished):
        where, problems = _resume_from_ckpt(before, log, finished, re.compile(r"resuming distillation at step (\d+)"),
                                            re.compile(r"opd step 1/"), re.compile(r"already holds this run's student"))
        m = re.search(r"opd step (\d+)/", log)  # the first step this run took
        if m and int(m.group(1)) != (before[0] or 0) + 1:
            problems.append(f"first step {m.group(1)} after a checkpoint at step {before[0]}")
        return where, problems

    def summary(self) -> dict:
        m = json.loads((self.out / "manifest.json").read_text())
        hist = json.loads((self.out / "history.json").read_text())
        final = m["final"]
        return {"steps": m["train"]["steps"], "kept_step": m["train"]["kept_step"], "hash": m["content_hash"],
                "history_steps": [h["step"] for h in hist], "loss": final["loss"],
                "val": {k[4:]: v for k, v in final.items() if k.startswith("val/")}, "n": self.eval_limit()}

    def eval_limit(self) -> int:
        return yaml.safe_load(self.config.read_text())["distill"]["eval_limit"]

    def compare(self, ep, ref):
        # Bit-identical, as for training: the checkpoint carries the model, the optimizer, both RNG
        # states, the history and the best student so far.
        problems = [f"{k} {ep[k]} != {ref[k]}" for k in ("steps", "kept_step", "history_steps", "hash")
                    if ep[k] != ref[k]]
        problems += [f"final val {c} {ep['val'][c]:.3f} outside noise of {v:.3f}" for c, v in ref["val"].items()
                     if not within_noise(ep["val"][c], v, v, ref["n"])]
        return problems


@dataclass
class Search(Job):
    """The merge search: `python -m opd.merge --recipe R.yaml --no-live`, one command for the first run
    and every rerun: it continues the study when there is one, else starts it."""

    kind = "search"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "opd.merge", "--recipe", str(self.config), "--no-live"]

    def call(self, log) -> None:
        from opd.merge import load_recipe, run_recipe

        run_recipe(load_recipe(self.config), resume=True, live=False, log=log)

    @property
    def db(self) -> Path:
        return self.out / "study.db"

    def trials(self) -> dict[int, tuple]:
        """Finished trials: number -> (start time, values), read straight from the study's tables."""
        if not self.db.exists():
            return {}
        with study_copy(self.db) as db, sqlite3.connect(db) as c:
            try:
                rows = c.execute("select t.number, t.datetime_start, v.objective, v.value from trials t "
                                 "join trial_values v on v.trial_id = t.trial_id where t.state = 'COMPLETE'").fetchall()
            except sqlite3.OperationalError:  # killed before the tables were made
                return {}
        out: dict[int, dict] = {}
        for number, start, objective, value in rows:
            out.setdefault(number, {"start": start})[objective] = value
        return {n: (d.pop("start"), tuple(d[k] for k in sorted(d))) for n, d in out.items()}

    def checkpoints(self) -> list[Path]:
        return sorted(self.out.glob("opd/trial-*/state.pt"))

    def opd_steps(self) -> dict[str, int]:
        """Checkpoint step of every OPD trial still training: trial dir -> step."""
        return {p.parent.name: checkpoint_step(p) for p in sorted(self.out.glob("opd/trial-*/state.pt"))}

    def progress(self) -> tuple[dict, dict, bool]:
        return self.trials(), self.opd_steps(), (self.out / "results.json").exists()

    def done(self, progress) -> bool:
        return progress[2]  # the run's last write

    def check_rerun(self, before, log, finished):
        done, now = before[0], self.trials()
        redone = sorted(n for n in done if now.get(n) != done[n])
        problems = [f"finished trials {redone} were run again or changed"] if redone else []
        if finished:
            n_trials = yaml.safe_load(self.config.read_text())["budget"]["n_trials"]
            if len(now) != n_trials:
                problems.append(f"{len(now)} finished trials, not {n_trials}")
            with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True) as c:
                total = c.execute("select count(*) from trials").fetchone()[0]
            if total > n_trials + self.runs - 1:  # each kill cuts short at most the one trial it hit
                problems.append(f"{total} trials for {n_trials} finished after {self.runs - 1} kills")
        return f"{len(done)} trials" + "".join(f" + {d} at step {k}" for d, k in before[1].items()), problems

    def regressed(self, before, after):
        trials = [f"finished trials {sorted(set(before[0]) - set(after[0]))} are gone"] \
            if set(before[0]) - set(after[0]) else []
        opd = [f"OPD {d} checkpoint went back from step {k} to {after[1][d]}" for d, k in before[1].items()
               if after[1].get(d) is not None and after[1][d] < k]
        return trials + opd

    def summary(self) -> dict:
        import optuna

        s = json.loads((self.out / "results.json").read_text())
        trials = {t["number"]: t for t in s["trials"]}
        best = trials[s["final"][s["best"]]["trial"]]
        storage = optuna.storages.RDBStorage(f"sqlite:///file:{self.db}?mode=ro&uri=true", skip_table_creation=True,
                                             skip_compatibility_check=True)
        states = [t.state.name for t in optuna.load_study(study_name=s["study"], storage=storage).trials]
        # trial directories only: <out>/opd/tb holds the trials' TensorBoard curves (opd.tracking)
        opd_dirs = sorted(p.name for p in (self.out / "opd").glob("trial-*")) if (self.out / "opd").exists() else []
        return {
            "trials": len(trials), "states": states, "best": best["candidate"], "best_n": best["scores"],
            "best_val": {c: v[0] for c, v in best["scores"].items()},
            "best_test": {c["capability"]: (c["score"], c["n"]) for c in s["matrix"]["test"] if c["candidate"] == s["best"]},
            # a candidate (with the weights an OPD one starts from) -> its objective values
            "by_candidate": {_key(t): t["values"] for t in trials.values()},
            "opd_trials": {n: [h["step"] for h in t["opd_history"]] for n, t in trials.items() if "opd_history" in t},
            "opd_steps": s["recipe"]["distill"]["steps"],
            "opd_dirs": opd_dirs, "opd_left": sorted(str(p) for p in self.out.glob("opd/*/state.pt")),
        }

    def compare(self, ep, ref):
        # The search is deterministic given its trial sequence: a candidate always merges (and, for OPD,
        # trains) to the same weights and scores the same, so any candidate the two runs share must have
        # identical values. The sequences differ after a kill, though: a resumed study's sampler is
        # reseeded by the trials already in the study (so it does not replay their draws), and a trial
        # the kill cut short is redone under a new number (a new seed). So the best is compared within
        # noise, not for identity.
        problems = [] if ep["trials"] == ref["trials"] else [f"{ep['trials']} finished trials, not {ref['trials']}"]
        differ = [k for k, v in ep["by_candidate"].items() if k in ref["by_candidate"] and ref["by_candidate"][k] != v]
        problems += [f"{len(differ)} candidates scored differently from the reference's same candidate"] if differ else []
        n = next(iter(ref["best_n"].values()))[2]
        problems += [f"best val {c} {ep['best_val'][c]:.3f} outside noise of {v:.3f}" for c, v in ref["best_val"].items()
                     if not within_noise(ep["best_val"][c], v, v, n)]
        problems += [f"best test {c} {ep['best_test'][c][0]:.3f} outside noise of {v:.3f}"
                     for c, (v, n) in ref["best_test"].items() if not within_noise(ep["best_test"][c][0], v, v, n)]
        if "RUNNING" in ep["states"]:
            problems.append("a trial is left RUNNING")
        # every OPD trial trained all its steps once, in the one directory of the trial it resumes
        problems += [f"OPD trial {k} history steps {v}" for k, v in ep["opd_trials"].items()
                     if v != list(range(1, ep["opd_steps"] + 1))]
        if ep["opd_left"] or len(ep["opd_dirs"]) != len(ep["opd_trials"]):
            problems.append(f"OPD directories {ep['opd_dirs']} (checkpoints left {ep['opd_left']}) for "
                            f"{len(ep['opd_trials'])} OPD trials")
        return problems


def _key(trial: dict) -> str:
    return json.dumps([trial["candidate"], trial.get("opd_init")], sort_keys=True)


# --- kills ----------------------------------------------------------------------------------------

def kill_episode(job: Job, rng: random.Random, window: tuple[float, float], max_kills: int, log=print,
                 after_progress: bool = False, finish_here: bool = False, tear: bool = False) -> dict:
    """Run `job` to the end in its (fresh) directory, SIGKILLing it up to `max_kills` times, each a
    delay drawn from `window` after its start (or, `after_progress`, after it first saved progress
    beyond what it started from); check the disk after every kill and the resume of every rerun.
    `finish_here`: the last rerun runs in this process (`Job.run_here`). `tear`: after each kill, the
    checkpoints it left are truncated (`tear_checkpoints`); the rerun must say so and fall back."""
    kills, problems, resumed, progress, n_torn = 0, [], [], [], 0
    while True:
        before = job.progress()
        torn = job.still_torn()
        here = kills == max_kills and finish_here
        if here:
            killed, seconds, text = job.run_here()
        else:
            # once a kill left the finished output (the process was still writing or exiting), the
            # rerun has nothing left to interrupt but its start-up: it runs to its end
            delay = rng.uniform(*window) if kills < max_kills and not job.done(before) else None
            killed, seconds, text = job.run(kill_after=delay, armed=_moved_on(job, before) if after_progress else None)
        if job.runs > 1:  # a rerun: it must continue from what the kill left
            where, found = job.check_rerun(before, text, finished=not killed)
            # (a search's torn OPD checkpoint may belong to a student that was complete: nothing reads it)
            if torn and not here and not killed and "unreadable" not in text and not isinstance(job, Search):
                found.append(f"no warning about the torn {sorted(str(p.relative_to(job.work)) for p in torn)}")
            problems += [f"run {job.runs}: {p}" for p in found]
            if where is not None:
                resumed.append(where + (" (torn)" if torn else ""))
        if not killed:
            break
        kills += 1
        after = job.progress()
        found = job.regressed(before, after) + check_tree(job.work, job.still_torn())
        problems += [f"kill {kills}: {p}" for p in found]
        progress.append(after)
        left = leftovers(job.work)
        cut = tear_checkpoints(job, rng) if tear else []
        n_torn += len(cut)
        log(f"  kill {kills} after {seconds:.1f} s: {_describe(job, after)}{'; temp ' + str(left) if left else ''}"
            f"{'; tore ' + str(cut) if cut else ''}{'; PROBLEMS ' + str(found) if found else ''}")
    problems += check_tree(job.work)
    return {"kills": kills, "problems": problems, "leftovers": leftovers(job.work), "resumed": resumed,
            "progress": progress, "summary": job.summary(), "torn": n_torn}


def _moved_on(job: Job, before) -> Callable[[], bool]:
    """Whether the job saved progress beyond `before` (a read torn by the live writer: not yet)."""
    def moved() -> bool:
        try:
            return job.progress() != before
        except Exception:
            return False
    return moved


def _describe(job: Job, progress) -> str:
    if isinstance(job, Search):
        return (f"{len(progress[0])} finished trials, OPD checkpoints {progress[1] or '-'}, "
                f"results {'written' if progress[2] else 'absent'}")
    return f"checkpoint step {progress[0]}, output {'written' if progress[1] else 'absent'}"


def make_job(kind: str, d: Path, lab: dict, size: int, opd_steps: int = 40) -> Job:
    """The job `kind` with its output in `d` (created); `size` is its steps (train, opd) or trials (search),
    `opd_steps` the steps of the search's OPD trials (40: long enough for kills to land in them).
    The job has an eval cache of its own in `d`: its first run scores what the reference scored, and
    its reruns find what its earlier runs scored, as a real rerun does."""
    d.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPD_CACHE": str(d / "cache")}
    if kind == "train":
        return Trainer(write_spec(d / "count.yaml", lab["base"], size), d / "count", env)
    if kind == "opd":
        return Distiller(write_run(d / "run.yaml", lab, d / "student", size), d / "student", env)
    return Search(write_recipe(d / "recipe.yaml", lab, d / "out", size, opd_steps), d / "out", env)


def run_job(kind: str, work: Path, lab: dict, kills: int, per_episode: int, rng: random.Random, size: int,
            log=print) -> dict:
    """The uninterrupted reference, then episodes until `kills` kills; returns the job's report."""
    ref_job = make_job(kind, work / "ref", lab, size)
    _, ref_s, _ = ref_job.run()
    problems = [f"reference: {p}" for p in check_tree(ref_job.work)]
    ref = ref_job.summary()
    log(f"{kind} reference: {ref_s:.1f} s")
    # From process start to past the end of the uninterrupted run: kills land in start-up, training,
    # trials, checkpointing, evaluation, the final scoring and the writes of the outputs.
    window = (0.5, ref_s)
    episodes, total = [], 0
    while total < kills:
        job = make_job(kind, work / f"ep{len(episodes)}", lab, size)
        log(f"{kind} episode {len(episodes)}:")
        # every other episode also tears the checkpoints each kill leaves
        ep = kill_episode(job, rng, window, min(per_episode, kills - total), log=log, tear=len(episodes) % 2 == 1)
        ep["problems"] += job.compare(ep["summary"], ref)
        ep["problems"] += [f"left {ep['leftovers']}"] if ep["leftovers"] else []
        ep["identical"] = ep["summary"]["hash"] == ref["hash"] if "hash" in ref else None
        total += ep["kills"]
        episodes.append(ep)
        log(f"  done after {ep['kills']} kills, {job.runs} runs{'; PROBLEMS ' + str(ep['problems']) if ep['problems'] else ''}")
    return {"job": kind, "ref": ref, "ref_s": ref_s, "episodes": episodes, "problems": problems}


# --- a --resume while workers are live -------------------------------------------------------------

def _study_trials(db: Path) -> list:
    import optuna

    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    try:
        names = optuna.get_all_study_names(storage)
        return optuna.load_study(study_name=names[0], storage=storage).get_trials() if names else []
    finally:
        storage.engine.dispose()


def _record(t):
    from opd.merge.trials import read

    return read(t)


def _pid_of(t) -> int | None:
    w = _record(t).worker
    return int(w.rpartition(":")[2]) if w else None


def live_resume_episode(job: Search, rng: random.Random, window: tuple[float, float], log=print) -> dict:
    """Two `--worker` processes share the job's study; one is SIGKILLed inside a trial (a random delay
    from `window` after it tagged one), then `--resume` starts from a third process while the other
    still runs. Checked: the two survivors exit 0; the resume fails exactly the killed worker's trials,
    never a live one's (its log line says how many it kept and failed); every other trial completes
    once and none is left running; a failed OPD trial is requeued and finished, and every OPD student
    trained its steps once in one directory; the disk loads and holds no temp file; shared candidates
    score as in the reference."""
    import optuna

    job.out.mkdir(parents=True, exist_ok=True)
    # Optuna makes its tables on first connect; two workers doing it at once may collide
    optuna.storages.RDBStorage(f"sqlite:///{job.db}").engine.dispose()
    base = [sys.executable, "-m", "opd.merge", "--recipe", str(job.config), "--no-live"]
    env = {**job.env, "COLUMNS": "200", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}

    def start(flag: str | None, name: str) -> tuple[subprocess.Popen, Path]:
        log_path = job.work / f"{name}.log"
        with open(log_path, "w") as f:
            return subprocess.Popen([*base, *([flag] if flag else [])], cwd=job.work, env=env, stdout=f, stderr=subprocess.STDOUT), log_path

    (victim, _), (survivor, survivor_log) = start("--worker", "worker-0"), start("--worker", "worker-1")
    problems: list[str] = []
    try:
        while victim.poll() is None and not any(_pid_of(t) == victim.pid and t.state.name == "RUNNING"
                                                 for t in _study_trials(job.db)):
            time.sleep(0.1)
        time.sleep(rng.uniform(*window))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        orphans = {t.number for t in _study_trials(job.db) if t.state.name == "RUNNING" and _pid_of(t) == victim.pid}
        resume, resume_log = start(None, "resume")  # the plain command: it resumes the study
        while "resume: " not in resume_log.read_text() and resume.poll() is None:
            time.sleep(0.1)
        live = survivor.poll() is None  # the worker still ran when the resume decided
        codes = {"worker": survivor.wait(timeout=1800), "resume": resume.wait(timeout=1800)}
    finally:
        for proc in (victim, survivor, *([resume] if "resume" in locals() else [])):
            if proc.poll() is None:
                proc.kill()
    texts = {"worker": survivor_log.read_text(errors="replace"), "resume": resume_log.read_text(errors="replace")}
    problems += [f"{k} exited {c}: {texts[k][-1500:]}" for k, c in codes.items() if c != 0]
    line = re.search(r"resume: (\d+) running trials kept .*?, (\d+) abandoned ones failed", texts["resume"])
    kept, failed = (int(line.group(1)), int(line.group(2))) if line else (0, 0)

    trials = _study_trials(job.db)
    states = {t.number: t.state.name for t in trials}
    fails = {n for n, st in states.items() if st == "FAIL"}
    # the killed worker's tagged trials, and at most one it created but had not tagged yet
    untagged = {t.number for t in trials if _record(t).worker is None}
    if not orphans <= fails or not fails <= orphans | untagged or len(fails - orphans) > 1:
        problems.append(f"failed trials {sorted(fails)}, the killed worker's running ones {sorted(orphans)}")
    if failed != len(fails):  # (no line: nothing was running when it opened the study)
        problems.append(f"the resume's log says {kept} kept, {failed} failed; the study has {len(fails)} failed")
    survivors = [t for t in trials if _pid_of(t) == survivor.pid]
    problems += [f"the live worker's trial {t.number} ended {t.state.name}" for t in survivors if t.state.name != "COMPLETE"]
    problems += [f"trial {n} left {st}" for n, st in states.items() if st in ("RUNNING", "WAITING")]
    done = [t for t in trials if t.state.name == "COMPLETE"]
    n_trials = yaml.safe_load(job.config.read_text())["budget"]["n_trials"]
    if not n_trials <= len(done) <= n_trials + 2:  # MaxTrialsCallback overshoots by at most processes - 1
        problems.append(f"{len(done)} finished trials for n_trials {n_trials}")
    resumed_of = {_record(t).resume_of for t in done}
    by_number = {t.number: t for t in trials}
    problems += [f"killed OPD trial {n} was not redone" for n in fails
                 if (c := _record(by_number[n]).candidate) and "opd" in c.strategy and n not in resumed_of]
    summary = job.summary()
    problems += [f"OPD trial {k} history steps {v}" for k, v in summary["opd_trials"].items()
                 if v != list(range(1, summary["opd_steps"] + 1))]
    opd = {r.resume_of if r.resume_of is not None else t.number for t in done
           if (r := _record(t)).opd_history is not None}
    if summary["opd_left"] or summary["opd_dirs"] != sorted(f"trial-{n}" for n in opd):
        problems.append(f"OPD directories {summary['opd_dirs']} (checkpoints left {summary['opd_left']}) for "
                        f"OPD trials {sorted(opd)}")
    problems += check_tree(job.work)
    where = f"{kept} live kept, {failed} failed{'' if live else ' (worker had ended)'}"
    log(f"  killed worker {victim.pid} in trials {sorted(orphans)}; resume: {where}; {len(done)} trials done"
        f"{'; PROBLEMS ' + str(problems) if problems else ''}")
    return {"kills": 1, "problems": problems, "leftovers": leftovers(job.work), "resumed": [where],
            "progress": [], "summary": summary, "torn": 0, "live": live}


def run_live(work: Path, lab: dict, episodes: int, rng: random.Random, size: int, ref: dict | None = None,
             ref_s: float | None = None, log=print) -> dict:
    """`episodes` of `live_resume_episode`, against the search reference (run here unless given)."""
    problems = []
    if ref is None:
        ref_job = make_job("search", work / "ref", lab, size)
        _, ref_s, _ = ref_job.run()
        problems = [f"reference: {p}" for p in check_tree(ref_job.work)]
        ref = ref_job.summary()
    eps = []
    for i in range(episodes):
        job = make_job("search", work / f"ep{i}", lab, size)
        log(f"live resume episode {i}:")
        ep = live_resume_episode(job, rng, (0.0, min(5.0, ref_s / 4)), log=log)
        ep["problems"] += [f"left {ep['leftovers']}"] if ep["leftovers"] else []
        ep["identical"] = None
        pairs = _shared(ep["summary"], ref)
        if pairs[0] != pairs[1]:
            ep["problems"].append(f"{pairs[1] - pairs[0]} candidates scored differently from the reference's")
        eps.append(ep)
    return {"job": "search, --resume beside a live worker", "ref": ref, "ref_s": ref_s, "episodes": eps,
            "problems": problems}


def print_table(reports: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="SIGKILL fault injection")
    for col in ("job", "episodes", "kills", "torn checkpoints", "reruns resumed from", "identical to reference",
                "problems"):
        table.add_column(col, overflow="fold")
    for r in reports:
        eps = r["episodes"]
        problems = r["problems"] + [p for e in eps for p in e["problems"]]
        resumed = ", ".join(w for e in eps for w in e["resumed"]) or "-"
        if eps and eps[0]["identical"] is not None:
            same = f"{sum(e['identical'] for e in eps)}/{len(eps)} runs' weights"
        else:
            pairs = [_shared(e["summary"], r["ref"]) for e in eps]
            same = f"{sum(a for a, _ in pairs)}/{sum(b for _, b in pairs)} shared candidates' scores"
        table.add_row(r["job"], str(len(eps)), str(sum(e["kills"] for e in eps)), str(sum(e["torn"] for e in eps)),
                      resumed, same,
                      "\n".join(problems) if problems else "none")
    Console(width=200).print(table)


def _shared(ep: dict, ref: dict) -> tuple[int, int]:
    """(candidates scored as in the reference, candidates the reference also tried)."""
    shared = [k for k in ep["by_candidate"] if k in ref["by_candidate"]]
    return sum(ep["by_candidate"][k] == ref["by_candidate"][k] for k in shared), len(shared)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs in total, spread evenly over the jobs")
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated subset of {','.join(JOBS)}")
    ap.add_argument("--per-episode", type=int, default=5, help="most kills before a run is let finish")
    ap.add_argument("--steps", type=int, default=16, help="GSPO steps of each expert")
    ap.add_argument("--opd-steps", type=int, default=64, help="steps of each OPD run")
    ap.add_argument("--trials", type=int, default=6, help="finished trials of each search")
    ap.add_argument("--live-resumes", type=int, default=2, help="searches of two workers where one is killed "
                    "and --resume starts while the other runs (0: none)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill delays")
    ap.add_argument("--base", default=None, help="base model directory (default: a pico base built here)")
    ap.add_argument("--work", default=None, help="work directory, kept (default: a temporary one, removed at the end)")
    args = ap.parse_args(argv)
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown or not jobs:
        ap.error(f"--jobs: unknown {unknown}; choose from {','.join(JOBS)}")

    if args.work:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
    else:  # the runs' directories and logs, removed however the bench ends: --work keeps them
        work = Path(tempfile.mkdtemp(prefix="opd-faults-"))
        atexit.register(shutil.rmtree, work, True)
    # the jobs write their outputs under the work directory: an allowed output root (opd.paths)
    os.environ["OPD_OUTPUT_ROOTS"] = os.pathsep.join(filter(None, [os.environ.get("OPD_OUTPUT_ROOTS"), str(work)]))
    base = Path(args.base) if args.base else build_pico_base(work / "pico")
    lab = build_lab(work / "lab", base)
    print(f"work directory {work}")
    rng = random.Random(args.seed)
    size = {"train": args.steps, "search": args.trials, "opd": args.opd_steps}
    share = [args.kills // len(jobs) + (i < args.kills % len(jobs)) for i in range(len(jobs))]
    t0 = time.time()
    reports = [run_job(kind, work / kind, lab, n, args.per_episode, rng, size[kind])
               for kind, n in zip(jobs, share)]
    if args.live_resumes:
        search = next((r for r in reports if r["job"] == "search"), {})
        reports.append(run_live(work / "live", lab, args.live_resumes, rng, args.trials, search.get("ref"),
                                search.get("ref_s")))
    print()
    print_table(reports)
    bad = sum(bool(r["problems"]) + sum(bool(e["problems"]) for e in r["episodes"]) for r in reports)
    print(f"{sum(e['kills'] for r in reports for e in r['episodes'])} kills in {time.time() - t0:.0f} s; "
          f"{bad} job references or episodes with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
