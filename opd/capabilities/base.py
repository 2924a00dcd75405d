"""A capability: a seeded generator of prompts with verifiable answers, plus a verifier."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

# Every prompt hashes into one of 100 buckets. Buckets decide the split, so a held-out prompt can
# never be generated for training, whatever seed or difficulty the training run uses.
SPLIT_BUCKETS = {"val": range(0, 5), "test": range(5, 10), "train": range(10, 100)}
# Generation seeds per split are offset far apart, on top of the bucket rule.
SPLIT_SEED_OFFSET = {"train": 0, "val": 1_000_003, "test": 2_000_003}
EVAL_SPLITS = ("val", "test")


@dataclass(frozen=True)
class Item:
    capability: str
    prompt: str
    answer: str

    def to_dict(self) -> dict:
        return {"capability": self.capability, "prompt": self.prompt, "answer": self.answer}


def exact_reward(completion: str, answer: str) -> float:
    """1.0 when the first line of the completion, stripped, equals the answer."""
    return float(completion.split("\n", 1)[0].strip() == answer.strip())


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """`messages` rendered for generation, as lm-eval's HFLM.apply_chat_template renders them
    (lm_eval/models/huggingface.py: tokenize=False, add_generation_prompt=True)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_texts(items, tokenizer) -> list[str]:
    """The texts an engine samples `items` from: each capability renders its own prompts."""
    # lazy: cycle: opd.capabilities imports opd.capabilities.base
    from opd.capabilities import get_capability

    return [get_capability(it.capability).render(it.prompt, tokenizer) for it in items]


@dataclass(frozen=True)
class Capability:
    """`generate(rng, difficulty) -> (prompt, answer)`; `verify(completion, answer) -> [0, 1]`."""

    name: str
    description: str
    generate: Callable[[random.Random, int], tuple[str, str]]
    default_difficulty: int = 1
    max_new_tokens: int = 8
    verify: Callable[[str, str], float] = field(default=exact_reward)
    # Size of the prompt space at the default difficulty (None: effectively unbounded); used to
    # refuse eval sizes a split cannot hold.
    prompt_space: int | None = None
    # Prompts are rendered with the tokenizer's chat template (where it has one) for training and
    # for lm-eval (apply_chat_template). opd's own compact tasks are raw text: False.
    chat: bool = False
    # An instruction given before every prompt: the system message under a chat template, else
    # prepended (lm-eval's task `description`, rendered the same way for training and scoring).
    instruction: str = ""
    # The strings lm-eval's generation stops at besides the tokenizer's eos, which it always adds
    # (lm_eval/models/utils.py handle_stop_sequences); training stops at the model's eos ids.
    until: tuple[str, ...] = ("\n",)
    # False: `verify` cannot score a completion (an lm-eval task whose metric needs log-likelihoods);
    # the capability can be scored and distilled from teachers, but gives no reward.
    verifiable: bool = True

    def render(self, prompt: str, tokenizer) -> str:
        """The text a model is given for `prompt`, as lm-eval builds a zero-shot context
        (lm_eval/api/task.py fewshot_context): the instruction as a system turn, then the prompt."""
        if self.chat and getattr(tokenizer, "chat_template", None):
            system = [{"role": "system", "content": self.instruction}] if self.instruction else []
            return chat_prompt(tokenizer, [*system, {"role": "user", "content": prompt}])
        return self.instruction + prompt

    def split_of(self, prompt: str) -> str:
        bucket = int(hashlib.sha256(f"{self.name}|{prompt}".encode()).hexdigest()[:8], 16) % 100
        for split, buckets in SPLIT_BUCKETS.items():
            if bucket in buckets:
                return split
        raise AssertionError(bucket)

    def sample(self, rng: random.Random, split: str = "train", difficulty: int | None = None) -> Item:
        """One item whose prompt belongs to `split` (rejection sampling on the bucket rule)."""
        d = self.default_difficulty if difficulty is None else difficulty
        for _ in range(10_000):
            prompt, answer = self.generate(rng, d)
            if self.split_of(prompt) == split:
                return Item(self.name, prompt, answer)
        raise RuntimeError(f"capability {self.name}: no {split} prompt found in 10000 draws")

    def items(self, split: str, n: int, seed: int = 0, difficulty: int | None = None) -> list[Item]:
        """`n` distinct items of `split`, deterministic in (seed, split, difficulty)."""
        rng = random.Random(f"{self.name}|{split}|{seed + SPLIT_SEED_OFFSET[split]}|{difficulty}")
        seen: dict[str, Item] = {}
        for _ in range(n * 200):
            it = self.sample(rng, split, difficulty)
            seen.setdefault(it.prompt, it)
            if len(seen) == n:
                return list(seen.values())
        raise RuntimeError(f"capability {self.name}: only {len(seen)} distinct {split} prompts, asked for {n}")
