"""Bring-your-own test bed: a GSM8K-format lm-eval task over local JSONL, and experts fine-tuned
OUTSIDE opd (plain transformers `Trainer`, saved as plain HF directories with no opd manifest).

`python scripts/make_byo.py` runs `make_byo`; merge_recipes/byo.yaml merges what it writes.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from opd.capabilities import get_capability
from opd.capabilities.lm_eval_task import resolve_tasks
from opd.errors import OpdError
from opd.io import atomic_dir, atomic_write_text

REPO_BYO = Path(__file__).resolve().parents[2] / "evals" / "byo"
TASK = "byo_arith"
NAMES = ("ann", "bob", "cal", "dee", "eve")
THINGS = ("pens", "cups", "eggs", "figs")
# (task or capability the expert is fine-tuned on, expert directory name)
EXPERTS = ((TASK, "arith"), ("sort", "sort"))


def arith_doc(rng: random.Random) -> dict:
    """One GSM8K-format doc in the char tokenizer's alphabet, short enough for 64 positions:
    {"question": "bob has 12 pens, gets 7. how many?", "answer": "12+7=19 #### 19"}."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 29), rng.randint(1, 9)
    if rng.random() < 0.5 or b >= a:
        return {"question": f"{name} has {a} {thing}, gets {b}. how many?", "answer": f"{a}+{b}={a + b} #### {a + b}"}
    return {"question": f"{name} has {a} {thing}, loses {b}. how many?", "answer": f"{a}-{b}={a - b} #### {a - b}"}


def write_task(out: Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """Write out/data/byo_arith_{train,test}.jsonl (distinct questions) and out/tasks/byo_arith.yaml
    (evals/byo/byo_arith.yaml with absolute data_files: lm-eval resolves relative ones against the
    current directory). Returns the include directory out/tasks."""
    rng = random.Random(f"byo|{seed}")
    docs: dict[str, dict] = {}
    for _ in range(200 * (n_train + n_test)):
        d = arith_doc(rng)
        docs.setdefault(d["question"], d)
        if len(docs) == n_train + n_test:
            break
    else:
        raise OpdError(f"byo: only {len(docs)} distinct problems, asked for {n_train + n_test}")
    rows = list(docs.values())
    data, tasks = out / "data", out / "tasks"
    data.mkdir(parents=True, exist_ok=True)
    tasks.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:n_train]), ("test", rows[n_train:])):
        atomic_write_text(data / f"{TASK}_{split}.jsonl", "".join(json.dumps(r) + "\n" for r in part))
    text = (REPO_BYO / f"{TASK}.yaml").read_text().replace("runs/byo/data", str(data.resolve()))
    atomic_write_text(tasks / f"{TASK}.yaml", text)
    return tasks


def training_pairs(task: str, tokenizer, n: int, seed: int, include_path: str | None) -> list[tuple[str, str]]:
    """(prompt as the model sees it, answer + newline) pairs from `task`'s training docs or items.
    The prompt is rendered as opd and lm-eval render it (the task's context, chat template)."""
    resolve_tasks([task], include_path)
    cap = get_capability(task)
    if getattr(cap, "lm_eval", False):  # the item's answer is its doc's key; the doc holds the full answer
        items = cap.items("train", n, seed)
        return [(cap.render(it.prompt, tokenizer), " " + cap.doc(it.answer)["answer"] + "\n") for it in items]
    return [(cap.render(it.prompt, tokenizer), it.answer + "\n") for it in cap.items("train", n, seed)]


def finetune(base: Path, out: Path, pairs: list[tuple[str, str]], steps: int, seed: int, lr: float = 2e-3,
             batch_size: int = 32) -> Path:
    """Supervised fine-tuning of `base` on `pairs` with plain transformers `Trainer` (loss on the answer
    tokens only); saves a plain HF directory (model, generation config, tokenizer) with no manifest."""
    # lazy: loads datasets and transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    rows = []
    for prompt, answer in pairs:  # prompt and answer encoded apart, as the lab encodes them everywhere
        p = tok(prompt, add_special_tokens=False).input_ids
        a = tok(answer, add_special_tokens=False).input_ids
        rows.append({"input_ids": p + a, "labels": [-100] * len(p) + a})

    def collate(batch):
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # right-padded: positions start at 0 for every row
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            labels[i, : len(r["labels"])] = torch.tensor(r["labels"])
            attn[i, : len(r["input_ids"])] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": attn}

    with atomic_dir(out) as tmp:  # an interrupted run leaves no half-written expert
        args = TrainingArguments(
            output_dir=str(tmp / ".trainer"), max_steps=steps, per_device_train_batch_size=batch_size,
            learning_rate=lr, lr_scheduler_type="constant", use_cpu=not torch.cuda.is_available(), report_to=[],
            save_strategy="no", logging_strategy="no", seed=seed, disable_tqdm=True, remove_unused_columns=False,
            dataloader_num_workers=0)
        Trainer(model=model, args=args, train_dataset=rows, data_collator=collate).train()
        shutil.rmtree(tmp / ".trainer", ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def make_byo(base: Path, out: Path, n_train: int = 2000, n_test: int = 400, steps: int = 300,
             seed: int = 0) -> dict:
    """The whole BYO test bed under `out`: the task (data/, tasks/) and experts/<name>/ fine-tuned
    from `base`. Returns {"include_path": ..., "experts": {name: {"path", "tasks"}}}."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    out = Path(out)
    tasks_dir = write_task(out, n_train, n_test, seed)
    tok = AutoTokenizer.from_pretrained(base)
    experts = {}
    for task, name in EXPERTS:
        pairs = training_pairs(task, tok, n_train, seed, str(tasks_dir.resolve()))
        path = finetune(Path(base), out / "experts" / name, pairs, steps, seed)
        experts[name] = {"path": str(path), "tasks": [task]}
    return {"include_path": str(tasks_dir), "experts": experts}
