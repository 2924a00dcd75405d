"""The lab pipeline: each stage reuses what is up to date and recomputes the rest."""

from __future__ import annotations

from rich.console import Console

from opd.errors import OpdError

STAGES = ("base", "experts", "merge")
console = Console(stderr=True)


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
        from opd.expert.manifest import EXPERTS_DIR
        from opd.expert.run import run_expert
        from opd.expert.spec import load_expert_spec

        for name in experts:
            spec_path = EXPERTS_DIR / f"{name}.yaml"
            if not spec_path.exists():
                raise OpdError(f"{recipe_path}: expert {name!r} has no spec {spec_path}")
            run_expert(load_expert_spec(spec_path))  # a no-op when spec and base are unchanged
    if "merge" in stages:
        from opd.merge import run_recipe

        run_recipe(recipe, resume=True, worker=False, live=True, log=console.print)
