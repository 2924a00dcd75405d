"""Guards against the leaks of issue #31: each test fails if one comes back.

- the merge search knows nothing of the lab (the lab's recipe contains a merge recipe, not the reverse);
- no opd module finds a script of the checkout by path (entry points are `python -m` modules);
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from opd.errors import OpdError

ROOT = Path(__file__).resolve().parents[1]
OPD = ROOT / "opd"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of a file, at any depth, relative ones resolved."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


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
    assert merge.train == {"overrides": {"steps": 400, "max_minutes": 12}, "jobs": 2}
    assert lab.merge == merge and lab.train == LabTraining(overrides={"steps": 400, "max_minutes": 12}, jobs=2)
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
