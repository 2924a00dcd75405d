"""The lab pipeline: each stage reuses what is up to date and recomputes the rest."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from opd.errors import OpdError

STAGES = ("base", "experts", "merge")
console = Console(stderr=True)


def run_parallel(cmds: dict[str, list[str]], jobs: int, log_dir: Path) -> None:
    """Run each named command as a subprocess, at most `jobs` at a time, its output in
    log_dir/<name>.log; raises OpdError naming every command that failed, with its log's tail."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    log_dir.mkdir(parents=True, exist_ok=True)

    def run(name: str) -> tuple[str, int]:
        with open(log_dir / f"{name}.log", "wb") as out:
            return name, subprocess.run(cmds[name], stdout=out, stderr=subprocess.STDOUT).returncode

    failed = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for name, rc in pool.map(run, cmds):
            console.print(f"{name}: {'done' if rc == 0 else f'FAILED (exit {rc})'} ({log_dir / name}.log)")
            if rc != 0:
                failed.append(name)
    if failed:
        tails = "; ".join(f"{n}: {_last_line(log_dir / f'{n}.log')}" for n in failed)
        raise OpdError(f"{len(failed)} of {len(cmds)} expert runs failed ({tails}); rerun to resume them")


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def run_lab(recipe_path: str, stages: list[str], jobs: int = 1) -> None:
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise OpdError(f"--stages: unknown stage(s) {unknown}; choose from {', '.join(STAGES)}")
    if "base" in stages:
        from opd.lab.run import build_and_report

        build_and_report()
    experts: list[str] = []
    if "experts" in stages or "merge" in stages:
        from opd.merge import load_recipe

        recipe = load_recipe(recipe_path)
        experts = list(recipe.experts)
    if "experts" in stages:
        from opd.expert.manifest import EXPERTS_DIR
        from opd.expert.run import run_expert
        from opd.expert.spec import load_expert_spec

        specs = {name: EXPERTS_DIR / f"{name}.yaml" for name in experts}
        for name, spec_path in specs.items():
            if not spec_path.exists():
                raise OpdError(f"{recipe_path}: expert {name!r} has no spec {spec_path}")
        if jobs > 1:  # one process per expert (each a no-op when its spec and base are unchanged)
            script = Path(__file__).resolve().parents[2] / "scripts" / "train_expert.py"
            run_parallel({n: [sys.executable, str(script), str(p)] for n, p in specs.items()}, jobs,
                         Path("runs") / "lab" / "logs")
        else:
            for spec_path in specs.values():
                run_expert(load_expert_spec(spec_path))  # a no-op when spec and base are unchanged
    if "merge" in stages:
        from opd.merge import run_recipe

        run_recipe(recipe, resume=True, worker=False, live=True, log=console.print)
