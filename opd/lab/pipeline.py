"""The lab pipeline: each stage reuses what is up to date and recomputes the rest."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.text import Text

from opd.capabilities import get_capability
from opd.cluster import check_shared, connect, run_commands_on_ray
from opd.display import Display, console, display  # console: the live display's; prints land above it
from opd.errors import OpdError
from opd.manifest import EXPERTS_DIR

STAGES = ("base", "experts", "merge")


def run_parallel(cmds: dict[str, list[str]], jobs: int, log_dir: Path, every: float | None = None) -> None:
    """Run each named command as a subprocess, at most `jobs` at a time, its output in
    log_dir/<name>.log; raises OpdError naming every command that failed, with its log's tail.

    While they run, the process's live display (opd.display) has an "experts" section: one line per
    running expert (elapsed minutes and the last `step ...` line of its log: step, val, best) and a
    count of the queued and finished. On a terminal it updates in place, beside the other stages'
    bars; otherwise (CI, nohup) it prints every `every` seconds (default: the display's, 30)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    state = {n: "queued" for n in cmds}
    started: dict[str, float] = {}

    def run(name: str) -> int:
        started[name], state[name] = time.time(), "running"
        with open(log_dir / f"{name}.log", "wb") as out:
            rc = subprocess.run(cmds[name], stdout=out, stderr=subprocess.STDOUT).returncode
        state[name] = "done" if rc == 0 else f"FAILED (exit {rc})"
        return rc

    def line(name: str) -> str:
        mins = f"{(time.time() - started[name]) / 60:4.1f} min" if name in started else ""
        return f"{name}: {state[name]} {mins} {_last_step(log_dir / f'{name}.log')}".rstrip()

    def board() -> Text:
        running = [line(n) for n in cmds if state[n] == "running"]
        queued = sum(s == "queued" for s in state.values())
        head = f"experts: {len(cmds) - queued - len(running)} of {len(cmds)} finished, {queued} queued"
        return Text("\n".join([head, *running]), no_wrap=True, overflow="ellipsis")

    disp = display if every is None else Display(console, every)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool, disp.section("experts", board):
        futures = {n: pool.submit(run, n) for n in cmds}
        reported: set[str] = set()
        while len(reported) < len(futures):
            time.sleep(0.2)
            for n, f in futures.items():
                if f.done() and n not in reported:
                    reported.add(n)
                    console.print(f"{n}: {state[n]} ({log_dir / n}.log)")
    _raise_failed([n for n in cmds if state[n] != "done"], len(cmds), log_dir)


def _raise_failed(failed: list[str], total: int, log_dir: Path) -> None:
    if failed:
        tails = "; ".join(f"{n}: {_last_line(log_dir / f'{n}.log')}" for n in failed)
        raise OpdError(f"{len(failed)} of {total} expert runs failed ({tails}); rerun to resume them")


def run_on_cluster(cluster, cmds: dict[str, list[str]], resources: dict[str, dict], log_dir: Path,
                   outs: list[Path]) -> None:
    """The experts stage on a Ray cluster (opd.cluster): refused in one line unless every node sees the
    log directory and every expert's output directory; one task per expert with its spec's resources,
    rerun from its checkpoint when its node dies."""
    ray = connect(cluster.address, "cluster.address (train.cluster or --ray)")
    for d in dict.fromkeys(Path(o).resolve().parent for o in [log_dir / "x", *outs]):
        check_shared(ray, d, "cluster")
    codes = run_commands_on_ray(cluster, cmds, resources, log_dir, log=console.print)
    _raise_failed([n for n, rc in codes.items() if rc != 0], len(cmds), log_dir)


def _last_step(path: Path) -> str:
    """The last progress line (`step ...`) of a log, shortened; empty before there is one."""
    try:  # the tail only: the live table reads every running expert's log once a second
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    steps = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("step ")]
    return ("| " + steps[-1][:100]) if steps else ""


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def expert_jobs(recipe) -> dict[str, tuple[Path, Path | None]]:
    """Each of a recipe's experts as name -> (its spec experts/<name>.yaml, its output directory).
    An expert listed by name lands in the default experts/<name>/ (None); one listed as a path
    (experts/lab10/add) lands there, trained from the spec named by its last part; a `{path, tasks}`
    entry (a fine-tune brought from elsewhere) is not trained."""
    jobs = {}
    for entry in recipe.experts:
        if not isinstance(entry, str):  # a {path, tasks} entry is brought trained, not trained here
            continue
        p = Path(entry)
        out = p if len(p.parts) > 1 else None
        spec = EXPERTS_DIR / f"{p.name}.yaml"
        if not spec.exists():
            raise OpdError(f"merge recipe: expert {entry!r} has no spec {spec}; write one (see experts/*.yaml)")
        jobs[p.name] = (spec, out)
    return jobs


def longest_first(specs: dict) -> list[str]:
    """Expert names in the order to start them on a fixed number of slots: the most sampled tokens
    first (steps x prompts x group x the capability's answer cap + 1, the update's and the sampler's
    work alike grow with it), so the short runs fill in at the end and no slot idles while the
    longest one finishes alone (longest-processing-time scheduling). Ties keep the recipe's order."""
    def cost(n: str) -> int:
        s = specs[n]
        answer = s.gspo.max_new_tokens or get_capability(s.capability).max_new_tokens + 1
        return s.steps * s.gspo.prompts_per_step * s.gspo.group_size * answer
    return sorted(specs, key=lambda n: -cost(n))


def expert_command(spec: Path, out: Path | None, overrides: dict) -> list[str]:
    """One expert's training as a command line: the package's module, found wherever opd is installed."""
    return [sys.executable, "-m", "opd.expert", str(spec), *(f"{k}={v}" for k, v in overrides.items()),
            *(["--out", str(out)] if out else [])]


def manifest_stamps(dirs) -> dict[str, int | None]:
    """Each model directory's manifest.json modification time (None when absent): a stage that
    changed none of them found everything up to date."""
    stamps = {}
    for d in dirs:
        mf = Path(d) / "manifest.json"
        stamps[str(d)] = mf.stat().st_mtime_ns if mf.exists() else None
    return stamps


def run_lab(recipe_path: str, stages: list[str], jobs: int | None = None, seed: int | None = None,
            ray: str | None = None) -> None:
    """Run the stages in order; `jobs` (experts trained at once) defaults to the recipe's train.jobs.
    `ray` (an address, or 'auto') trains the experts on that Ray cluster whatever the recipe's
    train.cluster says.
    `seed` (default: the specs' own) seeds the base's pre-training and every expert's training: a
    different seed is a different lab. The minutes of the base and experts stages go to
    <recipe out>/lab_stages.json, which the report's headline reads."""
    from opd.io import atomic_write_json  # lazy: opd.io loads torch and numpy

    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise OpdError(f"--stages: unknown stage(s) {unknown}; choose from {', '.join(STAGES)}")
    from opd.lab.base import load_base_spec  # lazy: opd.lab.base loads transformers and torch
    from opd.lab.recipe import load_lab_recipe  # lazy: opd.lab.recipe loads transformers and torch

    lab = load_lab_recipe(recipe_path)  # bad input fails before hours of base training
    recipe, train = lab.merge, lab.train
    base_overrides = {**train.base, **({"seed": seed} if seed is not None else {})}
    try:  # the base stage's spec, checked now for the same reason
        load_base_spec(**base_overrides)
    except OpdError as e:
        raise OpdError(f"{recipe_path}: field 'train.base': {str(e).split(': field ', 1)[-1]}") from None
    # minutes of the invocation that last built each stage: a rerun that finds a stage up to date keeps
    # the recorded minutes instead of writing the seconds it took to check
    stages_file = recipe.out_dir / "lab_stages.json"
    try:
        minutes = json.loads(stages_file.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: start the record again
        minutes = {}

    def record(stage: str, t: float, before: dict, after: dict) -> None:
        if after != before or stage not in minutes:
            minutes[stage] = (time.time() - t) / 60
        atomic_write_json(stages_file, minutes)

    if "base" in stages:
        from opd.lab.run import build_and_report  # lazy: opd.lab.run loads transformers and torch

        t, before = time.time(), manifest_stamps([recipe.base])
        build_and_report(out=recipe.base, overrides=base_overrides)
        record("base", t, before, manifest_stamps([recipe.base]))
    if "experts" in stages:
        from opd.expert.run import run_expert  # lazy: opd.expert.run loads transformers and torch
        from opd.expert.spec import load_expert_spec  # lazy: opd.expert.spec loads torch and numpy

        specs = expert_jobs(recipe)
        outs = [out or EXPERTS_DIR / name for name, (_, out) in specs.items()]
        # every expert starts from the recipe's base (a BPE lab's runs/base-bpe) unless the overrides say otherwise
        overrides = {"base": recipe.base, **{k: str(v) for k, v in train.overrides.items()}}
        if seed is not None:
            overrides["seed"] = str(seed)
        loaded = {n: load_expert_spec(spec, **overrides) for n, (spec, _) in specs.items()}
        if any(s.reward_model_dir for s in loaded.values()):  # learned-reward experts train on a reward model: fit it first
            from opd.lab.reward_models import ensure_reward_models  # lazy: loads transformers' model classes

            t = time.time()
            fitted = ensure_reward_models(loaded.values(), recipe.base, dict(train.reward_models), log=console.print)
            record("reward_models", t, {}, {"fitted": sorted(fitted)} if fitted else {})
        t, before = time.time(), manifest_stamps(outs)
        jobs = jobs or train.jobs
        cluster = train.cluster
        if ray is not None:
            cluster = cluster.model_copy(update={"engine": "ray", "address": ray})
        if cluster.engine == "ray":  # one task per expert, with the resources its spec asks for, longest first
            run_on_cluster(cluster, {n: expert_command(*specs[n], overrides) for n in longest_first(loaded)},
                           {n: loaded[n].task_resources for n in specs},
                           Path("runs") / "lab" / "logs", outs)
        elif jobs > 1:  # one process per expert (each a no-op when its spec and base are unchanged), longest first
            run_parallel({n: expert_command(*specs[n], overrides) for n in longest_first(loaded)},
                         jobs, Path("runs") / "lab" / "logs")
        else:
            for n, (_, out) in specs.items():  # a no-op when spec and base are unchanged
                run_expert(loaded[n], out=out)
        record("experts", t, before, manifest_stamps(outs))
    if "merge" in stages:
        from opd.merge import run_recipe  # lazy: opd.merge loads transformers and torch

        # soft_wrap: a log off a terminal keeps the headline's table rows whole (rich wraps at 80)
        run_recipe(recipe, resume=True, worker=False, live=True,
                   log=lambda m: console.print(m, soft_wrap=True, markup=False, highlight=False))
