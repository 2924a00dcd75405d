"""The lab's reward-model stage (opd.lab.reward_models): learned-reward experts get their reward model
fitted before they train, reused while up to date, refitted when the settings or base change."""

from __future__ import annotations

import json

import pytest
import torch

from opd.errors import OpdError
from opd.expert.spec import load_expert_spec
from opd.lab.model import build_model
from opd.lab.pico import PICO
from opd.lab.pipeline import run_lab
from opd.lab.reward_models import ensure_reward_models

FAST = {"pairs": 64, "heldout_pairs": 32, "steps": 3, "batch_size": 16, "init": "scratch",
        "shape": {"hidden_size": 16, "num_hidden_layers": 1, "intermediate_size": 32}}


def _spec(tmp_path, pico_dir, cap="anagram"):
    return load_expert_spec(f"experts/{cap}.yaml", base=str(pico_dir), reward_model=str(tmp_path / "rm" / cap))


def test_reward_models_are_fitted_once_then_reused_and_refitted_when_settings_change(tmp_path, pico_dir):
    torch.set_num_threads(1)
    spec = _spec(tmp_path, pico_dir)
    assert set(ensure_reward_models([spec], pico_dir, {"anagram": FAST}, log=lambda m: None)) == {"anagram"}
    mf = tmp_path / "rm" / "anagram" / "manifest.json"
    first = json.loads(mf.read_text())
    assert first["capability"] == "anagram" and first["settings"]["steps"] == 3
    logs = []
    assert ensure_reward_models([spec], pico_dir, {"anagram": FAST}, log=logs.append) == {}
    assert any("up to date" in m for m in logs)
    assert json.loads(mf.read_text())["created"] == first["created"]
    again = ensure_reward_models([spec], pico_dir, {"anagram": {**FAST, "steps": 4}}, log=logs.append)
    assert set(again) == {"anagram"} and json.loads(mf.read_text())["settings"]["steps"] == 4
    assert any("settings differ" in m for m in logs)


def test_a_reward_model_from_the_base_is_refitted_when_the_base_weights_change(tmp_path, pico_dir, tokenizer):
    torch.set_num_threads(1)
    spec = _spec(tmp_path, pico_dir, "mirror")
    settings = {**FAST, "init": "base"}
    assert set(ensure_reward_models([spec], pico_dir, {"mirror": settings}, log=lambda m: None)) == {"mirror"}
    assert ensure_reward_models([spec], pico_dir, {"mirror": settings}, log=lambda m: None) == {}
    build_model(PICO, tokenizer, seed=1).save_pretrained(pico_dir)  # another base seed: other weights
    logs = []
    assert set(ensure_reward_models([spec], pico_dir, {"mirror": settings}, log=logs.append)) == {"mirror"}
    assert any("other base weights" in m for m in logs)


def test_verified_experts_need_no_reward_model(tmp_path, pico_dir):
    spec = load_expert_spec("experts/count.yaml", base=str(pico_dir))
    assert ensure_reward_models([spec], pico_dir, {}, log=pytest.fail) == {}


@pytest.mark.parametrize("section,match", [
    ("{add: {init: scratch}}", r"train.reward_models.*'add' has no reward model"),
    ("{anagram: {stepz: 3}}", r"train.reward_models.*anagram.stepz.*Extra inputs"),
])
def test_bad_reward_model_settings_are_refused_in_one_line(tmp_path, section, match):
    path = tmp_path / "r.yaml"
    path.write_text(f"experts: [anagram]\nstrategies: {{linear: {{weight: 1.0}}}}\ntrain: {{reward_models: {section}}}\n")
    with pytest.raises(OpdError, match=match) as e:
        run_lab(str(path), ["experts"])
    assert "\n" not in str(e.value)


def test_the_experts_stage_fits_the_reward_model_before_the_expert_trains(tmp_path, pico_dir, monkeypatch):
    import opd.expert.run
    import opd.lab.reward_models

    order = []
    monkeypatch.setattr(opd.lab.reward_models, "train_reward_model",
                        lambda settings, tok, out, log, base_dir: order.append(("rm", settings.init, str(out)))
                        or {"train": {"seconds": 1.0}, "heldout": {"accuracy": 0.9, "n": 1}})
    monkeypatch.setattr(opd.expert.run, "run_expert", lambda spec, out=None: order.append(("expert", spec.capability)))
    monkeypatch.chdir(tmp_path)  # the default reward-model directory is relative: runs/reward_models/<capability>
    path = tmp_path / "r.yaml"
    path.write_text(f"base: {pico_dir}\nexperts: [count, anagram]\nstrategies: {{linear: {{weight: 1.0}}}}\n"
                    "train: {reward_models: {anagram: {init: scratch}}}\n")
    run_lab(str(path), ["experts"])
    assert order == [("rm", "scratch", "runs/reward_models/anagram"), ("expert", "count"), ("expert", "anagram")]
