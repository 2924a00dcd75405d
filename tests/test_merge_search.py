"""The merge search end to end on pico experts: outputs, report in a browser, resume, refusals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from conftest import skip_missing
from test_merge_fakes import PICO, build_fake_lab, write_recipe

from opd.errors import OpdError
from opd.merge import load_recipe, run_recipe
from opd.merge.interference import pareto_front, retention
from opd.merge.trials import read

CHROMIUM = "/usr/bin/chromium"
REPO = Path(__file__).resolve().parents[1]
SEARCH_LOG: list[str] = []  # what the shared search below logged (it runs without the live display)


def test_retention_and_pareto_by_hand():
    assert retention(0.3, 0.6) == 0.5
    assert retention(0.2, 0.0) == 1.0  # an expert scoring 0 leaves nothing to lose
    # 1 dominates 3 (0.9>=0.5, 0.8>=0.7); 0 and 1 and 2 trade off against each other.
    assert pareto_front({0: [1.0, 0.1], 1: [0.9, 0.8], 2: [0.2, 0.9], 3: [0.5, 0.7]}) == [0, 1, 2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One small search (4 trials, 2 strategies, ties' density searched per layer group) shared by the
    output checks."""
    tmp = tmp_path_factory.mktemp("search")
    os.environ["OPD_CACHE"] = str(tmp / "cache")
    lab = build_fake_lab(tmp / "lab")
    strategies = {"ties": {"density": {"range": [0.3, 1.0], "layer_groups": 2}, "weight": [0.5, 1.0]},
                  "linear": {"weight": [0.2, 1.0]}}
    recipe = load_recipe(write_recipe(tmp / "r.yaml", lab, tmp / "out", strategies=strategies))
    torch.set_num_threads(1)
    return recipe, run_recipe(recipe, live=False, log=SEARCH_LOG.append)


def test_search_without_the_live_display_logs_a_line_per_trial(run):
    """--no-live (or a log file) still shows progress: one plain line per finished trial, in order,
    with its strategy, its min retention on val and its minutes."""
    recipe, _ = run
    lines = [line for line in SEARCH_LOG if line.startswith("trial ")]
    n = recipe.budget.n_trials
    assert len(lines) == n
    for i, line in enumerate(lines, 1):
        assert line.startswith(f"trial {i}/{n} (#"), line
        assert any(f" {s}): " in line for s in recipe.strategies), line
        assert " min" in line and "val" in line, line


def test_results_json_is_the_typed_summary(run):
    """results.json is opd.merge.summary.SearchSummary as JSON: the keys the report, `opd report`, the
    history and the lab's tables read (what run_recipe returns, too); it reads back into the model
    unchanged, and the model refuses a key it does not know."""
    from pydantic import ValidationError

    from opd.merge.summary import SearchSummary

    recipe, summary = run
    on_disk = json.loads((recipe.out_dir / "results.json").read_text())
    assert set(on_disk) == {"recipe", "study", "inputs", "objectives", "counted", "owners", "split_rules", "trials",
                            "final", "best", "matrix", "scorer_calls", "stages", "weightspace", "best_model",
                            "seconds", "total_seconds"}  # no what_changed: no earlier study
    assert json.dumps(summary, sort_keys=True) == json.dumps(on_disk, sort_keys=True)
    typed = SearchSummary.model_validate(on_disk)
    assert json.dumps(typed.to_json(), sort_keys=True) == json.dumps(on_disk, sort_keys=True)
    assert set(next(iter(on_disk["inputs"]["experts"].values()))) == {"path", "content_hash", "version", "capability",
                                                                     "tasks", "kind", "hub_id"}
    assert set(next(iter(on_disk["final"].values()))) == {"trial", "candidate", "label"}
    with pytest.raises(ValidationError):
        SearchSummary.model_validate({**on_disk, "unknown": 1})


def test_export_rebuilds_a_trial_with_mergekits_run_merge(run, capsys):
    """`python -m opd.merge export <run> <trial>`: the YAML, and the model run_merge builds from it,
    equal to the search's merge (also for a layer-wise trial: its density is a mergekit gradient);
    an unknown trial is one line and exit code 2, nothing written."""
    import yaml
    from safetensors.torch import load_file

    from opd.merge.__main__ import main
    from opd.merge.export import export_trial

    recipe, summary = run
    trial = next(t for t in summary["trials"] if t["candidate"]["strategy"] == "ties")
    out = export_trial(recipe.out_dir, trial["number"], log=lambda *a: None)
    assert (out / "mergekit.yaml").exists() and load_file(next(out.glob("*.safetensors")))
    m = json.loads((out / "manifest.json").read_text())
    assert m["kind"] == "export" and m["reproduced"]["max_abs_diff"] <= 1e-5 and m["reproduced"]["tensors"] > 0
    # one density per group: the embeddings' and the head's by filter, 2 gradient points for the blocks
    density = yaml.safe_load((out / "mergekit.yaml").read_text())["models"][1]["parameters"]["density"]
    assert density[0]["filter"] == "model.embed_tokens.weight" and len(density[-1]["value"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["export", str(recipe.out_dir), "999"])
    assert e.value.code == 2 and "trial 999: not a finished trial" in capsys.readouterr().err
    assert not (recipe.out_dir / "export" / "trial-999").exists()


def test_opd_report_renders_a_finished_run_again(run, capsys):
    """`opd report <run>`: report.md/html and the plots again from results.json, headline printed;
    a directory without results.json is one line and exit code 2."""
    from opd.cli import main

    recipe, summary = run
    for name in ("report.md", "report.html", "strategy_best.png"):
        (recipe.out_dir / name).unlink()
    assert main(["report", str(recipe.out_dir)]) == 0
    out = capsys.readouterr().out
    assert "Best candidate of every strategy" in out and "report.html" in out
    for name in ("report.md", "report.html", "strategy_best.png"):
        assert (recipe.out_dir / name).stat().st_size > 0, name
    with pytest.raises(SystemExit) as e:
        main(["report", str(recipe.out_dir / "opd")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "results.json: no such file" in err


def test_optuna_dashboard_reads_the_study(run):
    """`optuna-dashboard sqlite:///runs/merge/<name>/study.db` (docs/reports.md) serves the search's study: its
    WSGI app lists it with every finished trial."""
    from wsgiref.util import setup_testing_defaults

    from optuna_dashboard import wsgi

    recipe, summary = run
    app = wsgi(f"sqlite:///{recipe.out_dir / 'study.db'}")

    def get(path: str) -> dict:
        env, status = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}, []
        setup_testing_defaults(env)
        body = b"".join(app(env, lambda s, h, *a: status.append(s)))
        assert status[0].startswith("200"), (path, status)
        return json.loads(body)

    studies = get("/api/studies")["study_summaries"]
    assert [s["study_name"] for s in studies] == [summary["study"]]
    trials = get(f"/api/studies/{studies[0]['study_id']}")["trials"]
    assert sum(t["state"] == "Complete" for t in trials) == len(summary["trials"])


def test_search_writes_matrix_report_and_best_model(run):
    recipe, summary = run
    out = recipe.out_dir
    assert len(summary["trials"]) == 4 and summary["best"] in summary["final"]
    cells = summary["matrix"]["test"]
    assert {c["capability"] for c in cells} == {"add", "rev"}
    rows = {c["candidate"] for c in cells}
    assert {"base", "expert add", "expert rev"} <= rows
    assert {"score", "stderr", "retention", "delta_vs_base", "n"} <= set(cells[0])
    for name in ("report.md", "report.html", "retention_heatmap.png", "pareto_front.png", "strategy_best.png",
                 "search_history.png", "weightspace_cosine.png", "results.json"):
        assert (out / name).stat().st_size > 0, name
    ws = summary["weightspace"]  # 2 experts, one pair: task-vector cosine per layer group
    assert ws["experts"] == ["add", "rev"] and "## Weight-space interference" in (out / "report.md").read_text()
    best = out / "best"
    card = (best / "README.md").read_text()
    assert "mergekit-yaml" in card and "score (test)" in card and recipe.name in card
    front = yaml.safe_load(card.split("---\n")[1])  # the Hub's model-card front matter
    assert front["library_name"] == "transformers" and {"merge", "mergekit", "opd"} <= set(front["tags"])
    # base_model is for Hub ids (none here: every input is a local directory); local paths are in the body
    assert "base_model" not in front
    assert all(i["path"] in card for i in [summary["inputs"]["base"], *summary["inputs"]["experts"].values()])
    assert (best / "mergekit.yaml").exists() and (best / "model.safetensors").exists()
    manifest = json.loads((best / "manifest.json").read_text())
    assert manifest["inputs"]["base"]["content_hash"] and manifest["recipe"]["name"] == recipe.name


def test_best_model_reproduced_by_mergekit_yaml(run, tmp_path):
    import yaml
    from safetensors.torch import load_file

    from opd.weights.merge import run_mergekit

    recipe, _ = run
    best = recipe.out_dir / "best"
    seed = json.loads((best / "manifest.json").read_text())["candidate"]["seed"]
    run_mergekit(yaml.safe_load((best / "mergekit.yaml").read_text()), str(tmp_path / "again"), seed=seed)
    ours, theirs = load_file(best / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_report_renders_in_headless_chromium(run, tmp_path):
    if not Path(CHROMIUM).exists():
        skip_missing(f"{CHROMIUM} not installed (apt-get install chromium)")
    recipe, _ = run
    html_path = (recipe.out_dir / "report.html").resolve()
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'p'}"]
    # The check runs in the page: every <img> decoded (naturalWidth > 0) and the tables have cells.
    probe = tmp_path / "probe.html"
    probe.write_text(html_path.read_text().replace("</body>", """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.length >= 4 && imgs.every(i => i.complete && i.naturalWidth > 0);
  document.title = 'imgs=' + imgs.length + ' ok=' + ok + ' cells=' + document.querySelectorAll('table td').length;
});</script></body>"""))
    dom = subprocess.run(flags + ["--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=60).stdout
    assert "imgs=7 ok=true" in dom, dom[:300]  # 4 plots and 3 weight-space heatmaps
    assert "cells=0" not in dom and "<table" in dom and "data:image/png;base64," in dom


def test_incompatible_experts_are_refused_before_any_work(tmp_path):
    from transformers import AutoModelForCausalLM

    from opd.lab.model import build_model
    from opd.lab.tokenizer import build_char_tokenizer

    lab = build_fake_lab(tmp_path / "lab")
    recipe = write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out")
    add = lab["experts"]["add"]
    m = json.loads((add / "manifest.json").read_text())

    def expect(words):
        with pytest.raises(OpdError, match=words) as e:
            run_recipe(load_recipe(recipe), live=False)
        assert "\n" not in str(e.value)
        assert not (tmp_path / "out" / "study.db").exists()

    (add / "manifest.json").write_text(json.dumps({**m, "base": {**m["base"], "content_hash": "deadbeef"}}))
    expect("trained from base deadbeef")
    (add / "manifest.json").write_text(json.dumps(m))
    vocab = json.loads((add / "tokenizer.json").read_text())
    vocab["model"]["vocab"]["@"] = len(vocab["model"]["vocab"])
    (add / "tokenizer.json").write_text(json.dumps(vocab))
    expect("tokenizer mismatch: expert .add.")
    shutil.copy(lab["experts"]["rev"] / "tokenizer.json", add / "tokenizer.json")
    changed = AutoModelForCausalLM.from_pretrained(add)
    with torch.no_grad():
        changed.model.norm.weight.add_(0.5)
    changed.save_pretrained(add)
    expect("do not match its manifest's content_hash")
    build_model(PICO.model_copy(update={"intermediate_size": 48}), build_char_tokenizer(), 0).save_pretrained(add)
    expect("tensors missing or shaped unlike the base")
    cfg = json.loads((add / "config.json").read_text())
    (add / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    expect("weight merging needs one architecture")


def _complete(db: Path) -> list[tuple]:
    if not db.exists():
        return []
    try:
        with sqlite3.connect(db) as c:
            return c.execute("select number, datetime_start from trials where state='COMPLETE'").fetchall()
    except sqlite3.OperationalError:
        return []


def test_sigkilled_study_resumes_without_redoing_trials(tmp_path):
    lab = build_fake_lab(tmp_path / "lab")
    recipe_path = write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", budget={"n_trials": 8})
    db = tmp_path / "out" / "study.db"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "opd.merge", "--recipe", str(recipe_path), "--no-live"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while len(_complete(db)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = _complete(db)
    assert 2 <= len(before) < 8, "the study must be killed mid-way"
    with pytest.raises(OpdError, match="resume=True"):
        run_recipe(load_recipe(recipe_path), live=False)
    with pytest.raises(OpdError, match="made with other \\['strategies'\\]"):
        run_recipe(load_recipe(recipe_path, ["strategies.ties.density=[0.1, 0.2]"]), resume=True, live=False)
    # the same command again continues the killed study
    rerun = subprocess.run([sys.executable, "-m", "opd.merge", "--recipe", str(recipe_path), "--no-live"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    after = _complete(db)
    assert len(after) == 8
    assert set(before) <= set(after)  # same trial numbers, same start times: not re-run
    # --fresh deletes the study and starts over (a smaller budget here: new trials only)
    fresh = subprocess.run([sys.executable, "-m", "opd.merge", "--recipe", str(recipe_path), "--no-live", "--fresh",
                            "budget.n_trials=2"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    again = _complete(db)
    assert len(again) == 2 and not set(again) & set(after)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{db}")  # the one study: t-<inputs hash>
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states
    assert len(study.trials) <= 8 + 1  # at most the one trial the kill interrupted was redone
    params = [tuple(sorted(t.params.items())) for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(set(params)) == len(params)  # the resumed sampler does not replay earlier draws


class _StubScorer:
    """Scores each merge by a pseudo-random number fixed by its weights; records every call."""

    def __init__(self):
        self.calls = []

    def score(self, sd, split, limit=None, caps=None):
        import random

        from opd.evaluation.api import Score

        self.calls.append((split, limit))
        rng = random.Random(float(sd["model.layers.0.mlp.up_proj.weight"].sum()))
        return {c: Score(rng.random(), 0.01, limit or 200) for c in ("add", "rev")}


def test_cheap_first_promotes_only_promising_candidates(tmp_path):
    from opd.merge.recipe import load_inputs
    from opd.merge.references import References
    from opd.merge.search import run_search
    from opd.merge.study import open_study

    lab = build_fake_lab(tmp_path / "lab")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", budget={"n_trials": 12},
                                      screening={"limit": 5, "margin": 0.0, "warmup": 2}))
    inputs = load_inputs(recipe)
    refs = References(screen={"add": 1.0, "rev": 1.0}, val={"add": 1.0, "rev": 1.0})
    scorer = _StubScorer()
    study = open_study(recipe, 3, resume=False, worker=False)
    run_search(recipe, inputs, scorer, refs, study, live=False)
    trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    stages = [read(t).stage for t in trials]
    assert len(trials) == 12 and stages[:2] == ["full", "full"] and "screen" in stages
    assert scorer.calls.count(("val", 5)) == 12  # every candidate screened on 5 items
    assert scorer.calls.count(("val", None)) == stages.count("full")  # only promoted ones on the full split
    assert all(len(t.values) == 3 for t in trials)  # retention add, retention rev, min retention


@pytest.mark.slow
def test_bench_merge_candidate_paths_agree_on_fake_experts():
    """bench_merge_candidate on fake pico experts (no --base): the naive CLI path and opd's in-process
    path score one candidate alike, every generation included, at the bench's default batch size."""
    bench = REPO / "bench" / "bench_merge_candidate.py"
    out = subprocess.run([sys.executable, str(bench), "--candidates", "1", "--experts", "add"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("per candidate: ") and "threads 1;" in last, last
    assert "scores and generations identical: True" in last, last
