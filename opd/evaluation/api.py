"""Score an in-memory model on capabilities with lm-eval; results cached by model content hash."""

from __future__ import annotations

import functools
import json
import logging
import numbers
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from opd.capabilities import EVAL_SPLITS, get_capability
from opd.errors import OpdError
from opd.evaluation.heldout import SPLIT_SIZES
from opd.evaluation.tasks import (
    REPO_EVALS,
    TEMPLATE_NAME,
    UTILS_PY,
    task_name,
    task_yaml,
    template_yaml,
    write_tasks,
)
from opd.io import atomic_dir, atomic_write_json, state_dict_hash, text_hash

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
EVAL_VERSION = "1"  # bump when held-out data, prompts or metrics change: invalidates caches


@dataclass(frozen=True)
class Score:
    score: float
    stderr: float
    n: int
    # How val/test were made where the task did not give both ("" for opd's own tasks), for the report.
    split_rule: str = ""


def cache_dir() -> Path:
    return Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd")) / "evals"


def _include_path(capabilities: list[str]) -> str:
    if all((REPO_EVALS / f"{task_name(c, 'test')}.yaml").exists() for c in capabilities):
        return str(REPO_EVALS)
    # Capabilities without shipped YAMLs (e.g. reasoning-gym ones) get generated tasks, written once
    # per capability set into the eval cache (not a new temp dir per call, which nothing removed).

    content = template_yaml() + UTILS_PY + "".join(task_yaml(c, s) for c in sorted(capabilities) for s in EVAL_SPLITS)
    d = cache_dir().parent / "tasks" / text_hash(content)
    if not (d / TEMPLATE_NAME).exists():
        with atomic_dir(d) as tmp:
            write_tasks(tmp, capabilities)
    return str(d)


def evaluate(
    model,
    tokenizer,
    capabilities: list[str],
    split: str = "val",
    limit: int | None = None,
    batch_size: int = 128,
    use_cache: bool = True,
    model_hash: str | None = None,
    lm_factory=None,
) -> dict[str, Score]:
    """Score `model` on each capability's held-out `split` with lm-eval; returns {cap: Score}.

    `limit` scores only the first `limit` items (cheap-first screening). The cache key is the
    model's content hash, so the same weights are never scored twice on the same task.

    A capability that is an lm-eval task (opd.capabilities.lm_eval_task) runs that task on its
    val/test docs, scored on its primary metric. `lm_factory`: called (only when something is not
    cached) for the lm-eval model object to score with, instead of wrapping `model` in HFLM (the
    vLLM / SGLang backends, opd.evaluation.backends).
    """
    if split not in EVAL_SPLITS:
        raise OpdError(f"split {split!r}: evaluation uses one of {EVAL_SPLITS}")
    caps = {c: get_capability(c) for c in capabilities}
    # The content hash reads every weight; it is only the cache's key.
    key = (model_hash or state_dict_hash(model)) if use_cache else None
    results: dict[str, Score] = {}
    todo = []
    for c in capabilities:
        path = None
        if use_cache:
            path = cache_dir() / key / _cache_name(caps[c], tokenizer, split, limit)
            if path.exists():
                results[c] = Score(**json.loads(path.read_text()))
                continue
        todo.append((c, path))
    if todo:
        lm = lm_factory() if lm_factory is not None else None
        fresh = _run_lm_eval(model, tokenizer, [c for c, _ in todo], split, limit, batch_size, lm=lm)
        for c, path in todo:
            results[c] = fresh[c]
            if use_cache:
                atomic_write_json(path, asdict(fresh[c]))
    return {c: results[c] for c in capabilities}


def _chat(cap, tokenizer) -> bool:
    """Whether `cap` is scored with lm-eval's apply_chat_template: a chat capability (an lm-eval task,
    rg:) and a tokenizer with a template. opd's own compact tasks stay raw text."""
    return cap.chat and bool(getattr(tokenizer, "chat_template", None))


def _cache_name(cap, tokenizer, split: str, limit: int | None) -> str:
    # A chat-templated prompt depends on the tokenizer's template, which the weights' hash does not cover.
    chat = f"-c{text_hash(tokenizer.chat_template)[:8]}" if _chat(cap, tokenizer) else ""
    # rg: prompts gained an instruction and lost the "\n" stop: their own key, opd's tasks keep theirs
    if cap.instruction:
        chat += f"-i{text_hash(cap.instruction + repr(cap.until))[:8]}"
    if getattr(cap, "lm_eval", False):
        info = text_hash(json.dumps(asdict(cap.info), sort_keys=True))[:8]
        return f"lmeval-{cap.name.replace('/', '_')}-{info}-{split}-{limit or 'all'}{chat}-v{EVAL_VERSION}.json"
    return f"{task_name(cap.name, split)}-{limit or SPLIT_SIZES[split]}{chat}-v{EVAL_VERSION}.json"


# lm-eval Task objects, built once per process and reused by every evaluation: building one loads
# its held-out items into a datasets.Dataset (0.1 s per task here), the same for every model.
# lm-eval's evaluator builds fresh requests (Instances) from a task on every run, so nothing of one
# model's run is left for the next. Each entry keeps the capability object it was built from: a
# capability registered anew under the same name gets its task rebuilt.
_TASKS: dict[tuple[str, str], tuple[object, object]] = {}


def lm_eval_tasks(capabilities: list[str], split: str) -> dict:
    """The lm-eval Tasks that `capabilities` are scored on for `split`, by task name (built once)."""
    from lm_eval.tasks import TaskManager  # lazy: lm_eval is slow to import

    include = _include_path(capabilities)
    names = {task_name(c, split): get_capability(c) for c in capabilities}
    missing = [n for n, cap in names.items() if _TASKS.get((include, n), (None,))[0] is not cap]
    if missing:
        loaded = TaskManager(include_path=include, include_defaults=False).load(missing)["tasks"]
        for n in missing:
            task = loaded[n]
            if task.get_config("num_fewshot") is None:  # what simple_evaluate does without num_fewshot
                task.set_config(key="num_fewshot", value=0)
            # The evaluator walks a task's docs twice per model (building requests, then scoring them):
            # as a datasets.Dataset every row is formatted out of Arrow again each time. The rows it
            # yields, kept as a list, are the same docs (lm-eval takes a list of dicts as docs).
            task.dataset = {split_name: list(docs) for split_name, docs in task.dataset.items()}
            _TASKS[include, n] = (names[n], task)
    return {n: _TASKS[include, n][1] for n in names}


def _run_lm_eval(model, tokenizer, capabilities, split, limit, batch_size, lm=None) -> dict[str, Score]:
    import datasets  # lazy: datasets is slow to import

    for name in ("lm-eval", "lm_eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import lm_eval.api.task as lm_task  # lazy: lm_eval is slow to import

    datasets.disable_progress_bars()
    lm_task.tqdm = functools.partial(tqdm, disable=True)  # per-document context bars
    was_training = model.training if model is not None else False
    if lm is None:
        from lm_eval.models.huggingface import HFLM  # lazy: lm_eval is slow to import

        model.eval()
        # A model object is scored where it is, in its own dtype: HFLM takes its device from `model.device`
        # and never moves it (lm_eval/models/huggingface.py, HFLM.__init__: a pre-initialized model sets gpus = 0)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
        # lm-eval's per-request bars would drown opd's own progress display
        lm.generate_until = functools.partial(HFLM.generate_until, lm, disable_tqdm=True)
    caps = {c: get_capability(c) for c in capabilities}
    native = [c for c in capabilities if not getattr(caps[c], "lm_eval", False)]
    # One lm-eval run per way of building contexts: raw text, or chat-templated (lm-eval applies a
    # template to every task of a run or to none). opd's own tasks keep their shipped names.
    runs: dict[bool, tuple[dict, dict, dict]] = {}  # chat -> ({task name: cap}, {task name: Task}, samples)
    if native:
        tasks = lm_eval_tasks(native, split)
        for c in native:
            names, task_dict, _ = runs.setdefault(_chat(caps[c], tokenizer), ({}, {}, {}))
            names[task_name(c, split)] = c
            task_dict[task_name(c, split)] = tasks[task_name(c, split)]
    for c in capabilities:
        if c in native:
            continue
        task, indices = caps[c].eval_task(split)
        names, task_dict, samples = runs.setdefault(_chat(caps[c], tokenizer), ({}, {}, {}))
        names[c], task_dict[c] = c, task
        samples[c] = indices[:limit] if limit else indices
        if not samples[c]:
            raise OpdError(f"lm-eval task {c!r}: its {split} split is empty ({caps[c].split_rule})")
    scores = {}
    try:
        for chat, (names, task_dict, samples) in runs.items():
            out = _evaluate(lm, {"tasks": task_dict, "groups": {}, "group_map": {}}, limit, samples, chat)
            for tname, c in names.items():
                scores[c] = _score(caps[c], out, tname)
    finally:
        if model is not None:
            model.train(was_training)
    return scores


def _evaluate(lm, task_dict: dict, limit, samples: dict, chat: bool) -> dict:
    """lm-eval's evaluator itself, called as simple_evaluate calls it, with simple_evaluate's seeds but
    without its per-call task building and environment report (pip and git subprocesses).

    It answers on every rank (a model object is rank 0 of 1 to lm-eval): each rank of a distributed
    trainer scores its own copy. Evaluation must not change a training run's random stream (or a
    cached score would change the run). `samples` picks docs of the lm-eval-task capabilities (their
    val/test docs), `limit` cuts opd's own tasks; lm-eval takes one or the other per run, so opd's
    tasks, which have no entry in `samples`, take all their (already split-sized) docs then.
    `chat`: apply_chat_template=True, as simple_evaluate passes it (lm_eval/evaluator.py), with
    fewshot_as_multiturn and no system_instruction (a task's `description` is the system turn)."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED  # lazy: lm_eval is slow to import
    from lm_eval.evaluator import evaluate as lm_eval_evaluate  # lazy: lm_eval is slow to import

    if samples:
        for tname, task in task_dict["tasks"].items():
            if tname not in samples:
                n = len(task.eval_docs)
                samples[tname] = list(range(min(limit, n) if limit else n))
        limit = None
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            random.seed(DEFAULT_RANDOM_SEED)
            np.random.seed(DEFAULT_OTHER_SEED)
            torch.manual_seed(DEFAULT_OTHER_SEED)
            for task in task_dict["tasks"].values():
                task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
            # inference_mode, not just generate's own no_grad: no version counters or view tracking on
            # any tensor of the run. Nothing made here outlives it (the KV cache is per generate call).
            with torch.inference_mode():
                return lm_eval_evaluate(lm=lm, task_dict=task_dict, limit=limit, samples=samples or None,
                                        log_samples=False, apply_chat_template=chat, fewshot_as_multiturn=True)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _score(cap, out: dict, tname: str) -> Score:
    """The capability's score from lm-eval's results: opd's own tasks report "score,none"; an lm-eval
    task its primary metric under its first filter ("metric,filter", stderr "metric_stderr,filter")."""
    r = out["results"][tname]
    if getattr(cap, "lm_eval", False):
        metric, flt = cap.info.metric, cap.info.filter
        rule = cap.split_rule
    else:
        metric, flt, rule = "score", "none", ""
    value, stderr = r.get(f"{metric},{flt}"), r.get(f"{metric}_stderr,{flt}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OpdError(f"lm-eval task {tname!r}: its primary metric {metric},{flt} is {value!r}, not a number "
                       f"(results has {sorted(k for k in r if k != 'alias')})")
    return Score(
        score=float(value),
        stderr=float(stderr) if isinstance(stderr, (int, float)) else float("nan"),
        n=int(out["n-samples"][tname]["effective"]),
        split_rule=rule,
    )
