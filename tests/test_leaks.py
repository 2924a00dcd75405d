"""Guards against the leaks of issue #31: each test fails if one comes back.

- the merge search knows nothing of the lab (the lab's recipe contains a merge recipe, not the reverse);
- no opd module finds a script of the checkout by path (entry points are `python -m` modules);
- no module-level import cycles among opd's modules;
- an import inside a function says why it is lazy (`# lazy: <reason>`: a heavy or optional dependency, or
  a cycle), so that the dependency graph stays readable at the top of each file
  (scripts/count_lazy_imports.py counts them).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from import_walk import module_name, walk_imports

from opd.errors import OpdError

ROOT = Path(__file__).resolve().parents[1]
OPD = ROOT / "opd"


def _module_name(path: Path) -> str:
    return module_name(path, ROOT)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a file, at any depth, relative ones resolved."""
    return [(line, f"{base}.{name}" if name else base) for line, base, name in walk_imports(_module_name(path), path)]


# --- the merge search knows nothing of the lab ------------------------------------------------------

LAB = ("opd.lab", "opd.expert.spec")  # the lab, and the expert spec its `train:` section overrides


def _is_lab(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in LAB)


def test_merge_imports_nothing_of_the_lab():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in sorted((OPD / "merge").rglob("*.py"))
           for line, m in _imported(p) if _is_lab(m)]
    assert not bad, "opd.merge imports the lab (put lab settings in opd/lab/recipe.py):\n  " + "\n  ".join(bad)


def test_importing_every_merge_module_loads_no_lab_module():
    # the transitive check: no module that opd.merge imports pulls the lab in either
    code = ("import importlib, pkgutil, sys, opd.merge\n"
            "for m in pkgutil.walk_packages(opd.merge.__path__, 'opd.merge.'):\n"
            "    importlib.import_module(m.name)\n"
            f"print(sorted(k for k in sys.modules if any(k == p or k.startswith(p + '.') for p in {LAB!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", f"importing opd.merge loads {out.stdout.strip()}"


def test_a_lab_recipe_contains_the_merge_recipe_and_checks_its_train_section(tmp_path):
    from opd.lab.recipe import LabTraining, load_lab_recipe
    from opd.merge import load_recipe

    # the shipped file reads both ways: `opd merge` keeps `train:` as written, `opd lab` checks it
    merge = load_recipe("merge_recipes/lab10.yaml")
    lab = load_lab_recipe("merge_recipes/lab10.yaml")
    overrides = {"steps": 400, "max_minutes": 12, "gspo.layout": "packed", "gspo.minibatch": "groups",
                 "engine_args.compact_every": 3, "engine_args.prefill": "packed"}
    assert merge.train == {"overrides": overrides, "jobs": 2}
    assert lab.merge == merge and lab.train == LabTraining(overrides=overrides, jobs=2)
    assert load_lab_recipe("merge_recipes/byo.yaml").train == LabTraining()  # no train: section
    # a typo in the lab's section is the lab's error, named by file and field; `opd merge` runs the file
    path = tmp_path / "r.yaml"
    path.write_text("experts: [count]\nstrategies: {linear: {weight: 1.0}}\ntrain: {jobz: 2}\n")
    assert load_recipe(path).train == {"jobz": 2}
    with pytest.raises(OpdError, match=r"r.yaml: field 'train.jobz': unknown field"):
        load_lab_recipe(path)
    # the merge part's errors read as `opd merge` gives them
    path.write_text("experts: [count]\nstrategies: {linear: {weight: 1.0}}\nbudgt: {}\n")
    with pytest.raises(OpdError, match=r"r.yaml: field 'budgt': unknown field"):
        load_lab_recipe(path)


# --- no module finds a script of the checkout by path -----------------------------------------------


def script_paths(path: Path) -> list[str]:
    """'line: text' for each string in a file's code that is a path into scripts/: one with no space whose
    first component is `scripts` ("scripts", "scripts/train_expert.py"). Prose that names a script for
    the user ("build it with scripts/build_base.py") has spaces and passes."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not any(c.isspace() for c in node.value):
            first = node.value.replace("\\", "/").lstrip("./").split("/")[0]
            if first == "scripts":
                out.append((node.lineno, f"{node.lineno}: {node.value!r}"))
    return [text for _, text in sorted(out)]


def test_no_opd_module_finds_a_script_by_path():
    bad = [f"{p.relative_to(ROOT)}:{hit}" for p in sorted(OPD.rglob("*.py")) for hit in script_paths(p)]
    assert not bad, ("opd finds scripts/ by path, which breaks outside a checkout: run `python -m <module>` "
                     "of the package instead:\n  " + "\n  ".join(bad))


def test_the_script_path_check_sees_the_old_form(tmp_path):
    old = tmp_path / "m.py"
    old.write_text('from pathlib import Path\n"""Run scripts/train_expert.py."""\n'
                   'script = Path(__file__).resolve().parents[2] / "scripts" / "train_expert.py"\n'
                   'other = "./scripts/lab.py"\nmsg = "train it with scripts/train_expert.py"\n')
    assert script_paths(old) == ["3: 'scripts'", "4: './scripts/lab.py'"]


def test_the_experts_module_runs_as_python_dash_m(tmp_path):
    # the lab's expert processes run it so; a bad spec is refused in one line, exit 2, from any directory
    spec = tmp_path / "count.yaml"
    spec.write_text("capability: count\ngspo: {lr: -1}\n")
    r = subprocess.run([sys.executable, "-m", "opd.expert", str(spec)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "count.yaml: field 'gspo.lr'" in r.stderr and "Traceback" not in r.stderr


# --- no module-level import cycles ------------------------------------------------------------------

MODULES = {_module_name(p): p for p in sorted(OPD.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """(line, opd module) for the imports that run when the file is imported: its top-level statements,
    those in top-level if/try/with blocks and class bodies, not function bodies or `if TYPE_CHECKING:`.
    `from opd.weights import merge` names the module opd.weights.merge; `from opd.x import name` opd.x."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.extend((node.lineno, a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                out.extend((node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
                           for a in node.names)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try | ast.TryStar):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(block)
            elif isinstance(node, ast.With | ast.ClassDef):
                visit(node.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return [(line, m) for line, m in out if m in MODULES]


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The cycles of a directed graph, one per strongly connected component of more than one node (or a
    node importing itself), each as a closed path through it (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, {})))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1 or node in graph.get(node, {}):
                        components.append(comp)
    cycles = []
    for comp in components:  # one closed path through the component, found by a breadth-first search
        members, start = set(comp), sorted(comp)[0]
        prev: dict[str, str] = {}
        queue = [start]
        while queue and start not in prev:
            node = queue.pop(0)
            for nxt in graph.get(node, {}):
                if nxt in members and nxt not in prev:
                    prev[nxt] = node
                    queue.append(nxt)
        path, node = [start], prev[start]
        while node != start:
            path.append(node)
            node = prev[node]
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports at module level: line}. Importing opd.merge.search from outside
    opd.merge runs opd/merge/__init__.py first: that package is an edge too."""
    graph: dict[str, dict[str, int]] = {}
    for m, p in MODULES.items():
        graph[m] = {}
        for line, t in reversed(module_level_imports(p)):
            parts = t.split(".")
            for up in [".".join(parts[:k]) for k in range(1, len(parts))] + [t]:
                if up in MODULES and up != m and not m.startswith(up + "."):
                    graph[m][up] = line
    return graph


def test_no_module_level_import_cycles():
    graph = import_graph()
    found = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:], strict=False)) + f" -> {c[-1]}"
             for c in import_cycles(graph)]
    assert not found, ("module-level import cycles (move the shared piece down a module, or import inside the "
                       "function with a `# lazy: cycle` reason):\n  " + "\n  ".join(found))


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"e": 1}}
    assert sorted(map(tuple, import_cycles(graph))) == [("a", "b", "c", "a"), ("e", "e")]
    assert import_cycles({"a": {"b": 1}, "b": {}}) == []


# --- function-level imports say why they are lazy --------------------------------------------------

# Files that other branches rework at the same time: their imports get their reasons (or move up) when
# those branches land. The lead empties this list after merging; do not add to it.


def _count_lazy():
    spec = importlib.util.spec_from_file_location("count_lazy_imports", ROOT / "scripts" / "count_lazy_imports.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def test_every_function_level_import_says_why_it_is_lazy():
    found = _count_lazy().collect([OPD])
    bad = [f"{i.path.relative_to(ROOT)}:{i.line}: {i.text}" for i in found if i.reason is None]
    assert not bad, ("imports inside functions without a `# lazy: <reason>` comment (on the line or the one "
                     "above): move them to the top of the file, or say why they must wait (a heavy or optional "
                     "dependency that an importer of this module must not pay for, or an import cycle):\n  "
                     + "\n  ".join(bad))
    assert all(i.reason for i in found if i.reason is not None), "a `# lazy:` comment with no reason"


def test_the_lazy_import_count_reads_reasons(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("import os\n\n\ndef f():\n    import json\n    # lazy: torch is slow to import\n"
                   "    import torch\n    from opd import io  # lazy: cycle\n    import opd.merge\n\n    class A:\n"
                   "        def g(self):\n            from . import x\n")
    found = _count_lazy().collect([mod])
    assert [(i.line, i.kind, i.reason) for i in found] == [  # another import's reason above does not count
        (5, "stdlib", None), (7, "third-party", "torch is slow to import"), (8, "own", "cycle"), (9, "own", None),
        (13, "own", None)]


def test_module_level_imports_skip_function_bodies_and_type_checking(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("from typing import TYPE_CHECKING\nimport opd.io\ntry:\n    from opd.errors import OpdError\n"
                   "except ImportError:\n    pass\nif TYPE_CHECKING:\n    import opd.merge\n\n\n"
                   "def f():\n    import opd.config\n")
    assert [m for _, m in module_level_imports(mod, "opd.x.m")] == ["opd.io", "opd.errors"]


def test_no_import_cycles_even_inside_functions_unless_marked():
    """A lazy import hides a cycle from the module-level check; the only ones allowed say so
    (`# lazy: cycle: ...`), like a package's registry that its own base module looks names up in.
    (adamerging and merge in opd.weights imported each other this way until merge_keys moved down.)"""
    marked = {(i.path, i.line) for i in _count_lazy().collect([OPD]) if i.reason and i.reason.startswith("cycle")}
    graph: dict[str, dict[str, int]] = {}
    for m, p in MODULES.items():
        graph[m] = {}
        for line, t in _imported(p):
            t = t if t in MODULES else t.rpartition(".")[0]
            if (p, line) not in marked and t in MODULES and t != m and not m.startswith(t + "."):
                graph[m].setdefault(t, line)
    found = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:], strict=False)) + f" -> {c[-1]}"
             for c in import_cycles(graph)]
    assert not found, ("import cycles through function-level imports (move the shared piece down a module, "
                       "or mark the lazy import `# lazy: cycle: <why>`):\n  " + "\n  ".join(found))
