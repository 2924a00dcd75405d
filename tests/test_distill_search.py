"""OPD inside the merge search: recipe fields, per-strategy budgets, hybrids, report, best student."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_merge_fakes import build_fake_lab, write_recipe

from opd.errors import OpdError
from opd.merge import load_recipe, run_recipe
from opd.merge.strategies import get_strategy, merge_part
from opd.merge.strategies.distill import distill_part
from opd.weights.merge import Candidate

OPD = {"steps": 2, "lr": 1e-3, "teacher_weight": [0.5, 2.0]}


def test_opd_strategies_and_hybrids_are_registered():
    assert not get_strategy("opd").weight_space and get_strategy("opd").init == "base"
    assert get_strategy("merge_opd").init == "best"
    hybrid = get_strategy("ties+opd")
    assert hybrid.init == "ties" and {"density", "weight", "steps", "teacher_weight"} <= set(hybrid.parameters)
    assert get_strategy("ties").weight_space
    with pytest.raises(OpdError, match="<method>\\+opd"):
        get_strategy("opd+opd")
    cand = Candidate(strategy="ties+opd", shared={"lambda": 1.0, "steps": 3},
                     per_model={"a": {"density": 0.5, "teacher_weight": 2.0}}, seed=4)
    assert merge_part(cand) == Candidate(strategy="ties", shared={"lambda": 1.0},
                                         per_model={"a": {"density": 0.5}}, seed=4)
    assert distill_part(cand) == ({"steps": 3}, {"a": 2.0})
    assert merge_part(Candidate(strategy="opd")) is None


def test_recipe_refuses_bad_opd_settings(tmp_path):
    lab = {"base": "b", "experts": {"add": "add"}}
    path = write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", strategies={"opd": {"estimator": "exact"}})
    with pytest.raises(OpdError, match="strategy 'opd': estimator"):
        load_recipe(path)
    with pytest.raises(OpdError, match="per_strategy names 'ties'"):
        load_recipe(write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", strategies={"opd": {}},
                                 budget={"n_trials": 2, "per_strategy": {"ties": 1}}))


def test_search_runs_opd_next_to_merges(tmp_path):
    os.environ["OPD_CACHE"] = str(tmp_path / "cache")
    torch.set_num_threads(1)
    lab = build_fake_lab(tmp_path / "lab", ("count", "rev"))
    strategies = {"linear": {"weight": [0.2, 1.0]}, "opd": {**OPD, "estimator": {"choices": ["sampled", "full"]}},
                  "ties+opd": {**OPD, "density": [0.3, 1.0], "weight": 1.0}, "merge_opd": {**OPD, "reward_weight": 0.5}}
    recipe = load_recipe(write_recipe(
        tmp_path / "r.yaml", lab, tmp_path / "out", strategies=strategies,
        budget={"n_trials": 4, "per_strategy": {s: 1 for s in strategies}},
        distill={"prompts_per_step": 2, "group_size": 2}, screening={"limit": None}, final_candidates=4))
    summary = run_recipe(recipe, live=False, log=lambda *a: None)
    # each strategy capped at one trial: four trials, one each, whatever the sampler drew
    assert sorted(t["candidate"]["strategy"] for t in summary["trials"]) == sorted(strategies)
    by = {t["candidate"]["strategy"]: t for t in summary["trials"]}
    for s in ("opd", "ties+opd", "merge_opd"):
        hist = by[s]["opd_history"]
        assert [h["step"] for h in hist] == [1, 2] and any(k.startswith("kl/") for k in hist[-1])
        assert (recipe.out_dir / "opd" / f"trial-{by[s]['number']}" / "student.safetensors").exists()
    assert by["ties+opd"]["opd_init"]["strategy"] == "ties" and by["opd"]["opd_init"] is None
    # merge_opd waits for a merge scored on full val and half the trials: it always starts from linear
    assert by["merge_opd"]["number"] >= 2 and by["linear"]["number"] < by["merge_opd"]["number"]
    assert by["merge_opd"]["opd_init"]["strategy"] == "linear"
    # OPD candidates sit in the same interference matrix as the merges
    rows = {c["candidate"] for c in summary["matrix"]["test"]}
    assert any(r.endswith(" opd") for r in rows) and any(r.endswith(" linear") for r in rows)
    md = (recipe.out_dir / "report.md").read_text()
    assert "On-policy distillation runs" in md and (recipe.out_dir / "opd_kl.png").stat().st_size > 0
    manifest = json.loads((recipe.out_dir / "best" / "manifest.json").read_text())
    assert manifest["kind"] in ("merged", "distilled")


def test_killed_opd_trial_resumes_from_its_checkpoint(tmp_path):
    lab = build_fake_lab(tmp_path / "lab", ("count", "rev"))
    recipe_path = write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", strategies={"opd": {"lr": 1e-3}},
                               budget={"n_trials": 1}, screening={"limit": None}, final_candidates=1,
                               distill={"steps": 100_000, "prompts_per_step": 2, "group_size": 2,
                                        "checkpoint_every": 1})
    env = {**os.environ, "OPD_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "opd.merge", "--recipe", str(recipe_path), "--no-live"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "out" / "opd" / "trial-0" / "state.pt"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists() and torch.load(ckpt, weights_only=False)["state"]["step"] >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "search ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(ckpt, weights_only=False)["state"]["step"]
    # the step count is not part of a run's identity: the resumed trial finishes sooner
    os.environ["OPD_CACHE"] = str(tmp_path / "cache")
    summary = run_recipe(load_recipe(recipe_path, [f"distill.steps={killed_at + 1}"]), resume=True, live=False,
                         log=lambda *a: None)
    (trial,) = summary["trials"]
    assert trial["number"] == 1 and trial["resume_of"] == 0 and trial["candidate"]["seed"] == 0
    assert [h["step"] for h in trial["opd_history"]] == list(range(1, killed_at + 2))
    assert ckpt.with_name("student.safetensors").exists()
    assert not ckpt.exists() and not ckpt.with_name("state.prev.pt").exists()  # both versions go
