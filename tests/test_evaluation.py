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

from opd.capabilities import get_capability, list_capabilities
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
    # opd's own capabilities: not rg: ones, nor lm-eval tasks another test's recipe registered
    caps = [c for c in list_capabilities()
            if not c.startswith("rg:") and not getattr(get_capability(c), "lm_eval", False)]
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


def test_tasks_built_once_and_each_model_scored_on_its_own(trained_pico_dir, pico_model, monkeypatch):
    """opd reuses its lm-eval task objects across evaluations (built once per process). Model A (the
    trained pico), then B (an untrained one), then A again on the same task objects: each gets its own
    score and its own generations, the same as simple_evaluate on tasks built for that call alone.
    Any rank scores."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained_pico_dir)
    a, b = AutoModelForCausalLM.from_pretrained(trained_pico_dir), pico_model

    def ours(model):
        score = api.evaluate(model, tok, ["count"], "val", limit=60, batch_size=16, use_cache=False)["count"].score
        task = api.lm_eval_tasks(["count"], "val")["opd_count_val"]
        return score, {i.doc_id: i.filtered_resps["none"] for i in task.instances}

    def fresh(model):
        out = lm_eval.simple_evaluate(
            model=HFLM(pretrained=model, tokenizer=tok, batch_size=16, device="cpu"), tasks=["opd_count_val"],
            limit=60, task_manager=TaskManager(include_path=str(REPO_EVALS), include_defaults=False))
        return (out["results"]["opd_count_val"]["score,none"],
                {d["doc_id"]: d["filtered_resps"][0] for d in out["samples"]["opd_count_val"]})

    task = api.lm_eval_tasks(["count"], "val")["opd_count_val"]
    assert isinstance(task.eval_docs, list)  # the rows of its datasets.Dataset, kept as a list
    first_a = ours(a)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a distributed trainer's other rank scores its own copy too
    got_b = ours(b)
    monkeypatch.delenv("LOCAL_RANK")
    assert ours(a) == first_a and len(first_a[1]) == 60
    assert got_b[0] != first_a[0] and got_b[1] != first_a[1]
    assert api.lm_eval_tasks(["count"], "val")["opd_count_val"] is task  # reused, not rebuilt
    assert first_a == fresh(a) and got_b == fresh(b)


def test_requests_are_the_heldout_prompts_verbatim():
    """The task YAMLs name columns (doc_to_text: prompt): each request is the held-out prompt as is,
    what the former Jinja template "{{prompt}}" rendered, and the target is the answer."""
    for c in ("sort", "add"):
        task = api.lm_eval_tasks([c], "val")[f"opd_{c}_val"]
        task.build_all_requests()
        items = heldout_items(c, "val")
        assert [i.args[0] for i in task.instances] == [d["prompt"] for d in items]
        assert [task.doc_to_target(i.doc) for i in task.instances] == [d["answer"] for d in items]


def test_capability_registered_anew_gets_its_task_rebuilt(monkeypatch):
    from dataclasses import replace

    from opd import capabilities

    first = api.lm_eval_tasks(["count"], "val")["opd_count_val"]
    assert api.lm_eval_tasks(["count"], "val")["opd_count_val"] is first
    monkeypatch.setitem(capabilities._REGISTRY, "count", replace(capabilities.get_capability("count")))
    assert api.lm_eval_tasks(["count"], "val")["opd_count_val"] is not first


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


def test_uncached_scoring_hashes_nothing_and_leaves_the_model_trainable(pico_model, tokenizer, monkeypatch):
    """use_cache=False has no cache key to make: the weights are not hashed. The run is under
    torch.inference_mode: nothing of it may stay on the model and break a later backward."""
    monkeypatch.setattr(api, "state_dict_hash", lambda m: (_ for _ in ()).throw(AssertionError("hashed")))
    api.evaluate(pico_model, tokenizer, ["count"], "val", limit=8, batch_size=8, use_cache=False)
    with pytest.raises(AssertionError, match="hashed"):
        api.evaluate(pico_model, tokenizer, ["count"], "val", limit=8, batch_size=8)
    assert pico_model.training  # build_model's mode, given back
    ids = torch.tensor([tokenizer.encode("12+34=46")])
    pico_model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in pico_model.parameters() if p.requires_grad)
