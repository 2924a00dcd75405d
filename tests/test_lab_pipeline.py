"""The lab pipeline's parallel experts stage: bounded concurrency, per-expert logs, clear failures."""

from __future__ import annotations

import sys

import pytest

from opd.errors import OpdError
from opd.lab.pipeline import run_lab, run_parallel

# Each command marks itself running, records how many are running, then unmarks itself.
PROBE = """
import os, sys, time
d, name = sys.argv[1], sys.argv[2]
open(os.path.join(d, name + '.running'), 'w').close()
n = len([f for f in os.listdir(d) if f.endswith('.running')])
open(os.path.join(d, name + '.seen'), 'w').write(str(n))
time.sleep(0.5)
os.remove(os.path.join(d, name + '.running'))
print('trained', name)
"""


def test_run_parallel_bounds_concurrency_and_logs(tmp_path):
    names = ["a", "b", "c", "d"]
    run_parallel({n: [sys.executable, "-c", PROBE, str(tmp_path), n] for n in names}, 2, tmp_path / "logs")
    seen = [int((tmp_path / f"{n}.seen").read_text()) for n in names]
    assert max(seen) <= 2
    assert all((tmp_path / "logs" / f"{n}.log").read_text().strip() == f"trained {n}" for n in names)


def test_run_parallel_names_the_failed_runs(tmp_path):
    cmds = {"ok": [sys.executable, "-c", "print('fine')"],
            "bad": [sys.executable, "-c", "import sys; print('spec broken: steps must be > 0'); sys.exit(2)"]}
    with pytest.raises(OpdError, match=r"1 of 2 expert runs failed \(bad: spec broken: steps must be > 0\)"):
        run_parallel(cmds, 2, tmp_path / "logs")


STEPPER = """
import sys, time
for i in range(1, 4):
    print(f"step {i}: val 0.{i} (best 0.{i}@{i}) reward 0.5", flush=True)
    time.sleep(0.4)
"""


def test_run_parallel_prints_progress_lines_when_not_a_terminal(tmp_path, capsys):
    """Under CI or nohup (no terminal) the stage is not silent: every `every` seconds each running
    expert's last `step ...` line, and each finish."""
    run_parallel({n: [sys.executable, "-c", STEPPER] for n in ("add", "rev")}, 2, tmp_path / "logs", every=0.5)
    err = capsys.readouterr().err
    assert "add: running" in err and "| step " in err and "(best 0." in err
    assert "add: done" in err and "rev: done" in err


def test_unknown_stage_is_refused():
    with pytest.raises(OpdError, match="unknown stage"):
        run_lab("merge_recipes/lab.yaml", ["experts", "distil"])


RECIPE = """
name: tiny10
experts: [count, {out}/max]
strategies: {{linear: {{weight: 1.0}}}}
train: {{overrides: {{max_minutes: 0.5, gspo.lr: 0.001}}, jobs: {jobs}}}
"""


def _recipe(tmp_path, jobs=1):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(out=tmp_path / "lab10", jobs=jobs))
    return path


def test_experts_stage_applies_overrides_and_paths(tmp_path, monkeypatch):
    import opd.expert.run

    trained = []
    monkeypatch.setattr(opd.expert.run, "run_expert", lambda spec, out=None: trained.append((spec, out)))
    run_lab(str(_recipe(tmp_path)), ["experts"])
    assert [(s.capability, s.max_minutes, s.gspo.lr, s.steps) for s, _ in trained] == [
        ("count", 0.5, 0.001, 1000), ("max", 0.5, 0.001, 1000)]  # steps: from experts/<name>.yaml
    assert [out for _, out in trained] == [None, tmp_path / "lab10" / "max"]


def test_experts_stage_in_parallel_passes_the_same_to_each_process(tmp_path, monkeypatch):
    import opd.lab.pipeline as pipeline

    seen = {}
    monkeypatch.setattr(pipeline, "run_parallel", lambda cmds, jobs, log_dir: seen.update(cmds=cmds, jobs=jobs))
    run_lab(str(_recipe(tmp_path, jobs=2)), ["experts"])  # jobs from the recipe
    assert seen["jobs"] == 2
    count, mx = seen["cmds"]["count"], seen["cmds"]["max"]
    assert count[1:3] == ["-m", "opd.expert"] and count[3].endswith("experts/count.yaml")
    assert count[4:] == ["base=runs/base", "max_minutes=0.5", "gspo.lr=0.001"]  # the recipe's base first
    assert mx[-2:] == ["--out", str(tmp_path / "lab10" / "max")]
    run_lab(str(_recipe(tmp_path, jobs=2)), ["experts"], jobs=3)  # --jobs wins
    assert seen["jobs"] == 3


def test_expert_without_spec_and_bad_override_are_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("experts: [nosuch]\nstrategies: {linear: {weight: 1.0}}\n")
    with pytest.raises(OpdError, match=r"expert 'nosuch' has no spec .*experts/nosuch.yaml"):
        run_lab(str(path), ["experts"])
    path.write_text("experts: [count]\nstrategies: {linear: {weight: 1.0}}\n"
                    "train: {overrides: {gspo.lrr: 1}}\n")
    with pytest.raises(OpdError, match=r"r.yaml: field .train.overrides.: .*.gspo.lrr.: Extra inputs"):
        run_lab(str(path), ["experts"])


def test_base_stage_builds_the_recipes_base_and_experts_train_from_it(tmp_path, monkeypatch):
    """A BPE lab (merge_recipes/lab_bpe.yaml): `train.base` overrides the base spec for the base
    stage, which builds the recipe's `base`; every expert then starts from that base."""
    import opd.expert.run
    import opd.lab.run

    built, trained = [], []
    monkeypatch.setattr(opd.lab.run, "build_and_report", lambda out, overrides: built.append((out, overrides)))
    monkeypatch.setattr(opd.expert.run, "run_expert", lambda spec, out=None: trained.append(spec))
    path = tmp_path / "r.yaml"
    path.write_text("base: runs/base-bpe\nexperts: [count]\nstrategies: {linear: {weight: 1.0}}\n"
                    "train: {base: {tokenizer: bpe, bpe_vocab_size: 300}}\n")
    run_lab(str(path), ["base", "experts"], seed=3)
    assert built == [("runs/base-bpe", {"tokenizer": "bpe", "bpe_vocab_size": 300, "seed": 3})]
    assert [(s.base, s.seed) for s in trained] == [("runs/base-bpe", 3)]


def test_bad_base_override_is_refused_before_any_stage(tmp_path, monkeypatch):
    import opd.lab.run

    monkeypatch.setattr(opd.lab.run, "build_and_report", lambda **kw: pytest.fail("the base stage ran"))
    path = tmp_path / "r.yaml"
    path.write_text("experts: [count]\nstrategies: {linear: {weight: 1.0}}\ntrain: {base: {tokenzer: bpe}}\n")
    with pytest.raises(OpdError, match=r"r.yaml: field 'train.base': 'tokenzer': unknown field"):
        run_lab(str(path), ["base"])


def test_the_shipped_bpe_lab_recipe_builds_a_bpe_base():
    from opd.lab.base import load_base_spec
    from opd.lab.recipe import load_lab_recipe

    lab = load_lab_recipe("merge_recipes/lab_bpe.yaml")
    recipe = lab.merge
    assert recipe.base == "runs/base-bpe" and load_base_spec(**lab.train.base).tokenizer == "bpe"
    assert all(e.startswith("experts/bpe/") for e in recipe.experts)  # never the char lab's experts


def test_a_rerun_that_finds_the_base_up_to_date_keeps_its_minutes(tmp_path, monkeypatch):
    """lab_stages.json (the report's minutes per stage) holds the minutes of the invocation that built
    each stage: a no-op rerun wrote 'base 0.0' over the base's real minutes."""
    import json
    import time

    import opd.lab.run

    base = tmp_path / "runs" / "b"

    def build(out, overrides):
        if not (base / "manifest.json").exists():
            base.mkdir(parents=True, exist_ok=True)
            (base / "manifest.json").write_text("{}")
            time.sleep(0.05)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(opd.lab.run, "build_and_report", build)
    path = tmp_path / "r.yaml"
    path.write_text(f"name: t\nbase: {base}\nexperts: [count]\nstrategies: {{linear: {{weight: 1.0}}}}\n")
    run_lab(str(path), ["base"])
    stages = tmp_path / "runs" / "merge" / "t" / "lab_stages.json"
    first = json.loads(stages.read_text())["base"]
    assert first >= 0.05 / 60
    run_lab(str(path), ["base"])  # up to date: nothing rebuilt
    assert json.loads(stages.read_text())["base"] == first
    (base / "manifest.json").unlink()
    run_lab(str(path), ["base"])  # rebuilt: this invocation's minutes
    assert json.loads(stages.read_text())["base"] != first
