"""Bring your own experts: fine-tunes without an opd manifest, checked against the base before any
weights load, hashed once (cached), merged and re-merged by content hash, routed by their tasks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from test_merge_fakes import PICO, build_fake_lab, write_recipe

import opd.model_inputs as mi
from opd.errors import OpdError
from opd.io import state_dict_hash
from opd.merge import load_recipe, run_recipe
from opd.merge.history import inputs_key


def byo_lab(root, caps=("add", "rev")) -> dict:
    """A pico base and experts saved with save_pretrained and the char tokenizer, with no manifest."""
    lab = build_fake_lab(root, caps)
    for d in lab["experts"].values():
        (d / "manifest.json").unlink()
    (lab["base"] / "manifest.json").unlink()
    return lab


def byo_recipe(path, lab, out, experts=None, **fields):
    experts = experts or [{"path": str(p), "tasks": [c]} for c, p in lab["experts"].items()]
    return write_recipe(path, lab, out, experts=experts, **fields)


@pytest.fixture
def hashed(monkeypatch):
    """The directories whose weights were actually hashed (not answered by the cache)."""
    calls = []
    real = mi.stream_weights_hash

    def counting(header):
        calls.append(header.path.name)
        return real(header)

    monkeypatch.setattr(mi, "stream_weights_hash", counting)
    return calls


def test_byo_hash_is_the_loaded_models_and_is_cached(tmp_path, hashed):
    """A BYO expert's hash equals state_dict_hash of the model loaded in float32 (tied head included),
    is computed once per version of its files, and changes when its weights change."""
    from transformers import AutoModelForCausalLM

    lab = byo_lab(tmp_path / "lab")
    entries = [mi.ExpertEntry(path=str(p), tasks=[c]) for c, p in lab["experts"].items()]
    first = mi.open_experts(entries, lab["base"])
    for c, e in first.items():
        want = state_dict_hash(AutoModelForCausalLM.from_pretrained(e.path, dtype="float32"))
        assert e.record.content_hash == want and e.record.kind == "byo" and e.record.tasks == [c]
        assert e.record.capability == c and e.record.metrics == {} and e.record.base is None
        assert mi.expert_record(e.path) is e.record  # what RegMean and AdaMerging read
    assert sorted(hashed) == ["add", "rev"]
    again = mi.open_experts(entries, lab["base"])
    assert sorted(hashed) == ["add", "rev"]  # the cache answered
    assert {n: e.record.content_hash for n, e in again.items()} == {n: e.record.content_hash for n, e in first.items()}
    cache = json.loads((tmp_path / "opd-cache" / "content_hashes.json").read_text())
    assert f"weights:{lab['experts']['add'].resolve()}" in cache
    # a sharded checkpoint of the same weights: same names, shapes and hash
    model = AutoModelForCausalLM.from_pretrained(lab["experts"]["add"])
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / mi.INDEX).exists()
    h = mi.read_header(sharded, "x")
    assert len(h.files) > 1 and mi.stream_weights_hash(h) == first["add"].record.content_hash
    # an untied model hashes as its loaded state dict too
    from opd.lab.model import build_model
    from opd.lab.tokenizer import build_char_tokenizer

    untied = build_model(PICO, build_char_tokenizer(), seed=1)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone() + 1)
    untied.save_pretrained(tmp_path / "untied")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "untied", dtype="float32")
    assert mi.stream_weights_hash(mi.read_header(tmp_path / "untied", "x")) == state_dict_hash(loaded)


def test_hub_ids_come_from_declarations_the_hub_cache_or_name_or_path(tmp_path):
    lab = byo_lab(tmp_path / "lab")
    assert mi.hub_id(lab["base"]) is None  # transformers 5 writes no _name_or_path
    cfg = json.loads((lab["base"] / "config.json").read_text())
    (lab["base"] / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "org/base-model"}))
    assert mi.hub_id(lab["base"]) == "org/base-model"
    (lab["base"] / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "/home/me/ckpt/base"}))
    assert mi.hub_id(lab["base"]) is None
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc"
    shutil.copytree(lab["base"], snap)
    assert mi.hub_id(snap) == "Qwen/Qwen3-0.6B" and mi.hub_id(lab["base"], "me/x") == "me/x"


def test_search_over_byo_experts_keys_on_their_hashes_and_remerges_what_changed(tmp_path, monkeypatch, scored,
                                                                                 hashed):
    """Two BYO experts: the study is named by their hashes, the summary and model card carry them (Hub
    ids in base_model, local paths only in the body); after one expert's weights change, the rerun
    opens a new study, hashes and scores only the changed expert, and reports what changed."""
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OPD_CACHE", str(tmp_path / "cache"))
    lab = byo_lab(tmp_path / "lab")
    cfg = json.loads((lab["base"] / "config.json").read_text())
    (lab["base"] / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "org/base-model"}))
    experts = [{"path": str(lab["experts"]["add"]), "tasks": ["add"]},
               {"path": str(lab["experts"]["rev"]), "tasks": ["rev"], "hub_id": "org/ft-rev"}]
    path = byo_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", experts, budget={"n_trials": 3},
                      final_candidates=2)
    first = run_recipe(load_recipe(path), live=False, log=lambda *a: None)
    ex = first["inputs"]["experts"]
    hashes = {e: ex[e]["content_hash"] for e in ("add", "rev")}
    assert {e: ex[e]["kind"] for e in ex} == {"add": "byo", "rev": "byo"} and ex["add"]["tasks"] == ["add"]
    for e in ("add", "rev"):
        assert hashes[e] == state_dict_hash(AutoModelForCausalLM.from_pretrained(lab["experts"][e], dtype="float32"))
    assert first["study"] == f"t-{inputs_key(first['inputs']['base']['content_hash'], hashes)}"
    assert first["owners"] == {"add": "add", "rev": "rev"}
    assert sorted(hashed) == ["add", "rev"]

    card = ModelCard.load(tmp_path / "out" / "best" / "README.md")
    assert card.data.base_model == ["org/base-model", "org/ft-rev"] and card.data.library_name == "transformers"
    assert "merge" in card.data.tags and str(lab["experts"]["add"].resolve()) in card.text
    assert str(lab["base"].resolve()) in card.text and hashes["add"] in card.text
    manifest = json.loads((tmp_path / "out" / "best" / "manifest.json").read_text())
    assert manifest["inputs"]["experts"]["add"]["path"] == str(lab["experts"]["add"].resolve())

    first_calls = set(scored)
    scored.clear()
    hashed.clear()
    model = AutoModelForCausalLM.from_pretrained(lab["experts"]["rev"])
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.05)
    model.save_pretrained(lab["experts"]["rev"])
    new_rev = state_dict_hash(model)
    second = run_recipe(load_recipe(path), live=False, log=lambda *a: None)
    assert hashed == ["rev"]  # the unchanged expert's hash came from the cache
    assert second["study"] != first["study"]
    assert second["inputs"]["experts"]["rev"]["content_hash"] == new_rev
    assert second["inputs"]["experts"]["add"]["content_hash"] == hashes["add"]
    wc = second["what_changed"]
    assert [(e["name"], e["change"], e["old"]["content_hash"], e["new"]["content_hash"]) for e in wc["experts"]] \
        == [("rev", "changed", hashes["rev"], new_rev)]
    # the base and the unchanged expert come from the evaluation cache; only new models are scored
    models = {h for h, _, _ in scored}
    assert hashes["add"] not in models and first["inputs"]["base"]["content_hash"] not in models
    assert {(new_rev, "val", None), (new_rev, "test", None)} <= set(scored) and not set(scored) & first_calls
    assert (tmp_path / "out" / "history" / first["study"] / "results.json").exists()


def _boom(*a, **k):
    raise AssertionError("weights were loaded before the inputs were checked")


def _break(case: str, lab: dict, tmp_path) -> tuple[list, dict, str]:
    """Make input `case` bad; returns (experts, extra recipe fields, words the error must hold)."""
    from safetensors.torch import load_file, save_file

    from opd.lab.model import build_model
    from opd.lab.tokenizer import build_char_tokenizer

    add, rev = lab["experts"]["add"], lab["experts"]["rev"]
    good = [{"path": str(add), "tasks": ["add"]}, {"path": str(rev), "tasks": ["rev"]}]
    if case == "architecture":
        cfg = json.loads((add / "config.json").read_text())
        (add / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"],
                                                     "model_type": "llama"}))
        return good, {}, f"expert 'add' ({add.resolve()}) is a ['LlamaForCausalLM'] (llama)"
    if case == "shapes":
        build_model(PICO.model_copy(update={"intermediate_size": 48}), build_char_tokenizer(), 0).save_pretrained(add)
        return good, {}, f"expert 'add' ({add.resolve()}): tensors missing or shaped unlike the base"
    if case == "names":
        sd = load_file(add / "model.safetensors")
        sd.pop("model.norm.weight")
        save_file(sd, add / "model.safetensors", metadata={"format": "pt"})
        return good, {}, "missing ['model.norm.weight']"
    if case == "tokenizer":
        doc = json.loads((rev / "tokenizer.json").read_text())
        doc["model"]["vocab"]["@"] = len(doc["model"]["vocab"])
        (rev / "tokenizer.json").write_text(json.dumps(doc))
        return good, {}, f"tokenizer mismatch: expert 'rev' ({rev.resolve()}"
    if case == "empty tasks":
        return [{"path": str(add), "tasks": []}, good[1]], {}, "field 'experts.0.entry.tasks': List should have at least 1 item"
    if case == "task not scored":
        return good, {"capabilities": ["add"]}, "experts.1.tasks: 'rev' is not scored by this recipe"
    if case == "unknown task":
        return [good[0], {"path": str(rev), "tasks": ["nosuchtask"]}], {}, "experts.1.tasks"
    if case == "no tasks":
        return [{"path": str(add)}, good[1]], {}, "no opd manifest, so list the tasks it is an expert in"
    if case == "plain path without manifest":
        return [str(add), good[1]], {}, "has no opd manifest; list a model fine-tuned elsewhere as {path:"
    if case == "not a model directory":
        (tmp_path / "empty").mkdir()
        return [good[0], {"path": str(tmp_path / "empty"), "tasks": ["rev"]}], {}, \
            f"({(tmp_path / 'empty').resolve()}): not a model directory (no config.json in it)"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["architecture", "shapes", "names", "tokenizer", "empty tasks", "task not scored",
                                  "unknown task", "no tasks", "plain path without manifest", "not a model directory"])
def test_bad_byo_input_is_one_line_exit_2_before_any_weights_load(tmp_path, monkeypatch, capsys, case):
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    from opd.merge.__main__ import main

    lab = byo_lab(tmp_path / "lab")
    experts, fields, words = _break(case, lab, tmp_path)
    path = byo_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", experts, **fields)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", _boom)
    monkeypatch.setattr(safetensors.torch, "load_file", _boom)
    monkeypatch.setattr(mi, "stream_weights_hash", _boom)
    capsys.readouterr()  # the fixture's own output
    with pytest.raises(SystemExit) as e:
        main(["--recipe", str(path), "--no-live"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert words in err, err
    assert str(path) in err or str(lab["experts"]["add"].resolve()) in err or str(lab["experts"]["rev"].resolve()) in err
    assert not (tmp_path / "out").exists()  # nothing written


def test_cli_process_refuses_a_byo_expert_in_one_line(tmp_path):
    """The real command, `python -m opd.merge --recipe R`: exit code 2, one line, nothing written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    lab = byo_lab(tmp_path / "lab")
    experts, fields, words = _break("shapes", lab, tmp_path)
    path = byo_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", experts, **fields)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-m", "opd.merge", "--recipe", str(path), "--no-live"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_distillation_routes_prompts_by_byo_teachers_tasks(tmp_path):
    """A BYO teacher listing two tasks serves both; a task two teachers list is split between them.
    The student's card names no local path in base_model."""
    from huggingface_hub import ModelCard

    from opd.distill.config import load_run
    from opd.distill.run import run_distill

    lab = byo_lab(tmp_path / "lab", ("count", "rev"))
    run = {"name": "r", "base": str(lab["base"]), "out": str(tmp_path / "out"),
           "teachers": [{"path": str(lab["experts"]["count"]), "tasks": ["count", "rev"]},
                        {"path": str(lab["experts"]["rev"]), "tasks": ["rev"], "name": "rev-ft"}],
           "distill": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    m = run_distill(load_run(tmp_path / "run.yaml"), log=lambda *a: None, evaluate=False)
    assert m["routes"] == {"count": {"count": 1.0}, "rev": {"count": 0.5, "rev-ft": 0.5}}
    t = m["inputs"]["teachers"]
    assert t["count"]["tasks"] == ["count", "rev"] and t["rev-ft"]["kind"] == "byo" and t["rev-ft"]["content_hash"]
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.base_model is None and "distillation" in card.data.tags
    assert str(lab["experts"]["count"].resolve()) in card.text
    # a bad teacher is refused before any weights load, naming its directory
    bad = {**run, "teachers": [{"path": str(lab["experts"]["count"])}]}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(OpdError, match="teacher 'count' .*no opd manifest, so list the tasks"):
        run_distill(load_run(tmp_path / "bad.yaml"), log=lambda *a: None, evaluate=False)


def test_search_opd_strategy_routes_by_byo_tasks(tmp_path, monkeypatch):
    """Inside the merge search, the OPD strategies' teachers are the recipe's experts, routed by tasks."""
    from opd.distill.config import DistillConfig
    from opd.merge.recipe import load_inputs
    from opd.merge.strategies import distill as strategies
    from opd.weights.merge import Candidate

    lab = byo_lab(tmp_path / "lab")
    experts = [{"path": str(lab["experts"]["add"]), "tasks": ["add", "rev"]},
               {"path": str(lab["experts"]["rev"]), "tasks": ["rev"]}]
    inputs = load_inputs(load_recipe(byo_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", experts)))
    assert inputs.capabilities == ["add", "rev"] and inputs.manifests["add"].tasks == ["add", "rev"]
    seen = {}
    import opd.distill.student as student_module

    real = student_module.distill

    def recording(cfg, student, tokenizer, teachers, routes, *a, **k):
        seen["routes"] = routes
        return real(cfg, student, tokenizer, teachers, routes, *a, **k)

    monkeypatch.setattr(student_module, "distill", recording)
    cand = Candidate(strategy="opd", shared={"steps": 1, "prompts_per_step": 2, "group_size": 2})
    strategies.opd_student(inputs, cand, DistillConfig(max_new_tokens=4), "t", inputs.base_sd, tmp_path / "trial")
    assert seen["routes"] == {"add": {"add": 1.0}, "rev": {"add": 0.5, "rev": 0.5}}
