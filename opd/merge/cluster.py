"""Search workers on a Ray cluster: `python -m opd.merge --recipe R --workers N --ray [ADDRESS]` runs
N `--worker` processes as Ray tasks (opd.cluster) that share the recipe's study, each on the node Ray
picks; the calling process then resumes the study, which is done, to re-score the finalists on test
and write the report, as a plain run does."""

from __future__ import annotations

import sys
from pathlib import Path

from opd.cluster import ClusterSettings, check_shared, connect, run_commands_on_ray
from opd.display import console
from opd.errors import OpdError
from opd.merge.study import study_storage


def search_on_ray(recipe_path: str, overrides: list[str], recipe, workers: int, address: str) -> None:
    """Refused in one line unless every node shares the run directory (and, for the default SQLite
    study, the file it lives in); a worker whose node dies is rerun by Ray and its trial redone."""
    ray = connect(address, "--ray")
    check_shared(ray, recipe.out_dir, "--ray")
    recipe.out_dir.mkdir(parents=True, exist_ok=True)

    study_storage(recipe)  # Optuna makes its tables on first connect: once, here, not by N workers at once
    cmd = [sys.executable, "-m", "opd.merge", "--recipe", str(Path(recipe_path).resolve()), "--worker", "--no-live",
           *overrides]
    names = [f"worker{i}" for i in range(workers)]
    log_dir = recipe.out_dir / "workers"
    codes = run_commands_on_ray(ClusterSettings(engine="ray", address=address), {n: cmd for n in names},
                                {n: {"CPU": float(recipe.threads)} for n in names}, log_dir, log=console.print)
    failed = [n for n, rc in codes.items() if rc != 0]
    if failed:
        raise OpdError(f"{len(failed)} of {workers} search workers failed (see {log_dir}/<worker>.log); rerun "
                       "to continue the study")
