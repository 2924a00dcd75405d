"""Learned-reward capabilities (issue #32, item 2): hidden rules, rule-generated preference pairs, a
Bradley-Terry reward model, GSPO experts trained on its score and picked by the rule's val score, and
the refusals of a missing reward model or one trained on another tokenizer."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from opd.capabilities import get_capability
from opd.capabilities.preference import LearnedRewardCapability
from opd.capabilities.reward_model import (
    ClassifierShape,
    RewardModelSettings,
    check_reward_model,
    load_reward_model,
)
from opd.errors import OpdError
from opd.rl.preference_loss import bradley_terry_loss

ROOT = Path(__file__).resolve().parents[1]
PICO_RM = ClassifierShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          intermediate_size=64)


def test_bradley_terry_loss_by_hand():
    # margins 1 and 0: -log sigmoid(1) = log(1 + e^-1) = 0.31326, -log sigmoid(0) = log 2 = 0.69315
    loss, st = bradley_terry_loss(torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.5]))
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + math.log(2)) / 2, abs=1e-6)
    assert st["accuracy"].item() == 0.5  # a tie is not a right ranking
    assert st["margin"].item() == pytest.approx(0.5)
    # the gradient pushes the chosen reward up and the rejected one down, by sigmoid(-margin) / B
    c, r = torch.tensor([1.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(c, r)[0].backward()
    assert c.grad.item() == pytest.approx(-1 / (1 + math.e)) and r.grad.item() == pytest.approx(1 / (1 + math.e))


def test_hidden_rules():
    anagram, mirror = get_capability("anagram"), get_capability("mirror")
    assert isinstance(anagram, LearnedRewardCapability) and isinstance(mirror, LearnedRewardCapability)
    # anagram: any order of exactly the word's letters, the word itself included; the first line counts
    assert anagram.verify("cab\n", "abc") == anagram.verify("abc", "abc") == 1.0
    assert anagram.verify("abcc", "abc") == anagram.verify("ab", "abc") == anagram.verify("abd", "abc") == 0.0
    # mirror: both echoes are valid answers, the rule prefers backwards (the reference answer)
    prompt, answer = mirror.generate(random.Random(0), 6)
    word = prompt[2:-1]
    assert answer == word[::-1] != word and mirror.verify(answer, answer) == 1.0 and mirror.verify(word, answer) == 0.0


@pytest.mark.parametrize("name", ["anagram", "mirror"])
def test_rule_generated_pairs(name):
    """Every pair's chosen answer satisfies the rule and its rejected one does not; train pairs come from
    train prompts and held-out pairs from val prompts; the same seed gives the same pairs."""
    cap = get_capability(name)
    for split in ("train", "val"):
        pairs = cap.pairs(split, 300, seed=3)
        assert pairs == cap.pairs(split, 300, seed=3) != cap.pairs(split, 300, seed=4)
        for p in pairs:
            answer = _reference(cap, p.prompt)
            assert cap.verify(p.chosen, answer) == 1.0 and cap.verify(p.rejected, answer) == 0.0
            assert cap.split_of(p.prompt) == split
    kinds = [p.kind for p in cap.pairs("train", 1000)]
    if name == "anagram":
        # the spurious cue: 80% of the rejected answers are a letter short, none is too long
        assert abs(kinds.count("short") / 1000 - 0.8) < 0.05
        assert all(len(p.rejected) <= len(p.chosen) for p in cap.pairs("train", 300))
        assert {p.kind for p in cap.pairs("train", 100, spurious=0.0)} == {"swap"}
    else:
        assert abs(kinds.count("forwards") / 1000 - 0.6) < 0.05


def _reference(cap, prompt: str) -> str:
    word = prompt[2:-1]
    return word if cap.name == "anagram" else word[::-1]


def _train_rm(tokenizer, out: Path, capability="anagram", steps=40, **kw) -> dict:
    from opd.rl.reward_fit import train_reward_model

    settings = RewardModelSettings(capability=capability, pairs=200, heldout_pairs=200, steps=steps,
                                   batch_size=32, lr=3e-3, shape=PICO_RM, init="scratch")
    return train_reward_model(settings, tokenizer, out, log=lambda *a: None, **kw)


@pytest.fixture(scope="module")
def anagram_rm(tmp_path_factory, tokenizer):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("rm") / "anagram"
    return out, _train_rm(tokenizer, out)


def test_reward_model_learns_the_cue_and_is_saved_with_its_tokenizer_hash(anagram_rm, tokenizer):
    """A pico reward model after 40 steps: it ranks the held-out pairs better than chance, mostly through
    the spurious length cue (the short kind), and its manifest carries what a user checks it by."""
    from opd.io import state_dict_hash, tokenizer_hash

    out, m = anagram_rm
    assert m["kind"] == "reward_model" and m["capability"] == "anagram"
    assert m["tokenizer_hash"] == tokenizer_hash(tokenizer) and m["spurious"] == 0.8
    h = m["heldout"]
    assert h["n"] == 200 and h["accuracy"] > 0.6 and h["by_kind"]["short"]["accuracy"] > h["by_kind"]["swap"]["accuracy"]
    rm = load_reward_model(out, "anagram", tokenizer)
    assert state_dict_hash(rm.model) == m["content_hash"]
    s = rm.score(["w:abcd=", "w:abcd="], ["dcba\n", "dc"])
    assert all(0 < x < 1 for x in s) and s[0] > s[1]
    assert json.loads((out / "manifest.json").read_text()) == m


def test_reward_model_from_the_base_is_the_lab_model_with_a_value_head(tmp_path, trained_pico_dir, tokenizer):
    """init: base starts from the base's own weights under a fresh score head (the body's tensors equal the
    base's before training), and needs the base's directory."""
    from transformers import AutoModelForCausalLM

    from opd.capabilities.reward_model import base_classifier
    from opd.rl.reward_fit import train_reward_model

    lm = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    rm = base_classifier(trained_pico_dir, seed=0)
    assert torch.equal(rm.model.layers[0].mlp.up_proj.weight, lm.model.layers[0].mlp.up_proj.weight)
    assert rm.score.weight.shape == (1, lm.config.hidden_size)
    settings = RewardModelSettings(capability="mirror", pairs=64, heldout_pairs=32, steps=2, batch_size=16)
    with pytest.raises(OpdError, match="init 'base' needs the base model directory"):
        train_reward_model(settings, tokenizer, tmp_path / "rm", log=lambda *a: None)
    m = train_reward_model(settings, tokenizer, tmp_path / "rm", log=lambda *a: None, base_dir=trained_pico_dir)
    assert m["init_from"] == str(trained_pico_dir) and load_reward_model(tmp_path / "rm", "mirror", tokenizer)


def test_reward_model_refusals(anagram_rm, tmp_path, tokenizer):
    from opd.lab.tokenizer import train_bpe_tokenizer

    out, _ = anagram_rm
    with pytest.raises(OpdError, match=r"field 'reward_model': .*nowhere/manifest.json is missing: capability "
                                       r"'anagram' learns from a reward model.*train_reward_model.py --capability anagram"):
        check_reward_model(tmp_path / "nowhere", "anagram", tokenizer)
    bpe = train_bpe_tokenizer(get_capability("anagram").items("train", 200), vocab_size=300)
    with pytest.raises(OpdError, match="field 'tokenizer_hash' .* trained on another tokenizer"):
        check_reward_model(out, "anagram", bpe)
    with pytest.raises(OpdError, match="not a reward model for 'mirror'"):
        check_reward_model(out, "mirror", tokenizer)


def _spec(tmp_path: Path, base: Path, rm: Path, **fields) -> Path:
    doc = {"capability": "anagram", "base": str(base), "reward": "reward_model", "reward_model": str(rm),
           "steps": 2, "eval_every": 1, "eval_limit": 8, "checkpoint_every": 1, "threads": 1,
           "score_capabilities": ["anagram"], "report_to": "none",
           "gspo": {"prompts_per_step": 4, "group_size": 4, "updates_per_batch": 2, "lr": 1e-3}, **fields}
    path = tmp_path / "anagram.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("case", ["missing", "other_tokenizer"])
def test_train_expert_refuses_a_bad_reward_model(tmp_path, pico_dir, anagram_rm, tokenizer, capsys, case):
    """One line naming the spec file, the field and the reward model's manifest; exit code 2; no expert,
    checkpoint or curve written."""
    from opd.expert.cli import train_main
    from opd.lab.tokenizer import train_bpe_tokenizer

    if case == "missing":
        rm = tmp_path / "runs" / "reward_models" / "anagram"
    else:  # a reward model fitted on a byte-level BPE, for a policy on the char tokenizer
        rm = tmp_path / "rm-bpe"
        _train_rm(train_bpe_tokenizer(get_capability("anagram").items("train", 200), vocab_size=300), rm, steps=2)
    spec = _spec(tmp_path, pico_dir, rm)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        train_main([str(spec), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert str(spec) in err and "field 'reward_model'" in err and str(rm / "manifest.json") in err
    assert ("is missing" in err) == (case == "missing") and ("another tokenizer" in err) == (case != "missing")
    assert not out.exists() and not (tmp_path / ".out.ckpt").exists()


def test_spec_refuses_reward_model_on_a_verified_capability(tmp_path, pico_dir):
    from opd.expert.spec import load_expert_spec

    with pytest.raises(OpdError, match=r"anagram.yaml: field '<root>'.*reward 'reward_model' needs a learned-reward "
                                       r"capability .* 'count' is verified"):
        load_expert_spec(_spec(tmp_path, pico_dir, tmp_path, capability="count"))


def test_gspo_expert_trains_on_the_reward_model_and_keeps_the_rules_best_step(tmp_path, trained_pico_dir,
                                                                               anagram_rm, monkeypatch):
    """Two GSPO steps on a pico base: the rewards are the reward model's (and its calls are counted), the
    rule's score of the same samples and the reward model's val score are logged beside the rule's val, and
    the kept step is the one with the best rule val score."""
    from opd.capabilities.reward_model import RewardModel
    from opd.expert.run import run_expert
    from opd.expert.spec import load_expert_spec

    calls = []
    real = RewardModel.score
    monkeypatch.setattr(RewardModel, "score", lambda self, p, c: calls.append(len(c)) or real(self, p, c))
    m = run_expert(load_expert_spec(_spec(tmp_path, trained_pico_dir, anagram_rm[0])), out=tmp_path / "expert")
    hist = m["train"]["history"]
    assert [h["step"] for h in hist] == [0, 1, 2]
    assert all(0 <= h["rm_val"] <= 1 and "val" in h for h in hist)
    for h in hist[1:]:
        assert 0 < h["rm_reward"] < 1 and 0 <= h["rule_reward"] <= 1 and "reward_errors" not in h
    best = max(hist, key=lambda h: (h["val"], -h["step"]))
    assert m["train"]["best_step"] == best["step"] and m["train"]["best_val_screen"] == best["val"]
    assert m["reward_model"]["content_hash"] == anagram_rm[1]["content_hash"] and m["reward"] == "reward_model"
    # rollouts (2 steps x 4 prompts x 4 samples, more if resampled) and 3 val screenings of 8 greedy answers
    assert sum(calls) >= 2 * 16 + 3 * 8


def _script_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_reward_model", ROOT / "scripts" / "train_reward_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.mark.parametrize("size", ["fast", pytest.param("full", marks=pytest.mark.slow)])
def test_train_reward_model_script_end_to_end(tmp_path, pico_dir, capsys, size):
    """The commands a user runs: fit the reward model, then train the expert on it. fast (CI): pico sizes,
    both scripts' entry points called in this process, seconds. full: the same commands as subprocesses,
    with the script's default reward model (the base with a value head, 1500 pairs, 300 steps), which
    must rank held-out pairs better than chance."""
    import os

    from opd.expert.cli import train_main

    rm = tmp_path / "runs" / "rm"
    small = ["pairs=200", "heldout_pairs=100", "steps=20", "init=scratch", "shape.hidden_size=32",
             "shape.num_hidden_layers=1"]
    rm_args = ["--capability", "mirror", "--base", str(pico_dir), "--out", str(rm)]
    spec = _spec(tmp_path, pico_dir, rm, capability="mirror", steps=1, score_capabilities=["mirror"])
    expert_args = [str(spec), "--out", str(tmp_path / "runs" / "mirror")]
    if size == "fast":
        _script_main()([*rm_args, *small])
        stdout = capsys.readouterr().out
        train_main(expert_args)
    else:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'kernels'}", "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_reward_model.py"), *rm_args],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        stdout = r.stdout
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_expert.py"), *expert_args],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads((rm / "manifest.json").read_text())
    assert f"held-out accuracy {m['heldout']['accuracy']:.3f}" in stdout
    if size == "full":
        assert m["heldout"]["accuracy"] > 0.6 and m["init_from"] == str(pico_dir)
    e = json.loads((tmp_path / "runs" / "mirror" / "manifest.json").read_text())
    assert e["reward_model"]["path"] == str(rm) and "rm_val" in e["train"]["history"][0]


def test_train_reward_model_script_refuses_a_verified_capability(tmp_path, pico_dir, capsys):
    out = tmp_path / "runs" / "x"
    with pytest.raises(SystemExit) as e:
        _script_main()(["--capability", "count", "--base", str(pico_dir), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "'count' has no reward model" in err
    assert not out.exists()


def test_a_retrained_reward_model_trains_a_new_expert_version(tmp_path, pico_dir, tokenizer):
    """The same spec over the same reward model is already done; over a retrained one it trains anew."""
    from opd.expert.run import run_expert
    from opd.expert.spec import load_expert_spec

    rm = tmp_path / "rm"
    _train_rm(tokenizer, rm, steps=2)
    spec = load_expert_spec(_spec(tmp_path, pico_dir, rm, steps=1, eval_every=5, eval_limit=4))
    first = run_expert(spec, out=tmp_path / "expert")
    assert run_expert(spec, out=tmp_path / "expert")["version"] == first["version"] == 1
    _train_rm(tokenizer, rm, steps=3)
    again = run_expert(spec, out=tmp_path / "expert")
    assert again["version"] == 2 and again["reward_model"]["content_hash"] != first["reward_model"]["content_hash"]
