"""Any lm-eval task as a capability: a task YAML over local JSONL (the BYO test bed), its primary
metric and stderr, the hash val/test split, chat templates, the rg: adapter's prompts and stops,
bad input refused at recipe load, and the scoring backends' arguments."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch

from opd.capabilities import get_capability
from opd.errors import OpdError

# A chat template in the char tokenizer's alphabet: "[s]...[u]...>" (generation prompt ">").
CHAT = ("{% for m in messages %}[{{ m['role'][0] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture(scope="module", autouse=True)
def _unregister():
    """Leave the capability registry as this module found it: later tests list opd's own capabilities."""
    from opd.capabilities import _REGISTRY

    before = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(before)


@pytest.fixture(scope="module")
def byo(tmp_path_factory):
    """The BYO path at a tiny size: a pico base, the GSM8K-format task, two experts fine-tuned with
    plain transformers Trainer (no manifest). About 15 s."""
    from opd.capabilities.lm_eval_task import resolve_tasks
    from opd.lab.byo import make_byo
    from opd.lab.pico import build_trained_pico

    root = tmp_path_factory.mktemp("byo")
    base = build_trained_pico(root / "base", "sort", steps=60)
    out = make_byo(base, root / "out", n_train=400, n_test=200, steps=250, seed=0)
    resolve_tasks(["byo_arith"], out["include_path"])
    return {"base": base, **out}


def _model(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_byo_experts_are_plain_hf_dirs(byo):
    for e in byo["experts"].values():
        p = Path(e["path"])
        assert (p / "config.json").is_file() and (p / "tokenizer.json").is_file()
        assert not (p / "manifest.json").exists()


def test_task_resolves_with_primary_metric_and_hash_split(byo):
    cap = get_capability("byo_arith")
    assert cap.lm_eval and cap.verifiable and cap.chat
    assert (cap.info.metric, cap.info.filter) == ("exact_match", "strict-match")  # "metric,filter" key
    assert "hash split" in cap.split_rule and "'test'" in cap.split_rule
    val, test = (cap.eval_task(s)[1] for s in ("val", "test"))
    assert val and test and not set(val) & set(test)
    assert sorted(val + test) == list(range(len(cap.eval_task("val")[0].eval_docs)))  # a partition
    # deterministic: the same buckets after the task is loaded again
    from opd.capabilities import lm_eval_task

    lm_eval_task._LOADED.clear()
    assert cap.eval_task("val")[1] == val
    # training prompts come from the training split, never from val/test docs
    train = {it.prompt for it in cap.items("train", 100, seed=1)}
    held = {it.prompt for s in ("val", "test") for it in cap.items(s, 500)}
    assert train and not train & held


def test_verify_runs_the_tasks_filter_and_metric(byo):
    cap = get_capability("byo_arith")
    it = cap.items("val", 1)[0]
    doc = cap.doc(it.answer)
    assert cap.verify(" " + doc["answer"], it.answer) == 1.0  # "a+b=c #### c": regex, then exact_match
    assert cap.verify(doc["answer"].split("####")[0], it.answer) == 0.0  # no "####": the strict filter fails
    assert cap.verify("1+1=2 #### 99999", it.answer) == 0.0


def _generations(model, tok, cap, split):
    """Greedy answers to the split's docs, generated here, in the order lm-eval scores them."""
    task, indices = cap.eval_task(split)
    docs = list(task.eval_docs)
    out = []
    for i in indices:
        prompt = cap.render(task.doc_to_text(docs[i]), tok)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=cap.max_new_tokens, do_sample=False)
        out.append((tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0],
                    docs[i]))
    return out


def test_evaluate_scores_the_primary_metric_with_stderr(byo):
    from opd.capabilities.lm_eval_task import doc_key
    from opd.evaluation.api import evaluate

    model, tok = _model(byo["experts"]["arith"]["path"])
    cap = get_capability("byo_arith")
    scores = evaluate(model, tok, ["byo_arith", "sort"], "val", use_cache=False)
    s = scores["byo_arith"]
    assert s.n == len(cap.eval_task("val")[1]) and "hash split" in s.split_rule
    # the same number as the task's own verifier over answers generated here
    with torch.no_grad():
        mine = [cap.verify(text, doc_key(doc)) for text, doc in _generations(model, tok, cap, "val")]
    assert s.score == pytest.approx(sum(mine) / len(mine))
    assert 0 < s.score and math.isfinite(s.stderr) and s.stderr > 0  # the fine-tune learnt some of it
    assert scores["sort"].split_rule == "" and scores["sort"].n == 200  # opd's own task, as before
    # the test split is the other hash half; limit cuts it
    t = evaluate(model, tok, ["byo_arith"], "test", limit=7, use_cache=False)["byo_arith"]
    assert t.n == 7
    base_model, _ = _model(byo["base"])
    assert evaluate(base_model, tok, ["byo_arith"], "val", use_cache=False)["byo_arith"].score < s.score


def test_evaluate_caches_lm_eval_task_scores(byo, tmp_path, monkeypatch):
    from opd.evaluation import api

    monkeypatch.setenv("OPD_CACHE", str(tmp_path))
    model, tok = _model(byo["experts"]["arith"]["path"])
    first = api.evaluate(model, tok, ["byo_arith"], "val", limit=5)
    monkeypatch.setattr(api, "_run_lm_eval", lambda *a, **k: (_ for _ in ()).throw(AssertionError("not cached")))
    assert api.evaluate(model, tok, ["byo_arith"], "val", limit=5) == first


@pytest.fixture
def captured(monkeypatch):
    """lm-eval's HF generate_until replaced by a recorder: the (context, gen_kwargs) it was asked for."""
    from lm_eval.models.huggingface import HFLM

    seen = []

    def record(self, requests, disable_tqdm=False):
        seen.extend(r.args for r in requests)
        return ["" for _ in requests]

    monkeypatch.setattr(HFLM, "generate_until", record)
    return seen


def _chat_tok(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT
    return tok


def test_chat_template_applied_as_lm_eval_does(byo, captured):
    """With a chat template, lm-eval's contexts are chat-rendered (apply_chat_template) and training
    renders the same text; opd's own tasks stay raw."""
    from opd.evaluation.api import evaluate

    model, _ = _model(byo["experts"]["arith"]["path"])
    tok = _chat_tok(byo["experts"]["arith"]["path"])
    cap = get_capability("byo_arith")
    evaluate(model, tok, ["byo_arith", "sort"], "val", limit=3, use_cache=False)
    contexts = [c for c, _ in captured]
    chat = [c for c in contexts if c.startswith("[u]q: ")]
    assert len(chat) == 3 and all(c.endswith("\na:>") for c in chat)
    assert {cap.render(c[3:-1], tok) for c in chat} == set(chat)  # training's prompt == lm-eval's context
    assert len([c for c in contexts if not c.startswith("[")]) == 3  # sort: no template


def test_rg_prompts_instruction_chat_and_stop(captured, tmp_path):
    """rg:: reasoning-gym's <answer> instruction as the system turn, the same text in training and in
    lm-eval, and generation stopping at eos only (no "\\n"), as training does."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from opd.capabilities import Item, prompt_texts
    from opd.evaluation.api import evaluate
    from opd.evaluation.heldout import heldout_items
    from opd.lab.pico import build_trained_pico

    base = build_trained_pico(tmp_path / "m", "count", steps=1)
    model, plain = _model(base)
    plain.chat_template = None
    cap = get_capability("rg:basic_arithmetic")
    items = heldout_items("rg:basic_arithmetic", "val", 2)
    for tok in (plain, _chat_tok(base)):
        captured.clear()
        evaluate(model, tok, ["rg:basic_arithmetic"], "val", limit=2, use_cache=False)
        want = prompt_texts([Item(cap.name, it["prompt"], it["answer"]) for it in items], tok)
        assert [c for c, _ in captured] == want
        assert all(SYSTEM_PROMPTS["default"] in c for c in want)
        # no "\n" stop: only the eos, which HFLM.generate_until always adds (handle_stop_sequences)
        assert all(kw["until"] == [] for _, kw in captured)
    assert want[0].startswith("[s]" + SYSTEM_PROMPTS["default"] + "[u]") and want[0].endswith(">")
    assert cap.verify("x <answer>" + items[0]["answer"] + "</answer>", items[0]["answer"]) == 1.0


def _recipe(tmp_path, body: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text("name: x\nexperts: [add]\nstrategies: {linear: {weight: 1.0}}\n" + body)
    return p


def _task_dir(tmp_path, name: str, metric_list: str) -> Path:
    d = tmp_path / "tasks"
    d.mkdir(exist_ok=True)
    (d / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: /nonexistent.jsonl}}}}\n"
        f"test_split: test\noutput_type: generate_until\ndoc_to_text: q\ndoc_to_target: a\n{metric_list}")
    return d


@pytest.mark.parametrize("metric_list, why", [
    ("metric_list: []\n", "no usable metric"),
    ("metric_list: [{metric: bypass, aggregation: bypass}]\n", "not numeric"),
    ("metric_list: [{metric: perplexity, higher_is_better: false}]\n", "lower-is-better"),
])
def test_task_without_usable_metric_refused_at_load(tmp_path, metric_list, why):
    from opd.merge.recipe import load_recipe

    d = _task_dir(tmp_path, "bad_task", metric_list)
    with pytest.raises(OpdError, match=why) as e:
        load_recipe(_recipe(tmp_path, f"tasks: [bad_task]\ninclude_path: {d}\n"))
    assert "\n" not in str(e.value) and "r.yaml" in str(e.value) and "bad_task" in str(e.value)


def test_unknown_task_and_bad_fields_refused(tmp_path, monkeypatch):
    from opd.capabilities import lm_eval_task
    from opd.merge.recipe import load_recipe

    d = _task_dir(tmp_path, "ok_task", "")
    # never index the ~15,000 stock tasks in this test: an unknown name is looked up in an empty index
    real = lm_eval_task.task_manager
    monkeypatch.setattr(lm_eval_task, "task_manager", lambda p, include_defaults: real(p, False))
    with pytest.raises(OpdError, match=r"unknown task 'nope'.*include_path"):
        load_recipe(_recipe(tmp_path, f"tasks: [ok_task, nope]\ninclude_path: {d}\n"))
    with pytest.raises(OpdError, match="not both"):
        load_recipe(_recipe(tmp_path, "tasks: [add]\ncapabilities: [add]\n"))
    with pytest.raises(OpdError, match="not a directory"):
        load_recipe(_recipe(tmp_path, f"tasks: [ok_task]\ninclude_path: {tmp_path / 'missing'}\n"))
    r = load_recipe(_recipe(tmp_path, f"tasks: [ok_task, add]\ninclude_path: {d}\n"))
    assert r.tasks == ["ok_task", "add"] and get_capability("ok_task").info.metric == "exact_match"  # default
    assert load_recipe(_recipe(tmp_path, "capabilities: [add]\n")).capabilities == ["add"]  # the old name


def test_stock_task_resolved_by_the_index():
    """A stock name resolves through lm-eval's own index (no dataset is loaded: offline here)."""
    from opd.capabilities.lm_eval_task import task_info, task_manager

    info = task_info("gsm8k", None, task_manager(None, True))
    assert (info.metric, info.filter, info.include_defaults) == ("exact_match", "strict-match", True)
    assert info.test_split == "test" and info.training_split == "train"


# --- scoring backends -------------------------------------------------------------------------------

LM_EVAL = Path(__import__("lm_eval").__file__).parent


def _init_params(path: Path, cls: str) -> set[str]:
    """The named parameters of `cls.__init__` in lm-eval's installed source (read, not imported:
    importing it imports vllm / sglang)."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}


@pytest.mark.parametrize("backend, source, cls", [
    ("vllm", "vllm_causallms.py", "VLLM"), ("sglang", "sglang_causallms.py", "SGLangLM")])
def test_backend_arguments_match_lm_eval(backend, source, cls):
    from opd.evaluation.backends import model_args
    from opd.merge.recipe import Scoring

    scoring = Scoring.model_construct(backend=backend, dtype="bfloat16", tensor_parallel=2, memory_fraction=0.5,
                                      max_model_len=4096, batch_size="auto")
    args = model_args(scoring, "/m", seed=3)
    params = _init_params(LM_EVAL / "models" / source, cls)
    passthrough = {"gpu_memory_utilization"}  # VLLM's **kwargs, handed to vllm.LLM
    assert set(args) - passthrough <= params, set(args) - params
    assert args["pretrained"] == "/m" and args["dtype"] == "bfloat16"
    if backend == "vllm":
        assert (args["tensor_parallel_size"], args["gpu_memory_utilization"], args["seed"]) == (2, 0.5, 3)
    else:
        assert (args["tp_size"], args["mem_fraction_static"], args["device"]) == (2, 0.5, "cuda")


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_gpu_backends_refused_where_they_cannot_run(tmp_path, backend):
    import importlib.util

    from opd.merge.recipe import load_recipe

    if importlib.util.find_spec(backend) and torch.cuda.is_available():
        pytest.skip(f"{backend} can run here")
    with pytest.raises(OpdError, match=rf"scoring.backend '{backend}'.*use backend: hf") as e:
        load_recipe(_recipe(tmp_path, f"scoring: {{backend: {backend}}}\n"))
    assert "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_gpu_backend_scores_a_candidate(byo, backend):
    import importlib.util

    if not (importlib.util.find_spec(backend) and torch.cuda.is_available()):
        pytest.skip(f"{backend} needs its package and a CUDA GPU: neither is on this machine")
    from opd.evaluation.backends import evaluate_on_disk
    from opd.io import state_dict_hash
    from opd.merge.recipe import Scoring

    model, tok = _model(byo["experts"]["arith"]["path"])
    s = evaluate_on_disk(model, tok, Scoring(backend=backend), ["byo_arith"], "val", 20, state_dict_hash(model))
    assert s["byo_arith"].n == 20


def test_byo_recipe_runs_the_search(byo, tmp_path):
    """The whole BYO path: make_byo's experts (no manifest) merged by a byo.yaml-shaped recipe."""
    import yaml

    from opd.merge import load_recipe, run_recipe

    text = (Path(__file__).resolve().parents[1] / "merge_recipes" / "byo.yaml").read_text()
    raw = yaml.safe_load(text)
    raw.update(base=str(byo["base"]), include_path=byo["include_path"], out=str(tmp_path / "run"),
               experts=[{"path": e["path"], "tasks": e["tasks"]} for e in byo["experts"].values()],
               budget={"n_trials": 3}, final_candidates=2, screening={"limit": 10, "warmup": 3})
    # the shipped strategies at a CI size: a merge, and OPD with the fine-tunes as teachers routed by
    # their tasks (a warm start on samples the lm-eval task's own scorer keeps, then on-policy steps)
    raw["strategies"] = {"linear": raw["strategies"]["linear"],
                         "opd": {**raw["strategies"]["opd"], "warmstart_steps": 4, "warmstart_prompts": 16,
                                 "steps": 2}}
    raw["budget"]["per_strategy"] = {"opd": 1}
    raw["distill"] = {**raw["distill"], "prompts_per_step": 8, "eval_every": 2, "eval_limit": 10}
    p = tmp_path / "byo.yaml"
    p.write_text(yaml.safe_dump(raw))
    recipe = load_recipe(p)
    run_recipe(recipe, live=False, log=lambda *a: None)
    report = (tmp_path / "run" / "report.md").read_text()
    assert "byo_arith" in report and "hash split" in report
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert {t["candidate"]["strategy"] for t in results["trials"]} == {"linear", "opd"}


def test_multiple_choice_task_with_validation_and_test_splits(tmp_path):
    """A log-likelihood task with both splits: they are used as they are, lm-eval's default metric
    (acc) is the primary one, and there is no verifier."""
    import json

    from opd.capabilities.lm_eval_task import resolve_tasks
    from opd.evaluation.api import evaluate
    from opd.lab.pico import build_trained_pico

    d = tmp_path / "tasks"
    d.mkdir()
    for split, n in (("validation", 6), ("test", 9)):
        rows = [{"q": f"{i}+1=", "choices": [str(i + 1), str(i + 2)], "label": 0} for i in range(n)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "mc_add.yaml").write_text(
        f"task: mc_add\ndataset_path: json\ndataset_kwargs: {{data_files: {{validation: {tmp_path}/validation.jsonl, "
        f"test: {tmp_path}/test.jsonl}}}}\nvalidation_split: validation\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n")
    resolve_tasks(["mc_add"], str(d))
    cap = get_capability("mc_add")
    assert (cap.info.metric, cap.info.filter, cap.verifiable) == ("acc", "none", False)
    assert cap.split_rule == "val = its 'validation' split, test = its 'test' split"
    assert cap.verify("anything", cap.items("val", 1)[0].answer) == 0.0
    model, tok = _model(build_trained_pico(tmp_path / "m", "add", steps=1))
    val, test = (evaluate(model, tok, ["mc_add"], s, use_cache=False)["mc_add"] for s in ("val", "test"))
    assert (val.n, test.n) == (6, 9) and 0 <= val.score <= 1 and math.isfinite(test.stderr)


def test_report_says_which_tasks_were_hash_split(tmp_path):
    from types import SimpleNamespace

    from opd.evaluation.api import Score
    from opd.merge.interference import interference_matrix, to_records
    from opd.merge.report import write_report

    rows = {"#0 linear": {"byo_arith": 0.5, "sort": 0.6}, "base": {"byo_arith": 0.1, "sort": 0.1},
            "expert arith": {"byo_arith": 0.8, "sort": 0.1}, "expert sort": {"byo_arith": 0.1, "sort": 0.9}}
    scores = {r: {c: Score(v, 0.01, 100) for c, v in s.items()} for r, s in rows.items()}
    cells = interference_matrix(scores, {"byo_arith": 0.8, "sort": 0.9}, rows["base"], "test")
    cand = {"strategy": "linear", "shared": {}, "per_model": {}, "seed": 0}
    rule = "val/test = a sha256 hash split (50/50) of its 'test' docs"
    summary = {
        "inputs": {"base": {"path": "b", "content_hash": "h"},
                   "experts": {"arith": {"path": "a", "content_hash": "a", "capability": "byo_arith"},
                               "sort": {"path": "s", "content_hash": "s", "capability": "sort"}}},
        "objectives": ["min_retention"], "best": "#0 linear", "counted": ["byo_arith", "sort"],
        "trials": [{"number": 0, "stage": "full", "candidate": cand, "min_retention": 0.625,
                    "retention": {"byo_arith": 0.625, "sort": 0.667}}],
        "final": {"#0 linear": {"trial": 0, "candidate": cand, "label": "linear"}},
        "matrix": {"test": to_records(cells)}, "split_rules": {"byo_arith": rule},
    }
    write_report(SimpleNamespace(out_dir=tmp_path, name="t", verifier="capability"), summary, {"test": cells, "val": cells})
    assert f"Splits: `byo_arith`: {rule}." in (tmp_path / "report.md").read_text()
    assert "byo_arith</code>: val/test = a sha256 hash split" in (tmp_path / "report.html").read_text()


def test_search_scores_an_lm_eval_task_end_to_end(byo, tmp_path, monkeypatch):
    """The merge search on `tasks:` naming an include_path task and an opd capability (experts with
    manifests here): interference matrix, retention and report key on the lm-eval task's name."""
    import json

    import yaml

    from opd.lab.pico import build_fake_lab
    from opd.merge import load_recipe, run_recipe

    monkeypatch.setenv("OPD_CACHE", str(tmp_path / "cache"))
    lab = build_fake_lab(tmp_path / "lab", capabilities=("add", "sort"), base=byo["base"])
    doc = {"name": "t", "base": str(lab["base"]), "experts": [str(p) for p in lab["experts"].values()],
           "tasks": ["byo_arith", "sort"], "include_path": byo["include_path"],
           "strategies": {"linear": {"weight": [0.2, 1.0]}}, "budget": {"n_trials": 2}, "sampler": "random",
           "out": str(tmp_path / "out"), "screening": {"limit": 4, "margin": 0.5, "warmup": 1},
           "final_candidates": 1, "eval_batch_size": 64}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(doc))
    run_recipe(load_recipe(tmp_path / "r.yaml"), live=False, log=lambda *a: None)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {c["capability"] for c in results["matrix"]["test"]} == {"byo_arith", "sort"}
    assert list(results["split_rules"]) == ["byo_arith"]
    assert "hash split" in (tmp_path / "out" / "report.md").read_text()


def test_on_disk_scoring_scores_the_written_candidate_once(byo, tmp_path, monkeypatch):
    """The vllm / sglang path on CPU, with lm-eval's HF model type standing in for the engine: the
    candidate written to disk scores as the in-process model does, and a cached score starts no engine."""
    from lm_eval.models.huggingface import HFLM

    from opd.evaluation import backends
    from opd.evaluation.api import evaluate
    from opd.io import state_dict_hash
    from opd.merge.recipe import Scoring

    monkeypatch.setenv("OPD_CACHE", str(tmp_path / "cache"))
    started = []

    def engine(scoring, path, seed=0):
        started.append(scoring.backend)
        m, t = _model(path)
        return HFLM(pretrained=m, tokenizer=t, batch_size=64, device="cpu")

    monkeypatch.setattr(backends, "make_lm", engine)
    model, tok = _model(byo["experts"]["arith"]["path"])
    scoring = Scoring.model_construct(backend="vllm")
    on_disk = backends.evaluate_on_disk(model, tok, scoring, ["byo_arith"], "val", 12, state_dict_hash(model))
    assert started == ["vllm"]
    assert on_disk == evaluate(model, tok, ["byo_arith"], "val", limit=12, use_cache=False)
    backends.evaluate_on_disk(model, tok, scoring, ["byo_arith"], "val", 12, state_dict_hash(model))
    assert started == ["vllm"]  # cached: no second engine
