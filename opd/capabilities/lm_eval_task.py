"""Adapter: any lm-eval task (a stock one, or a YAML in a recipe's `include_path`) as an opd capability.

The rest of opd keys on capability names; registering each task as a `Capability` under its
lm-eval name keeps the search, interference matrix, retention, headline and report unchanged.
`opd.evaluation.api.evaluate` scores such a capability by running the task itself through lm-eval
(`LmEvalTaskCapability.lm_eval = True`), on its primary metric: the first `metric_list` entry (lm-eval's
default for the output type when there is none) under the first filter, the results key lm-eval
writes as "metric,filter" (lm_eval/api/task.py `_metric_fn_list`, lm_eval/evaluator_utils.py).

Splits. opd tunes on val and reports on test:
- a task with a validation and a test split uses them as they are;
- a task with one evaluation split holds out a deterministic hash split of that split's docs
  (sha256 of the doc's JSON -> 100 buckets, as opd's own tasks split their prompts): val and test
  halves when the task has a training split, else val 20% / test 20% / train 60%.
Training prompts (OPD, warm start) come from the training split, else from the train buckets.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

from opd.capabilities import _REGISTRY, get_capability, register
from opd.capabilities.base import Capability, Item, chat_prompt
from opd.errors import OpdError

BUCKETS_WITH_TRAIN = {"val": range(0, 50), "test": range(50, 100)}
BUCKETS_NO_TRAIN = {"val": range(0, 20), "test": range(20, 40), "train": range(40, 100)}
# Metrics lm-eval computes but cannot aggregate into one number (lm_eval/api/metrics.py "bypass").
NON_NUMERIC = {"bypass"}


def doc_bucket(doc: dict) -> int:
    text = json.dumps(doc, sort_keys=True, default=str)
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 100


def doc_key(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TaskInfo:
    """What opd reads from a task's YAML (via lm-eval's index) before any data loads."""

    name: str
    include_path: str | None
    include_defaults: bool
    output_type: str
    metric: str
    filter: str
    training_split: str | None
    validation_split: str | None
    test_split: str | None
    max_gen_toks: int

    @property
    def key(self) -> str:
        return f"{self.metric},{self.filter}"

    @property
    def split_rule(self) -> str:
        """How val/test are made, in words (for the report)."""
        if self.validation_split and self.test_split:
            return f"val = its '{self.validation_split}' split, test = its '{self.test_split}' split"
        one = self.test_split or self.validation_split
        if self.training_split:
            return f"val/test = a sha256 hash split (50/50) of its '{one}' docs"
        return f"val/test/train = a sha256 hash split (20/20/60) of its '{one}' docs"

    @property
    def hashed(self) -> bool:
        return not (self.validation_split and self.test_split)


def _metric(name: str, cfg: dict, where: str) -> tuple[str, bool | None]:
    """The task's primary metric and whether higher is better (None: lm-eval does not know)."""
    # lazy: lm_eval is slow to import
    from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY, is_higher_better

    output_type = cfg.get("output_type", "generate_until")
    metric_list = cfg.get("metric_list")
    if metric_list is None:
        metric = DEFAULT_METRIC_REGISTRY.get(output_type, [None])[0]
        if metric is None:
            raise OpdError(f"lm-eval task {name!r} ({where}): output_type {output_type!r} has no default metric; "
                           "give it a metric_list")
        return metric, is_higher_better(metric)
    if not metric_list or not isinstance(metric_list[0], dict) or "metric" not in metric_list[0]:
        raise OpdError(f"lm-eval task {name!r} ({where}): no usable metric (its metric_list is empty or its "
                       "first entry names no metric)")
    first = metric_list[0]
    metric = first["metric"]
    if not isinstance(metric, str):
        raise OpdError(f"lm-eval task {name!r} ({where}): its first metric is not a name ({metric!r})")
    if "/" in metric:  # an unresolved `!function utils.f` reads as "<dir>/utils.f"; lm-eval keys it by f.__name__
        metric = metric.rsplit("/", 1)[-1].rsplit(".", 1)[-1]
    if metric in NON_NUMERIC or first.get("aggregation") in NON_NUMERIC:
        raise OpdError(f"lm-eval task {name!r} ({where}): its primary metric {metric!r} is not numeric; "
                       "put a numeric metric first in its metric_list")
    hib = first.get("higher_is_better")
    return metric, hib if hib is not None else is_higher_better(metric)


def task_info(name: str, include_path: str | None, manager) -> TaskInfo:
    """Check `name` in a TaskManager's index: a single task with a usable, higher-is-better metric."""
    from lm_eval.tasks._index import Kind  # lazy: lm_eval is slow to import

    entry = manager.task_index.get(name)
    where = str(entry.yaml_path) if entry and entry.yaml_path else "lm-eval"
    if entry is None:
        where = f"in include_path {include_path} nor " if include_path else ""
        raise OpdError(f"unknown task {name!r}: not an opd capability (nor 'rg:<task>'), not an lm-eval task "
                       f"{where}among lm-eval's stock tasks; put its task YAML in a directory and set "
                       "include_path to it")
    if entry.kind not in (Kind.TASK, Kind.PY_TASK) or entry.cfg is None:
        raise OpdError(f"lm-eval name {name!r} ({where}) is a {entry.kind.name.lower()}, not a task; name its "
                       "tasks one by one")
    cfg = entry.cfg
    metric, higher = _metric(name, cfg, where)
    if higher is False:
        raise OpdError(f"lm-eval task {name!r} ({where}): its primary metric {metric!r} is lower-is-better; "
                       "retention needs a higher-is-better metric first in its metric_list")
    filters = cfg.get("filter_list") or []
    first_filter = filters[0].get("name", "none") if filters and isinstance(filters[0], dict) else "none"
    if not cfg.get("test_split") and not cfg.get("validation_split"):
        raise OpdError(f"lm-eval task {name!r} ({where}): it has neither a test_split nor a validation_split")
    gen = cfg.get("generation_kwargs") or {}
    inside = include_path is not None and entry.yaml_path is not None and \
        Path(entry.yaml_path).resolve().is_relative_to(Path(include_path).resolve())
    return TaskInfo(
        name=name, include_path=include_path, include_defaults=not inside,
        output_type=cfg.get("output_type", "generate_until"), metric=metric, filter=first_filter,
        training_split=cfg.get("training_split"), validation_split=cfg.get("validation_split"),
        test_split=cfg.get("test_split"), max_gen_toks=int(gen.get("max_gen_toks", 256)))


@functools.lru_cache(maxsize=8)
def task_manager(include_path: str | None, include_defaults: bool):
    """lm-eval's TaskManager, built once per process for each (include_path, include_defaults):
    indexing the stock tasks takes 6-8 s."""
    from lm_eval.tasks import TaskManager  # lazy: lm_eval is slow to import

    for n in ("lm-eval", "lm_eval"):
        logging.getLogger(n).setLevel(logging.ERROR)
    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def resolve_tasks(names: list[str], include_path: str | None) -> list[str]:
    """Register every name in `names` that is not already a capability as an lm-eval task capability.

    The stock task index (about 15,000 tasks, 6-8 s) is built only when a name is not found in
    `include_path`. Raises a one-line OpdError for an unknown task or one without a usable metric."""
    todo = []
    for n in names:
        existing = _REGISTRY.get(n)
        if isinstance(existing, LmEvalTaskCapability) and existing.info.include_path != include_path:
            todo.append(n)  # the same name from another include directory: re-resolve
        elif existing is None and not n.startswith("rg:"):
            todo.append(n)
        else:
            get_capability(n)
    if not todo:
        return list(names)
    if include_path is not None and not Path(include_path).is_dir():
        raise OpdError(f"include_path {include_path}: not a directory of lm-eval task YAMLs")
    manager = task_manager(include_path, include_defaults=include_path is None)
    if include_path is not None and any(n not in manager.task_index for n in todo):
        manager = task_manager(include_path, include_defaults=True)
    for n in todo:
        register(LmEvalTaskCapability.from_info(task_info(n, include_path, manager)), overwrite=True)
    return list(names)


@dataclass
class _Loaded:
    """A task's lm-eval Task objects and its docs per opd split (loaded on first use)."""

    tasks: dict[str, object]  # opd split -> the Task scored for it
    indices: dict[str, list[int]]  # opd split -> indices into that Task's eval_docs
    docs: dict[str, list[dict]]  # opd split (val, test, train) -> its docs
    by_prompt: dict[str, dict] = field(default_factory=dict)
    by_key: dict[str, dict] = field(default_factory=dict)


_LOADED: dict[TaskInfo, _Loaded] = {}


def _load(info: TaskInfo) -> _Loaded:
    if info in _LOADED:
        return _LOADED[info]
    import datasets  # lazy: datasets is slow to import

    datasets.disable_progress_bars()
    manager = task_manager(info.include_path, info.include_defaults)

    def fresh():
        try:
            task = manager.load([info.name])["tasks"][info.name]
        except Exception as e:  # the dataset is missing, offline, or the YAML is broken
            raise OpdError(f"lm-eval task {info.name!r} could not be loaded: {str(e).splitlines()[0][:300]}") from None
        if task.get_config("num_fewshot") is None:  # what simple_evaluate does without num_fewshot
            task.set_config(key="num_fewshot", value=0)
        return task

    task = fresh()
    if not info.hashed:
        val_task = fresh()
        val_task.set_config(key="test_split", value=None)  # its eval_docs become the validation docs
        tasks = {"val": val_task, "test": task}
        indices = {s: list(range(len(t.eval_docs))) for s, t in tasks.items()}
        train = list(task.training_docs()) if info.training_split else []
    else:
        every = list(task.eval_docs)
        buckets = BUCKETS_WITH_TRAIN if info.training_split else BUCKETS_NO_TRAIN
        by_bucket = [doc_bucket(d) for d in every]
        indices = {s: [i for i, b in enumerate(by_bucket) if b in buckets[s]] for s in ("val", "test")}
        tasks = {"val": task, "test": task}
        train = (list(task.training_docs()) if info.training_split
                 else [d for d, b in zip(every, by_bucket) if b in buckets["train"]])
    docs = {}
    for s in ("val", "test"):
        every = list(tasks[s].eval_docs)
        docs[s] = [every[i] for i in indices[s]]
    loaded = _Loaded(tasks, indices, {**docs, "train": train})
    for d in (d for split_docs in loaded.docs.values() for d in split_docs):
        loaded.by_key[doc_key(d)] = d
    for d in loaded.by_key.values():
        text = task.doc_to_text(d)  # not text for multiple-input tasks: those cannot give training prompts
        if isinstance(text, str):
            loaded.by_prompt.setdefault(text, d)
    _LOADED[info] = loaded
    return loaded


def _text(task, doc: dict) -> str:
    text = task.doc_to_text(doc)
    if not isinstance(text, str):
        raise OpdError(f"lm-eval task {task.config.task!r}: doc_to_text gives {type(text).__name__}, not text; "
                       "opd trains on text prompts")
    return text


def _hflm_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    # lm_eval/models/huggingface.py HFLM.apply_chat_template, which fewshot_context calls
    if add_generation_prompt:
        return chat_prompt(tokenizer, messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                         continue_final_message=True)


def _no_generate(rng, difficulty):  # pragma: no cover - sample/items are overridden
    raise AssertionError("lm-eval task capabilities draw docs, not generated prompts")


@dataclass(frozen=True)
class LmEvalTaskCapability(Capability):
    """An lm-eval task as a capability. `items`/`sample` draw docs; `verify` runs the task's own
    filters and process_results on one doc (generate_until tasks only: `verifiable` is False for a
    task scored by log-likelihoods, which cannot score a sampled completion; its `verify` gives 0)."""

    info: TaskInfo | None = None
    lm_eval: bool = True

    @classmethod
    def from_info(cls, info: TaskInfo) -> LmEvalTaskCapability:
        return cls(info.name, f"lm-eval task {info.name} ({info.key})", _no_generate, max_new_tokens=info.max_gen_toks,
                   verify=functools.partial(_verify, info), chat=True, until=(),
                   verifiable=info.output_type == "generate_until", info=info)

    @property
    def split_rule(self) -> str:
        return self.info.split_rule

    def eval_task(self, split: str):
        """(the lm-eval Task scored for `split`, the indices of its eval docs that make the split)."""
        loaded = _load(self.info)
        return loaded.tasks[split], loaded.indices[split]

    def _docs(self, split: str) -> list[dict]:
        return _load(self.info).docs[split]

    def doc(self, answer: str) -> dict | None:
        """The doc an item of this capability was drawn from (its `answer` is the doc's key)."""
        return _load(self.info).by_key.get(answer)

    def _item(self, doc: dict) -> Item:
        return Item(self.name, _text(_load(self.info).tasks["test"], doc), doc_key(doc))

    def sample(self, rng: random.Random, split: str = "train", difficulty: int | None = None) -> Item:
        docs = self._docs(split)
        if not docs:
            raise OpdError(f"lm-eval task {self.name!r} has no {split} docs to draw prompts from")
        return self._item(rng.choice(docs))

    def items(self, split: str, n: int, seed: int = 0, difficulty: int | None = None) -> list[Item]:
        docs = self._docs(split)
        rng = random.Random(f"{self.name}|{split}|{seed}")
        return [self._item(d) for d in rng.sample(docs, min(n, len(docs)))]

    def render(self, prompt: str, tokenizer) -> str:
        """The context lm-eval itself builds for the doc (`fewshot_context`, with the task's
        num_fewshot and description), chat-templated as lm-eval does where the tokenizer has one."""
        loaded = _load(self.info)
        task = loaded.tasks["test"]
        doc = loaded.by_prompt.get(prompt)
        if doc is None:
            return Capability.render(self, prompt, tokenizer)
        chat = bool(getattr(tokenizer, "chat_template", None))
        return task.fewshot_context(doc, task.get_config("num_fewshot") or 0, apply_chat_template=chat,
                                    fewshot_as_multiturn=True,
                                    chat_template=functools.partial(_hflm_chat, tokenizer) if chat else None)


def _verify(info: TaskInfo, completion: str, answer: str) -> float:
    """The task's primary metric on one completion: its first filter pipeline, then its
    process_results, as lm-eval's evaluator scores a doc (lm_eval/evaluator.py, api/filter.py)."""
    if info.output_type != "generate_until":
        # Scored by log-likelihoods: no score for a sampled completion. A constant reward gives
        # group-normalised advantages of 0 (no signal), where raising would stop an OPD run that
        # only distils this task from its teachers.
        return 0.0
    loaded = _load(info)
    doc = loaded.by_key.get(answer)
    if doc is None:
        return 0.0
    task = loaded.tasks["test"]
    ensemble = next((f for f in task._filters if f.name == info.filter), task._filters[0])
    resps = [[completion]]
    for f in ensemble.filters:
        resps = f().apply(resps, [doc])
    value = task.process_results(doc, [list(resps)[0]]).get(info.metric)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise OpdError(f"lm-eval task {info.name!r}: metric {info.metric!r} gives {type(value).__name__} per doc, "
                       "not a number; it cannot be a reward") from None
