"""opd's lm-eval wiring: tasks score with the capability verifier, API == CLI, cache by hash."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lm_eval.api.model import LM

from opd.capabilities import list_capabilities
from opd.evaluation import api
from opd.evaluation.heldout import heldout_items
from opd.evaluation.tasks import REPO_EVALS, task_yaml, template_yaml, write_tasks


class Oracle(LM):
    """Answers from the held-out data itself: wrong=True answers wrongly on purpose."""

    def __init__(self, answers, wrong=False):
        super().__init__()
        self.answers, self.wrong = answers, wrong

    def generate_until(self, requests):
        return [("x" if self.wrong else self.answers[r.args[0]]) + "\n" for r in requests]

    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError


@pytest.mark.parametrize("wrong,expected", [(False, 1.0), (True, 0.0)])
def test_tasks_score_with_verifier(wrong, expected):
    import lm_eval
    from lm_eval.tasks import TaskManager

    answers = {d["prompt"]: d["answer"] for d in heldout_items("sort", "val")}
    out = lm_eval.simple_evaluate(model=Oracle(answers, wrong), tasks=["opd_sort_val"],
                                  task_manager=TaskManager(include_path=str(REPO_EVALS), include_defaults=False))
    assert out["results"]["opd_sort_val"]["score,none"] == expected


def test_shipped_evals_match_generator():
    caps = [c for c in list_capabilities() if not c.startswith("rg:")]
    assert (REPO_EVALS / "_opd_template.yaml").read_text() == template_yaml()
    for c in caps:
        for split in ("val", "test"):
            text = (REPO_EVALS / f"opd_{c}_{split}.yaml").read_text()
            assert text == task_yaml(c, split), "run scripts/gen_eval_tasks.py"
    shipped = {p.stem for p in REPO_EVALS.glob("opd_*.yaml")}
    assert shipped == {f"opd_{c}_{s}" for c in caps for s in ("val", "test")}


def test_every_shipped_eval_yaml_loads():
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    for p in REPO_EVALS.glob("*.yaml"):
        assert isinstance(yaml.load(p.read_text(), Loader=Loader), dict), p


def test_api_scores_and_caches(trained_pico_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    tok = AutoTokenizer.from_pretrained(trained_pico_dir)
    s = api.evaluate(model, tok, ["count", "rev"], "val", limit=50)
    assert s["count"].n == 50 and 0.05 < s["count"].score < 0.95
    assert s["count"].stderr > 0
    monkeypatch.setattr(api, "_run_lm_eval", lambda *a, **k: (_ for _ in ()).throw(AssertionError("not cached")))
    assert api.evaluate(model, tok, ["count", "rev"], "val", limit=50) == s
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # new weights, new hash: must re-score
    with pytest.raises(AssertionError, match="not cached"):
        api.evaluate(model, tok, ["count"], "val", limit=50)


def test_lm_eval_cli_equals_api(trained_pico_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    tok = AutoTokenizer.from_pretrained(trained_pico_dir)
    ours = api.evaluate(model, tok, ["count"], "test", use_cache=False)["count"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={trained_pico_dir},dtype=float32", "--device", "cpu", "--batch_size", "128",
         "--include_path", str(REPO_EVALS), "--tasks", "opd_count_test", "--output_path", str(tmp_path / "out")],
        check=True, env=env, capture_output=True, timeout=300)
    res = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert res["results"]["opd_count_test"]["score,none"] == pytest.approx(ours.score, abs=1e-9)
    assert 0 < ours.score < 1


def test_generated_tasks_for_other_capabilities(tmp_path):
    d = write_tasks(tmp_path / "tasks", ["rg:basic_arithmetic"])
    assert (d / "opd_rg_basic_arithmetic_val.yaml").exists()


def test_generated_tasks_are_written_once_into_the_cache():
    """Capabilities without shipped task YAMLs get one generated include dir per capability set, in
    the eval cache: the same dir every call (no temp dir left per evaluation)."""
    a = api._include_path(["rg:basic_arithmetic"])
    assert a == api._include_path(["rg:basic_arithmetic"]) and a.startswith(str(api.cache_dir().parent))
    assert (Path(a) / "opd_rg_basic_arithmetic_test.yaml").exists()
    assert api._include_path(["count"]) == str(REPO_EVALS)


def test_bad_split_is_user_error(pico_model, tokenizer):
    from opd.errors import OpdError

    with pytest.raises(OpdError, match="split 'train'"):
        api.evaluate(pico_model, tokenizer, ["add"], "train")
