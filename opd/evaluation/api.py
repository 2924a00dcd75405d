"""Score an in-memory model on capabilities with lm-eval; results cached by model content hash."""

from __future__ import annotations

import functools
import json
import logging
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

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
from opd.io import atomic_write_json, state_dict_hash

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
EVAL_VERSION = "1"  # bump when held-out data, prompts or metrics change: invalidates caches


@dataclass(frozen=True)
class Score:
    score: float
    stderr: float
    n: int


def cache_dir() -> Path:
    return Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd")) / "evals"


def _include_path(capabilities: list[str]) -> str:
    if all((REPO_EVALS / f"{task_name(c, 'test')}.yaml").exists() for c in capabilities):
        return str(REPO_EVALS)
    # Capabilities without shipped YAMLs (e.g. reasoning-gym ones) get generated tasks, written once
    # per capability set into the eval cache (not a new temp dir per call, which nothing removed).
    from opd.io import atomic_dir, text_hash

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
) -> dict[str, Score]:
    """Score `model` on each capability's held-out `split` with lm-eval; returns {cap: Score}.

    `limit` scores only the first `limit` items (cheap-first screening). The cache key is the
    model's content hash, so the same weights are never scored twice on the same task.
    """
    if split not in EVAL_SPLITS:
        raise OpdError(f"split {split!r}: evaluation uses one of {EVAL_SPLITS}")
    for c in capabilities:
        get_capability(c)
    # The content hash reads every weight; it is only the cache's key.
    key = (model_hash or state_dict_hash(model)) if use_cache else None
    results: dict[str, Score] = {}
    todo = []
    for c in capabilities:
        path = None
        if use_cache:
            path = cache_dir() / key / f"{task_name(c, split)}-{limit or SPLIT_SIZES[split]}-v{EVAL_VERSION}.json"
            if path.exists():
                results[c] = Score(**json.loads(path.read_text()))
                continue
        todo.append((c, path))
    if todo:
        fresh = _run_lm_eval(model, tokenizer, [c for c, _ in todo], split, limit, batch_size)
        for c, path in todo:
            results[c] = fresh[c]
            if use_cache:
                atomic_write_json(path, asdict(fresh[c]))
    return {c: results[c] for c in capabilities}


# lm-eval Task objects, built once per process and reused by every evaluation: building one loads
# its held-out items into a datasets.Dataset (0.1 s per task here), the same for every model.
# lm-eval's evaluator builds fresh requests (Instances) from a task on every run, so nothing of one
# model's run is left for the next. Each entry keeps the capability object it was built from: a
# capability registered anew under the same name gets its task rebuilt.
_TASKS: dict[tuple[str, str], tuple[object, object]] = {}


def lm_eval_tasks(capabilities: list[str], split: str) -> dict:
    """The lm-eval Tasks that `capabilities` are scored on for `split`, by task name (built once)."""
    from lm_eval.tasks import TaskManager

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


def _run_lm_eval(model, tokenizer, capabilities, split, limit, batch_size) -> dict[str, Score]:
    import datasets
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate as lm_eval_evaluate
    from lm_eval.models.huggingface import HFLM

    for name in ("lm-eval", "lm_eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import lm_eval.api.task as lm_task
    from tqdm import tqdm

    datasets.disable_progress_bars()
    lm_task.tqdm = functools.partial(tqdm, disable=True)  # per-document context bars
    was_training = model.training
    model.eval()
    # A model object is scored where it is, in its own dtype: HFLM takes its device from `model.device` and
    # never moves it (lm_eval/models/huggingface.py, HFLM.__init__: a pre-initialized model sets gpus = 0)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
    # lm-eval's per-request bars would drown opd's own progress display
    lm.generate_until = functools.partial(HFLM.generate_until, lm, disable_tqdm=True)
    names = {task_name(c, split): c for c in capabilities}
    task_dict = {"tasks": lm_eval_tasks(capabilities, split), "groups": {}, "group_map": {}}
    # lm-eval's evaluator itself, called as simple_evaluate calls it, with simple_evaluate's seeds but
    # without its per-call task building and environment report (pip and git subprocesses). It
    # answers on every rank (a model object is rank 0 of 1 to lm-eval): each rank of a distributed
    # trainer scores its own copy. Evaluation must not change a training run's random stream (or a
    # cached score would change the run).
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
                out = lm_eval_evaluate(lm=lm, task_dict=task_dict, limit=limit, log_samples=False,
                                       fewshot_as_multiturn=True)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    model.train(was_training)
    scores = {}
    for tname, c in names.items():
        r = out["results"][tname]
        stderr = r.get("score_stderr,none")
        scores[c] = Score(
            score=float(r["score,none"]),
            stderr=float(stderr) if isinstance(stderr, (int, float)) else float("nan"),
            n=int(out["n-samples"][tname]["effective"]),
        )
    return scores
