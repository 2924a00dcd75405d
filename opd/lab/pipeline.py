"""The lab pipeline: each stage reuses what is up to date and recomputes the rest."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from opd.errors import OpdError

STAGES = ("base", "experts", "merge")
console = Console(stderr=True)


def expert_is_current(spec, out: Path) -> bool:
    """An expert is reused when its manifest records the same spec and the same base weights."""
    from opd.io import state_dict_hash

    mf = out / "manifest.json"
    if not mf.exists():
        return False
    m = json.loads(mf.read_text())
    if m.get("spec") != spec.model_dump(mode="json"):
        return False
    base_mf = Path(spec.base) / "manifest.json"
    if base_mf.exists():
        return json.loads(base_mf.read_text()).get("content_hash") == m["base"]["content_hash"]
    from opd.expert.build import load_base

    return state_dict_hash(load_base(spec.base)[0]) == m["base"]["content_hash"]


def run_lab(recipe_path: str, stages: list[str]) -> None:
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
        from opd.expert.build import default_out
        from opd.expert.manifest import EXPERTS_DIR
        from opd.expert.run import run_expert
        from opd.expert.spec import load_expert_spec

        for name in experts:
            spec_path = EXPERTS_DIR / f"{name}.yaml"
            if not spec_path.exists():
                raise OpdError(f"{recipe_path}: expert {name!r} has no spec {spec_path}")
            spec = load_expert_spec(spec_path)
            if expert_is_current(spec, default_out(spec)):
                console.print(f"expert {name}: up to date, reused")
                continue
            run_expert(spec)
    if "merge" in stages:
        from opd.merge import run_recipe

        run_recipe(recipe, resume=True, worker=False, live=True, log=console.print)
