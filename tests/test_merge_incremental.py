"""Re-merging after one expert was retrained: new study warm-started from the old best settings,
unchanged models not re-scored, a report that opens with what changed, the old run kept."""

from __future__ import annotations

import json

import optuna
import pytest
import torch
from test_merge_fakes import build_fake_lab, write_recipe

from opd.io import state_dict_hash
from opd.merge import load_recipe, run_recipe
from opd.merge.history import inputs_key, warm_params
from opd.merge.trials import read


def new_version(expert_dir, delta: float = 0.05) -> tuple[str, str]:
    """Retrain stand-in: perturb the expert's weights and write manifest version 2; (old, new) hash."""
    from transformers import AutoModelForCausalLM

    manifest = json.loads((expert_dir / "manifest.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(expert_dir)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(delta)
    model.save_pretrained(expert_dir)
    new = state_dict_hash(model)
    (expert_dir / "manifest.json").write_text(json.dumps({**manifest, "content_hash": new, "version": 2}))
    return manifest["content_hash"], new


def test_rerun_after_one_expert_changed(tmp_path, monkeypatch, scored):
    monkeypatch.setenv("OPD_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    lab = build_fake_lab(tmp_path / "lab")
    path = write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", final_candidates=3,
                        budget={"n_trials": 8, "warm_fraction": 0.5})
    out = tmp_path / "out"

    first = run_recipe(load_recipe(path), live=False, log=lambda *a: None)
    first_calls = set(scored)
    scored.clear()
    old_hash, new_hash = new_version(lab["experts"]["rev"])
    second = run_recipe(load_recipe(path), live=False, log=lambda *a: None)  # no --resume: new inputs

    # one study per set of input hashes, in the same storage
    base, add = first["inputs"]["base"]["content_hash"], first["inputs"]["experts"]["add"]["content_hash"]
    assert first["study"] == f"t-{inputs_key(base, {'rev': old_hash, 'add': add})}"
    assert second["study"] != first["study"] and second["study"].startswith("t-")
    storage = f"sqlite:///{out / 'study.db'}"
    assert set(optuna.get_all_study_names(storage)) == {first["study"], second["study"]}

    # (a) the base and the unchanged expert come from the cache; every lm-eval run is of a new model
    assert {(base, "val", None), (add, "test", None)} <= first_calls
    hashes = {h for h, _, _ in scored}
    assert base not in hashes and add not in hashes and old_hash not in hashes
    assert {(new_hash, "val", None), (new_hash, "test", None)} <= set(scored)
    assert not set(scored) & first_calls

    # (b) the new study ran the old final candidates first, then stopped at warm_fraction * n_trials
    study = optuna.load_study(study_name=second["study"], storage=storage)
    prev_final = list(dict.fromkeys(v["trial"] for v in first["final"].values()))[:4]
    assert study.user_attrs["warm_start"] == {"from": first["study"], "trials": prev_final}
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 4
    old_params = {t["number"]: t["params"] for t in first["trials"]}
    for t, n in zip(study.trials, prev_final):
        rec = read(t)
        assert rec.warm_start_of == n and rec.stage == "full"  # not screened first
        want = {("strategy" if k.startswith("strategy") else k): v for k, v in old_params[n].items()}
        assert t.params == want

    # (c) what changed, against the previous results kept in history/<old study>/
    kept = json.loads((out / "history" / first["study"] / "results.json").read_text())
    assert kept["trials"] == json.loads(json.dumps(first["trials"]))
    assert (out / "history" / first["study"] / "best" / "model.safetensors").exists()
    wc = second["what_changed"]
    assert wc["previous_study"] == first["study"] and wc["previous_best"] == first["best"]
    assert wc["experts"] == [{"name": "rev", "change": "changed", "old": {"content_hash": old_hash, "version": 1},
                              "new": {"content_hash": new_hash, "version": 2}}]

    def best_row(summary, cap):
        return next(c for c in summary["matrix"]["test"] if c["candidate"] == summary["best"] and c["capability"] == cap)

    for row in wc["capabilities"]:
        for side, summary in (("previous", first), ("new", second)):
            cell = best_row(summary, row["capability"])
            assert (row[side]["score"], row[side]["retention"]) == (cell["score"], cell["retention"])
    assert [r["capability"] for r in wc["capabilities"]] == ["add", "rev"]
    report = (out / "report.md").read_text().splitlines()
    # the headline (the answer) first, then what changed since the previous study
    assert report[:3] == ["# Merge report: t", "", "## Headline"]
    assert report.index("## What changed") < report.index("## Final candidates")
    assert f"| rev | changed | `{old_hash}` (v1) | `{new_hash}` (v2) |" in report
    assert "<h2>What changed</h2>" in (out / "report.html").read_text()

    # --resume of the same inputs: the same study, nothing scored again, what changed still known
    scored.clear()
    again = run_recipe(load_recipe(path), resume=True, live=False, log=lambda *a: None)
    assert again["study"] == second["study"] and again["what_changed"] == wc
    assert scored == []
    # the same study's time adds up over invocations; a new study (new inputs) starts from zero
    assert second["total_seconds"] == second["seconds"]
    assert again["total_seconds"] == pytest.approx(second["seconds"] + again["seconds"])


def test_warm_params_keep_only_what_the_recipe_still_searches(tmp_path):
    lab = build_fake_lab(tmp_path / "lab")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out"))  # ties, linear
    prev = {
        "final": {"#3 ties": {"trial": 3, "candidate": {"strategy": "ties"}},
                  "#5 dare_ties": {"trial": 5, "candidate": {"strategy": "dare_ties"}},  # strategy gone
                  "#7 linear": {"trial": 7, "candidate": {"strategy": "linear"}},
                  "#3 again": {"trial": 3, "candidate": {"strategy": "ties"}}},
        "trials": [
            {"number": 3, "params": {"strategy[ties|linear]": "ties", "ties.density.add": 0.5,
                                     "ties.density.rev": 0.1,  # below the recipe's [0.3, 1.0]: redrawn
                                     "ties.weight.add": 0.7, "ties.weight.gone": 0.7}},  # expert gone
            {"number": 5, "params": {"strategy": "dare_ties", "dare_ties.density.add": 0.5}},
            {"number": 7, "params": {"strategy": "linear", "linear.weight.add": 0.4, "linear.weight.rev": 0.9}}],
    }
    assert warm_params(prev, recipe, ["add", "rev"], limit=5) == [
        (3, {"ties.density.add": 0.5, "ties.weight.add": 0.7, "strategy": "ties"}),
        (7, {"linear.weight.add": 0.4, "linear.weight.rev": 0.9, "strategy": "linear"}),
    ]
    assert len(warm_params(prev, recipe, ["add", "rev"], limit=1)) == 1
