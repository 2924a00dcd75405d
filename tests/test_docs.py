"""The docs stay true to the code: the generated recipe reference is current, README.md stays a short
user document, and every relative link in README.md and docs/ points at a file that exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))


def _generator():
    spec = importlib.util.spec_from_file_location("gen_recipe_docs", ROOT / "scripts" / "gen_recipe_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_recipe_reference_is_current():
    gen = _generator()
    committed = gen.OUT.read_text() if gen.OUT.exists() else ""
    assert gen.render() == committed, (
        "docs/reference/recipes.md is out of date with the pydantic models: run "
        "`python scripts/gen_recipe_docs.py` and commit the result")


def test_recipe_reference_covers_every_field():
    # Guards the generator itself: a field it skipped would pass the staleness check above.
    from opd.distill.config import DistillConfig
    from opd.expert.settings import GSPOConfig
    from opd.merge.recipe import Budget, MergeRecipe

    text = _generator().render()
    for model in (MergeRecipe, Budget, DistillConfig, GSPOConfig):
        assert f"### {model.__name__}" in text
        for name in model.model_fields:
            assert f"| `{name}` |" in text, f"{model.__name__}.{name} missing from the reference"
    assert "| `ties` | TIES |" in text  # the strategy registry's table


# A commit hash in backticks or after "commit", "session N", or a date: history belongs in docs/results/.
HISTORY = re.compile(r"`[0-9a-f]{7,40}`|\bcommit [0-9a-f]{7,40}\b|\bsession \d+|\b20\d\d-\d\d-\d\d\b", re.I)


def test_readme_is_short_and_free_of_history():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move detail into docs/"
    found = HISTORY.findall(text)
    assert not found, f"README.md carries run history {found[:5]}: put it in docs/results/"


def test_readme_keeps_the_commands_ci_runs():
    # .ci/run runs README's test command; a new user runs its set-up command.
    text = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = 'python -m pytest -m "not slow" -q'
    assert f". .venv/bin/activate && {test_cmd}" in text
    assert test_cmd in ci
    assert 'pip install torch==2.13.0 -e ".[dev]" && python scripts/lab.py' in text


def test_recipe_examples_in_docs_load(tmp_path):
    # A merge recipe shown in a guide is one a user copies: it must validate as written.
    from opd.merge.recipe import load_recipe

    shown = [block for page in DOCS for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)
             if re.search(r"^experts:", block, re.M) and re.search(r"^strategies:", block, re.M)]
    assert shown, "no merge recipe example found in docs/"
    for n, block in enumerate(shown):
        path = tmp_path / f"example{n}.yaml"
        path.write_text(block)
        load_recipe(path)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_relative_links_resolve():
    broken = []
    for page in [ROOT / "README.md", *DOCS]:
        in_code = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL, or an anchor in the same page
                path = (page.parent / target.split("#", 1)[0]).resolve()
                if not path.exists():
                    broken.append(f"{page.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "relative links to missing files:\n" + "\n".join(broken)
