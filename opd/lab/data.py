"""Training streams over capability mixtures, and SFT tensor encoding."""

from __future__ import annotations

import random

import torch

from opd.capabilities import Item, get_capability


class MixtureStream:
    """Endless seeded stream of training items; `state()`/`load_state()` make it resumable."""

    def __init__(self, weights: dict[str, float], difficulties: dict[str, int] | None = None,
                 seed: int | str = 0):
        self.caps = [get_capability(c) for c in weights]
        self.weights = [float(w) for w in weights.values()]
        self.difficulties = difficulties or {}
        self.rng = random.Random(f"mixture|{seed}")

    def next_batch(self, n: int) -> list[Item]:
        caps = self.rng.choices(self.caps, weights=self.weights, k=n)
        return [c.sample(self.rng, "train", self.difficulties.get(c.name)) for c in caps]

    def state(self):
        return self.rng.getstate()

    def load_state(self, state) -> None:
        self.rng.setstate(state)


def encode_sft(tokenizer, items: list[Item]) -> dict[str, torch.Tensor]:
    """Right-padded `prompt+answer+\\n` with labels only on `answer+\\n` (B, T). Prompt and answer are
    encoded separately and their ids concatenated, never the joined text: generation continues from
    the prompt's ids, so with a BPE this is the split the model meets when it answers."""
    prompts = [tokenizer(it.prompt, add_special_tokens=False).input_ids for it in items]
    answers = [tokenizer(it.answer + "\n", add_special_tokens=False).input_ids for it in items]
    T = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids = torch.full((len(items), T), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(items), T), -100, dtype=torch.long)
    mask = torch.zeros((len(items), T), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a)
        mask[i, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
