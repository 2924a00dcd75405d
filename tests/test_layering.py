"""Imports point one way: every `import` in opd/ (lazy ones inside functions included) goes down the
floors below, or sideways on its own floor, and no two packages import each other, however indirectly.

The floors are those of the design (../shared/DESIGN.md), package by package; entry-point modules
inside a package (`python -m opd.merge`, the lab's pipeline) sit on the top floor. A module the table
does not place fails the test: put it on a floor when you add it.
"""

from __future__ import annotations

from pathlib import Path

from import_walk import walk_imports

ROOT = Path(__file__).resolve().parents[1]

# node -> floor. A module belongs to the longest node that is it or a package above it; the root
# `opd` node holds only opd/__init__.py.
FLOORS = {
    # 0 ground: YAML into frozen models, atomic writes and hashes, one-line errors, output paths,
    # the expert manifest every floor above reads
    "opd": 0, "opd.config": 0, "opd.io": 0, "opd.errors": 0, "opd.devices": 0, "opd.schedule": 0, "opd.paths": 0, "opd.manifest": 0,
    "opd.model_inputs": 0,  # opening any HF model directory and checking it against a base
    # 1 services: rollout engines, lm-eval scoring, capabilities, kernels, curves, the live display
    "opd.rollout": 1, "opd.evaluation": 1, "opd.capabilities": 1, "opd_kernels": 1, "opd.tracking": 1,
    "opd.display": 1, "opd.console": 1,
    # where work runs: a local process or pool, or a Ray cluster (the layers above never import Ray)
    "opd.cluster": 1,
    # the token layouts (torch alone): the rollout engine's packed prefill and the updates share them
    "opd.rl.packing": 1,
    # 2 core maths: the RL maths both loops share, weight-space merges
    "opd.rl": 2, "opd.weights": 2,
    # 3 loops (GSPO experts, OPD, the lab's base) and the strategies that run them
    "opd.expert": 3, "opd.distill": 3, "opd.lab": 3, "opd.merge.strategies": 3,
    # 4 consolidation: the search over strategies, its records and report
    "opd.merge": 4,
    # 5 entry points: argument parsing, wiring
    "opd.cli": 5, "opd.expert.cli": 5, "opd.lab.cli": 5, "opd.lab.pipeline": 5, "opd.merge.__main__": 5,
    "opd.distill.__main__": 5,
    "opd.lab.recipe": 5,  # what `opd lab` reads: a merge recipe plus the lab's training section
    "opd.expert.__main__": 5,
}
NAMES = {0: "ground", 1: "services", 2: "core", 3: "loops and strategies", 4: "consolidation", 5: "entry points"}
# Loops take settings objects, not specs: these modules must not import those.
NOT_IMPORTED = {"opd.expert.trainer": {"opd.expert.spec"}, "opd.distill.loop": {"opd.distill.run"}}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "opd").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def node_of(module: str) -> str | None:
    if module == "opd":
        return "opd"
    hits = [n for n in FLOORS if n != "opd" and (module == n or module.startswith(n + "."))]
    return max(hits, key=len) if hits else None


def imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every opd import of one file, at any depth of its code."""
    # `from opd.merge import trials` imports the module opd.merge.trials
    out = [(line, f"{base}.{name}" if name and f"{base}.{name}" in MODULES else base)
           for line, base, name in walk_imports(module, path)]
    return list(dict.fromkeys((line, m) for line, m in out if m.split(".")[0] in ("opd", "opd_kernels")))


def edges() -> list[tuple[str, str, str, str]]:
    """(source node, target node, 'file:line', imported module) across nodes (None: a node the table lacks)."""
    out = []
    for module, path in MODULES.items():
        src = node_of(module)
        for line, target in imports(module, path):
            dst = node_of(target)
            if src != dst:
                out.append((src, dst, f"{path.relative_to(ROOT)}:{line}", target))
    return out


def test_every_module_has_a_floor():
    unplaced = [f"{path.relative_to(ROOT)} ({m})" for m, path in MODULES.items() if node_of(m) is None]
    unplaced += [f"{where} imports {target}" for _, dst, where, target in edges() if dst is None]
    assert not unplaced, "not on any floor of tests/test_layering.py's FLOORS (place them):\n  " + "\n  ".join(unplaced)


def test_imports_point_down_the_floors():
    bad = [f"{where}: `{target}`: {src} (floor {FLOORS[src]}, {NAMES[FLOORS[src]]}) imports {dst} "
           f"(floor {FLOORS[dst]}, {NAMES[FLOORS[dst]]}) above it"
           for src, dst, where, target in edges() if None not in (src, dst) and FLOORS[dst] > FLOORS[src]]
    assert not bad, "imports pointing up the floors:\n  " + "\n  ".join(bad)


def test_no_package_cycles():
    graph: dict[str, dict[str, str]] = {}
    for src, dst, where, target in edges():
        if None not in (src, dst):
            graph.setdefault(src, {}).setdefault(dst, f"{where} imports {target}")

    def path_to(start: str, goal: str) -> list[str] | None:
        seen, stack = {start}, [(start, [])]
        while stack:
            node, trail = stack.pop()
            for nxt, why in graph.get(node, {}).items():
                if nxt == goal:
                    return [*trail, why]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, why]))
        return None

    cycles = {}
    for src, targets in graph.items():
        for dst, why in targets.items():
            back = path_to(dst, src)
            if back and frozenset((src, dst)) not in cycles:
                cycles[frozenset((src, dst))] = f"{src} -> {dst} -> ... -> {src}:\n    " + "\n    ".join([why, *back])
    assert not cycles, "package import cycles:\n  " + "\n  ".join(cycles.values())


def test_loops_take_settings_not_specs():
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}" for m, banned in NOT_IMPORTED.items()
           for line, target in imports(m, MODULES[m]) if any(target == b or target.startswith(b + ".") for b in banned)]
    assert not bad, "a loop imports the recipe or spec that drives it:\n  " + "\n  ".join(bad)


def test_the_walk_sees_lazy_imports(tmp_path):
    """The walk reads imports inside functions too (the cycles it guards against were lazy ones)."""
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from opd.merge.search import run_recipe\n    import opd.io\n")
    assert [t for _, t in imports("opd.x.m", mod)] == ["opd.merge.search", "opd.io"]
