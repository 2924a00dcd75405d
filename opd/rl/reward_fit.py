"""Fitting a reward model: the Bradley-Terry loss over rule-generated preference pairs.

The model, its manifest and its checks live with the capabilities (opd.capabilities.reward_model);
this is the training loop `python scripts/train_reward_model.py` runs.
"""

from __future__ import annotations

import datetime as dt
import random
import time
from pathlib import Path

import torch

from opd.capabilities.reward_model import (
    KIND,
    RewardModelSettings,
    base_classifier,
    build_classifier,
    heldout_accuracy,
    learned_reward_capability,
    scores,
    write_reward_model,
)
from opd.errors import OpdError
from opd.io import state_dict_hash, tokenizer_hash
from opd.manifest import code_version
from opd.model_inputs import read_header, weights_hash
from opd.rl.preference_loss import bradley_terry_loss


def base_hash(base_dir: Path) -> str:
    """The content hash of the base's weights (cached; the value its opd manifest records, if it has one)."""
    return weights_hash(read_header(base_dir, "the base"))


def train_reward_model(settings: RewardModelSettings, tokenizer, out: Path, log=print, base_dir: Path | None = None
                       ) -> dict:
    """Fit the reward model of `settings.capability` on its rule's train pairs, measure it on held-out
    pairs (val prompts), and write it with its manifest to `out`. Returns the manifest. `base_dir`: the
    model directory `init: base` starts from (its tokenizer is `tokenizer`)."""
    torch.set_num_threads(settings.threads)
    cap = learned_reward_capability(settings.capability)
    train = cap.pairs("train", settings.pairs, seed=settings.seed, spurious=settings.spurious)
    heldout = cap.pairs("val", settings.heldout_pairs, seed=settings.seed, spurious=settings.spurious)
    if settings.init == "base":
        if base_dir is None:
            raise OpdError("reward model init 'base' needs the base model directory (--base)")
        model = base_classifier(base_dir, settings.seed)
    else:
        model = build_classifier(settings.shape, tokenizer, settings.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    order = random.Random(f"rm-order|{settings.seed}")
    t0, loss_avg = time.time(), None
    model.train()
    for step in range(1, settings.steps + 1):
        batch = order.sample(train, min(settings.batch_size, len(train)))
        prompts = [p.prompt for p in batch]
        loss, st = bradley_terry_loss(scores(model, tokenizer, prompts, [p.chosen for p in batch]),
                                      scores(model, tokenizer, prompts, [p.rejected for p in batch]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()
        if step % 50 == 0 or step == settings.steps:
            log(f"step {step}: loss {loss_avg:.3f} batch accuracy {float(st['accuracy']):.2f}")
    seconds = time.time() - t0
    manifest = {
        "kind": KIND, "capability": cap.name, "content_hash": state_dict_hash(model),
        "tokenizer_hash": tokenizer_hash(tokenizer), "settings": settings.model_dump(mode="json"),
        "init_from": None if settings.init == "scratch" else str(base_dir),
        # the lab refits a reward model started from other base weights (opd.lab.reward_models)
        "init_from_hash": None if settings.init == "scratch" else base_hash(base_dir),
        "spurious": cap.spurious if settings.spurious is None else settings.spurious,
        "heldout": {"split": "val prompts", **heldout_accuracy(model, tokenizer, heldout)},
        "train_accuracy": heldout_accuracy(model, tokenizer, train)["accuracy"],
        "train": {"seconds": round(seconds, 1), "final_loss": loss_avg},
        "code_version": code_version(), "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    write_reward_model(out, model, tokenizer, manifest)
    return manifest
