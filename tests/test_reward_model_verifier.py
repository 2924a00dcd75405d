"""`verifier: none` with learned-reward capabilities (issue #32): consolidating experts of `anagram` and
`mirror` calls neither their hidden rule (outside lm-eval's scoring) nor their reward model.

The counter is test_no_verifier's `reward_calls` (every capability's `verify` and the guarded reward
entry point), extended here with every reward-model score. Every test name contains `verifier`, so
`pytest -k verifier` runs them with the others.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from test_merge_fakes import build_fake_lab, write_recipe
from test_no_verifier import TINY, reward_calls  # noqa: F401  (the fixture, used by name)

from opd.capabilities.reward_model import RewardModel
from opd.merge import load_recipe, run_recipe


@pytest.fixture
def rm_calls(monkeypatch, reward_calls):  # noqa: F811
    """`reward_calls` plus `reward_calls.rm`: reward-model scores asked for, outside lm-eval or not."""
    reward_calls.rm = 0
    real = RewardModel.score

    def counted(self, prompts, completions):
        reward_calls.rm += len(completions)
        return real(self, prompts, completions)

    monkeypatch.setattr(RewardModel, "score", counted)
    return reward_calls


@pytest.fixture(scope="module")
def rm_lab(tmp_path_factory, trained_pico_dir):
    """Fake experts of the two learned-reward capabilities, and a reward model for each beside them, in
    the directory an expert spec would train on by default."""
    from test_reward_models import PICO_RM

    from opd.capabilities.reward_model import RewardModelSettings
    from opd.lab.tokenizer import build_char_tokenizer
    from opd.rl.reward_fit import train_reward_model

    root = tmp_path_factory.mktemp("rmlab")
    lab = build_fake_lab(root, ("anagram", "mirror"), base=trained_pico_dir)
    for cap in ("anagram", "mirror"):
        train_reward_model(RewardModelSettings(capability=cap, pairs=64, heldout_pairs=32, steps=5, batch_size=16,
                                               shape=PICO_RM, init="scratch"), build_char_tokenizer(), root / "rm" / cap,
                           log=lambda *a: None)
    return {**lab, "rm": root / "rm"}


def test_verifier_none_learned_reward_merge_search_calls_neither_rule_nor_reward_model(tmp_path, rm_lab, rm_calls):
    """A merge search with an OPD trial (warm start, OPD steps) over the anagram and mirror experts: no
    rule call outside lm-eval's scoring and no reward-model call; lm-eval still scores with the rule."""
    torch.set_num_threads(1)
    recipe = load_recipe(write_recipe(
        tmp_path / "r.yaml", rm_lab, tmp_path / "out", strategies={"opd": {"steps": 2, "lr": 1e-3}},
        budget={"n_trials": 1}, distill={**TINY, "eval_every": 1}, screening={"limit": None}, final_candidates=1,
        verifier="none"))
    summary = run_recipe(recipe, live=False, log=lambda *a: None)
    (trial,) = summary["trials"]
    assert trial["opd_history"][0]["phase"] == "warmstart" and trial["opd_history"][0]["warm_tokens"] > 0
    assert rm_calls.training == 0 and rm_calls.rm == 0
    assert rm_calls.scoring > 0  # the hidden rule scores val/test through lm-eval, as for any capability


def test_verifier_none_learned_reward_standalone_run_calls_neither(tmp_path, rm_lab, rm_calls):
    from opd.distill.config import load_run
    from opd.distill.run import run_distill

    torch.set_num_threads(1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "name": "d", "base": str(rm_lab["base"]), "teachers": [str(p) for p in rm_lab["experts"].values()],
        "out": str(tmp_path / "out"), "verifier": "none", "distill": {**TINY, "steps": 2}}))
    manifest = run_distill(load_run(path), log=lambda *a: None)
    assert rm_calls.training == 0 and rm_calls.rm == 0 and rm_calls.scoring > 0
    assert not any(k.startswith("reward/") for k in manifest["final"])


def test_verifier_counter_counts_reward_model_calls(tmp_path, rm_lab, rm_calls):
    """The positive control: a learned-reward expert's GSPO steps do call the reward model, and the counter
    sees each score asked for."""
    from test_reward_models import _spec

    from opd.expert.run import run_expert
    from opd.expert.spec import load_expert_spec

    spec = load_expert_spec(_spec(tmp_path, rm_lab["base"], rm_lab["rm"] / "anagram", steps=1, eval_every=5))
    run_expert(spec, out=tmp_path / "expert")
    assert rm_calls.rm >= 16 + 8  # one step's 4 x 4 rollouts and the step-0 val screening's 8 greedy answers
