"""`verifier: none`: consolidation that never calls a capability's reward (issue #32, item 1).

A counter wraps every registered capability's `verify` (every reward opd has goes through it) and
the guarded reward entry point; calls from lm-eval's metric hook (opd.evaluation.heldout), which
scores val and test as before, are counted apart. Every test name contains `verifier`, so
`pytest -k verifier` runs them all.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass

import pytest
import torch
import yaml
from test_merge_fakes import build_fake_lab, write_recipe
from transformers import AutoModelForCausalLM

from opd.capabilities import get_capability, list_capabilities
from opd.distill.config import DistillConfig, load_run
from opd.errors import OpdError
from opd.merge import load_recipe, run_recipe

TINY = {"prompts_per_step": 2, "group_size": 2, "warmstart_prompts": 4, "warmstart_group": 2,
        "warmstart_batch": 4, "warmstart_steps": 2, "eval_limit": 4}


@dataclass
class RewardCalls:
    training: int = 0  # any call outside lm-eval's scoring: what verifier: none forbids
    scoring: int = 0  # lm-eval's metric hook scoring val/test candidates (allowed)


def _from_lm_eval() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "process_results" and frame.f_code.co_filename.endswith(
                "opd/evaluation/heldout.py"):
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def reward_calls(monkeypatch) -> RewardCalls:
    from opd.capabilities.rewards import GuardedReward

    calls = RewardCalls()

    def counted(fn):
        def wrapper(*args, **kwargs):
            if _from_lm_eval():
                calls.scoring += 1
            else:
                calls.training += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in list_capabilities():
        cap = get_capability(name)
        # Capability is a frozen dataclass: its instance dict holds `verify`
        monkeypatch.setitem(cap.__dict__, "verify", counted(cap.verify))
    monkeypatch.setattr(GuardedReward, "__call__", counted(GuardedReward.__call__))
    return calls


@pytest.fixture(scope="module")
def lab(tmp_path_factory, trained_pico_dir):
    """Experts near a base trained on `count`: its expert is right on a few warm-start samples (so the
    verifier keeps some), wrong on most; `rev`'s is never right."""
    return build_fake_lab(tmp_path_factory.mktemp("lab"), ("count", "rev"), base=trained_pico_dir)


@pytest.mark.parametrize("verifier", ["none", "capability"])
def test_verifier_none_merge_search_calls_no_reward(tmp_path, lab, reward_calls, verifier):
    """A merge search whose OPD trial has a warm start and OPD steps: no reward call under
    verifier: none, some with the default (so the counter counts); lm-eval still scores it."""
    torch.set_num_threads(1)
    recipe = load_recipe(write_recipe(
        tmp_path / "r.yaml", lab, tmp_path / "out", strategies={"opd": {"steps": 2, "lr": 1e-3}},
        budget={"n_trials": 1}, distill={**TINY, "eval_every": 1}, screening={"limit": None}, final_candidates=1,
        verifier=verifier))
    assert recipe.verifier == recipe.distill.verifier == verifier
    summary = run_recipe(recipe, live=False, log=lambda *a: None)
    (trial,) = summary["trials"]
    hist = trial["opd_history"]
    assert hist[0]["phase"] == "warmstart" and hist[0]["warm_tokens"] > 0 and [h["step"] for h in hist] == [0, 1, 2]
    assert reward_calls.scoring > 0  # val/test scoring of the candidate is lm-eval's, as before
    if verifier == "none":
        assert reward_calls.training == 0
        assert not any(k.startswith("reward/") for h in hist for k in h)
    else:
        # the warm start's 2 x 8 samples, then 2 steps' 2 x 2: every one verified
        assert reward_calls.training == 2 * 8 + 2 * 4 and any(k.startswith("reward/") for k in hist[-1])
    assert json.loads((recipe.out_dir / "results.json").read_text())["recipe"]["verifier"] == verifier
    assert ("No verifier (`verifier: none`)" in (recipe.out_dir / "report.md").read_text()) == (verifier == "none")


@pytest.mark.parametrize("verifier", ["none", "capability"])
def test_verifier_none_standalone_run_trains_on_every_teacher_sample(tmp_path, lab, reward_calls, verifier):
    """`python -m opd.distill`'s run: under verifier: none the warm start keeps every sample drawn
    (the random fake experts are almost never right, so the verifier would keep next to none), OPD
    has no reward term, and no reward is called; packed minibatches split prompt groups without rewards."""
    from opd.distill.run import run_distill

    torch.set_num_threads(1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "name": "d", "base": str(lab["base"]), "teachers": [str(p) for p in lab["experts"].values()],
        "out": str(tmp_path / "out"), "verifier": verifier,
        "distill": {**TINY, "steps": 2, "layout": "packed", "updates_per_batch": 2}}))
    logs: list[str] = []
    manifest = run_distill(load_run(path), log=logs.append)
    (line,) = [m for m in logs if m.startswith("warm start: ")]
    kept = {c: int(n) for c, n in (w.split("=") for w in line.split()[-2:])}
    drawn = TINY["warmstart_prompts"] * TINY["warmstart_group"]
    if verifier == "none":
        assert line.startswith("warm start: unfiltered teacher samples") and kept == {"count": drawn, "rev": drawn}
        assert reward_calls.training == 0
        assert not any(k.startswith("reward/") for k in manifest["final"])
    else:
        assert line.startswith("warm start: verified teacher samples") and 0 < kept["count"] < drawn
        assert kept["rev"] == 0
        assert reward_calls.training == 2 * drawn + 2 * 4  # every warm-start sample, then every OPD sample
        assert any(k.startswith("reward/") for k in manifest["final"])
    assert reward_calls.scoring > 0 and "min_retention" in manifest["final"]
    assert manifest["run"]["verifier"] == manifest["run"]["distill"]["verifier"] == verifier


def test_verifier_none_warm_start_keeps_incorrect_samples(lab, tokenizer, reward_calls):
    """The unfiltered warm start trains on the teacher's wrong answers too, duplicates and all: the
    samples are the teacher's distribution (sequence-level KD), drawn from the same RNG as the
    verified ones, which are the correct subset of them."""
    from opd.distill.offpolicy import verified_samples
    from opd.distill.routing import resolve_routes
    from opd.distill.teachers import embedded_teacher

    model = AutoModelForCausalLM.from_pretrained(lab["experts"]["count"])
    teachers = {"count": embedded_teacher("count", "count", model, tokenizer)}
    routes = resolve_routes({"count": ("count",)})
    kw = {"prompts": 6, "group": 3, "temperature": 1.0, "seed": 0}
    everything = verified_samples(teachers, routes, random.Random(0), verify=False, **kw)["count"]
    assert reward_calls.training == 0 and len(everything) == 6 * 3
    verified = verified_samples(teachers, routes, random.Random(0), **kw)["count"]
    assert reward_calls.training == 6 * 3
    assert 0 < len(verified) < len(everything) and set(map(str, verified)) <= set(map(str, everything))


def test_verifier_none_mbr_picks_the_consensus():
    """MBR selection (warmstart_select: mbr) keeps the majority completion when some repeat, else the
    one closest to the others; a lone distinct sample, or a tie, goes to the one drawn first."""
    from opd.distill.offpolicy import mbr_pick, similarity

    assert similarity((1, 2, 3), (1, 2, 3)) == 1.0 and similarity((1, 2), (3, 4)) == 0.0
    assert mbr_pick([(5, 2), (7, 2), (7, 2), (9, 2)]) == (7, 2)  # the majority
    # no repeats: (1, 2, 3, 4) shares most with both others
    assert mbr_pick([(9, 9, 9, 9), (1, 2, 3, 4), (1, 2, 3, 5), (6, 2, 3, 4)]) == (1, 2, 3, 4)
    assert mbr_pick([(4,)]) == (4,) and mbr_pick([(1,), (2,)]) == (1,)


def test_verifier_none_mbr_warm_start_reads_no_reward(lab, tokenizer, reward_calls):
    """select mbr: one pair per prompt, each of them one of that prompt's unfiltered samples, and no
    reward is called."""
    from opd.distill.offpolicy import verified_samples
    from opd.distill.routing import resolve_routes
    from opd.distill.teachers import embedded_teacher

    model = AutoModelForCausalLM.from_pretrained(lab["experts"]["count"])
    teachers = {"count": embedded_teacher("count", "count", model, tokenizer)}
    routes = resolve_routes({"count": ("count",)})
    kw = {"prompts": 6, "group": 4, "temperature": 1.0, "seed": 0, "verify": False}
    everything = verified_samples(teachers, routes, random.Random(0), **kw)["count"]
    picked = verified_samples(teachers, routes, random.Random(0), select="mbr", **kw)["count"]
    assert reward_calls.training == 0 and len(picked) == 6
    for prompt, completion in picked:
        assert completion in [c for p, c in everything if p == prompt]


def test_verifier_none_batch_carries_no_reward(lab, tokenizer, reward_calls):
    """The OPD batch under verifier: none has no rewards and its update runs without them."""
    from opd.distill.batch import build_batch, sample_batch
    from opd.distill.loop import StudentHidden, opd_step
    from opd.distill.routing import resolve_routes
    from opd.distill.teachers import embedded_teacher
    from opd.rollout import get_engine

    teacher = AutoModelForCausalLM.from_pretrained(lab["experts"]["count"])
    student = AutoModelForCausalLM.from_pretrained(lab["base"])
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    routes = resolve_routes({"count": ("count",)})
    engine = get_engine("embedded", model=student, tokenizer=tokenizer)
    items, groups = sample_batch(engine, routes, {"count": 1.0}, random.Random(0), prompts=3, group=2,
                                 temperature=1.0, max_new_tokens=None, seed=0)
    cfg = DistillConfig(verifier="none", layout="packed", updates_per_batch=3)
    batch = build_batch(student, items, groups, teachers, routes, tokenizer.pad_token_id, layout="packed",
                        rewards=False)
    assert batch.rewards is None and batch.group == 2
    out = opd_step(StudentHidden(student), torch.optim.AdamW(student.parameters(), lr=1e-3), batch, cfg, teachers)
    assert out["loss"] == out["loss"] and reward_calls.training == 0
    assert build_batch(student, items, groups, teachers, routes, tokenizer.pad_token_id).rewards.shape == (3, 2)
    assert reward_calls.training == 6


@pytest.mark.parametrize("strategy, params, named", [
    ("gspo", {}, "reward_weight 1.0, fixed by the strategy"),
    ("opd", {"reward_weight": [0.0, 0.5]}, "reward_weight (0.0, 0.5) can be above 0"),
    ("merge_opd", {"reward_weight": {"choices": [0.0, 0.2]}}, "reward_weight [0.0, 0.2] can be above 0"),
    ("ties+opd", {"reward_weight": 0.3, "density": 0.5, "weight": 1.0}, "reward_weight 0.3 can be above 0"),
])
def test_verifier_none_refuses_a_strategy_that_reads_rewards(tmp_path, lab, capsys, strategy, params, named):
    """One line naming the strategy and the field, exit code 2, nothing written."""
    from opd.merge.__main__ import main

    out = tmp_path / "out"
    path = write_recipe(tmp_path / "r.yaml", lab, out, strategies={"linear": {"weight": 1.0}, strategy: params},
                        verifier="none")
    with pytest.raises(SystemExit) as e:
        main(["--recipe", str(path), "--no-live"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"strategy {strategy!r}" in err and named in err
    assert "field 'verifier'" in err and "verifier: none rules out" in err and str(path) in err and not out.exists()
    # the same strategy with the verifier is a valid recipe
    assert load_recipe(path, ["verifier=capability"]).verifier == "capability"


def test_verifier_none_recipe_refusals_and_what_it_allows(tmp_path, lab):
    def recipe(**fields):
        return write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", **fields)

    with pytest.raises(OpdError, match="field 'distill'.*reward_weight 0.5 mixes the capability's reward into "
                                       "OPD, which verifier: none rules out"):
        load_recipe(recipe(strategies={"opd": {}}, verifier="none", distill={"reward_weight": 0.5}))
    with pytest.raises(OpdError, match="verifier: none and distill.verifier: capability disagree"):
        load_recipe(recipe(strategies={"opd": {}}, verifier="none", distill={"verifier": "capability"}))
    # distill.verifier alone is the same setting; off-policy distillation under it is sequence-level KD
    r = load_recipe(recipe(strategies={"opd": {"warmstart_steps": 3}, "offpolicy": {"warmstart_steps": 3},
                                       "linear": {"weight": 1.0}},
                           distill={"verifier": "none"}))
    assert r.verifier == r.distill.verifier == "none"
    assert load_recipe(recipe(strategies={"opd": {}})).verifier == "capability"  # today's behaviour by default


def test_verifier_none_run_refusals(tmp_path, lab, capsys):
    """A standalone run: multi-task GSPO (kl_weight 0) or any reward_weight > 0 is refused in one
    line with exit code 2, nothing written."""
    from opd.distill.__main__ import main

    out = tmp_path / "out"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"base": str(lab["base"]), "teachers": [str(lab["experts"]["count"])],
                                    "out": str(out), "verifier": "none",
                                    "distill": {"kl_weight": 0.0, "reward_weight": 1.0}}))
    with pytest.raises(SystemExit) as e:
        main([str(path), "--no-eval"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and not out.exists()
    assert "multi-task GSPO" in err and "verifier: none rules out" in err and "field 'distill'" in err
    with pytest.raises(SystemExit) as e:
        main([str(path), "distill.kl_weight=1", "distill.reward_weight=0.1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "reward_weight 0.1 mixes the capability's reward into OPD" in err
    assert load_run(path, ["distill.kl_weight=1", "distill.reward_weight=0"]).distill.verifier == "none"


def test_verifier_field_resumes_old_checkpoints_and_studies():
    """Runs and studies made before `verifier` existed used the capability's reward: the default keeps
    them resumable, and `none` is part of a run's identity (a verified run never resumes as one without)."""
    from opd.distill.loop import run_identity
    from opd.distill.run import _settings
    from opd.merge.study import SEARCH_FIELD_DEFAULTS, SEARCH_FIELDS

    assert "verifier" not in run_identity(DistillConfig()) and run_identity(DistillConfig(verifier="none"))["verifier"] == "none"
    old = {"name": "d", "distill": {"steps": 2}}
    assert _settings(old) == _settings({**old, "verifier": "capability",
                                        "distill": {"steps": 2, "verifier": "capability"}})
    assert "verifier" in SEARCH_FIELDS and SEARCH_FIELD_DEFAULTS["verifier"] == "capability"
