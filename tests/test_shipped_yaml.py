"""Every shipped YAML that is not covered elsewhere loads into its validated model."""

from pathlib import Path

import pytest

from opd.distill.config import load_run
from opd.lab.base import DEFAULT_SPEC, load_base_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "merge_recipes" / "distill").rglob("*.yaml")), ids=lambda p: p.name)
def test_distill_runs_load(path):
    run = load_run(path)
    assert run.teachers


def test_lab_base_spec_loads():
    spec = load_base_spec(DEFAULT_SPEC)
    assert len(spec.lab_capabilities) == 10 and set(spec.lab_capabilities) <= set(spec.capabilities)


def test_every_yaml_is_covered():
    """A new YAML folder needs a loader test: this lists the ones that have one."""
    covered = {"merge_recipes", "merge_recipes/distill", "merge_recipes/distill/lab10_ablations",
               "merge_recipes/distill/lab12_ablations", "experts", "evals", "evals/byo",
               "opd/lab"}
    folders = {str(p.parent.relative_to(ROOT)) for p in ROOT.rglob("*.yaml")
               if not any(part.startswith(".") or part in ("runs", "build") for part in p.relative_to(ROOT).parts)}
    assert folders <= covered, folders - covered


def test_byo_tasks_index_with_a_usable_metric():
    """evals/byo's task YAMLs resolve in lm-eval's index with the metric opd scores (no data loads)."""
    from opd.capabilities.lm_eval_task import task_info, task_manager

    d = ROOT / "evals" / "byo"
    manager = task_manager(str(d), False)
    for path in d.glob("*.yaml"):
        info = task_info(path.stem, str(d), manager)
        assert (info.metric, info.filter) == ("exact_match", "strict-match") and not info.include_defaults


def test_lab12_noverifier_reuses_lab10s_experts():
    """lab12_noverifier's ten verified experts are lab10's: the same outputs and training overrides, so a
    lab12 run reuses a lab10 run's experts (spec and base hashes match) instead of training others."""
    from opd.lab.recipe import load_lab_recipe

    lab10 = load_lab_recipe(ROOT / "merge_recipes" / "lab10.yaml")
    lab12 = load_lab_recipe(ROOT / "merge_recipes" / "lab12_noverifier.yaml")
    assert set(lab10.merge.experts) < set(lab12.merge.experts)
    assert lab12.train.overrides == lab10.train.overrides and lab12.merge.base == lab10.merge.base
    assert lab12.merge.verifier == "none" and lab12.merge.distill.warmstart_temperature < 1.0
