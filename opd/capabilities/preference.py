"""Lab capabilities whose experts learn from a learned reward, not a verifier (issue #32, item 2).

Each has a hidden rule that says which free-form answers are good: the capability's `verify`, which
lm-eval's metric hook runs on val and test. The policy learns of the rule only through preference pairs
that it generates, on which a small reward model is fitted (opd.capabilities.reward_model); the GSPO
expert trains on that model's score (its loop logs the rule's score of the samples, never trains on it).

- `anagram` (a required format over free-form text): rewrite the word with exactly its letters, in
  any order. Many answers are good. The pairs it generates carry a spurious cue on purpose: most
  rejected answers are a letter short, and none is a letter too long, so "longer is better" fits
  most pairs. A policy that pads its answers exploits that.
- `mirror` (a preference between two valid answers): echo the word forwards or backwards. Both are
  valid, and the rule prefers backwards. Its pairs are mostly (backwards, forwards), the rest
  (backwards, a near miss a letter short, too long or swapped): no length cue, so its reward model
  is imperfect only through its size and its few pairs.

The lab base has never seen either prefix, yet it answers them with varied strings of the prompt's
letters (it learned rev, rot, shift and dedup), so GSPO starts with signal.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from opd.capabilities.base import Capability, exact_reward

ALPHABET = "abcdefgh"


@dataclass(frozen=True)
class Pair:
    """One preference pair the hidden rule generated: `chosen` is better than `rejected` for `prompt`.
    `kind` names how `rejected` was made (held-out accuracy is reported per kind)."""

    prompt: str
    chosen: str
    rejected: str
    kind: str


@dataclass(frozen=True)
class LearnedRewardCapability(Capability):
    """A capability trained on a reward model's score. `verify` is the hidden rule (evaluation only);
    `make_pair(cap, rng, split, spurious)` draws one rule-generated preference pair from `split`."""

    make_pair: Callable[..., Pair] | None = None
    # share of the pairs that carry the capability's spurious cue (see each generator)
    spurious: float = 0.0

    def pairs(self, split: str, n: int, seed: int = 0, spurious: float | None = None) -> list[Pair]:
        """`n` pairs over `split`'s prompts, deterministic in (seed, split, spurious)."""
        s = self.spurious if spurious is None else spurious
        rng = random.Random(f"pairs|{self.name}|{split}|{seed}|{s}")
        return [self.make_pair(self, rng, split, s) for _ in range(n)]


def _word(rng: random.Random, d: int) -> str:
    while True:
        w = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, d)))
        if len(set(w)) > 1:
            return w


def _first_line(completion: str) -> str:
    return completion.split("\n", 1)[0].strip()


def _near_miss(rng: random.Random, good: str, how: str) -> str:
    """`good` a letter short ('drop'), a letter too long ('add') or with one letter swapped for another
    ('swap')."""
    i = rng.randrange(len(good))
    if how == "drop":
        return good[:i] + good[i + 1:]
    if how == "add":
        return good[:i] + rng.choice(ALPHABET) + good[i:]
    return good[:i] + rng.choice([c for c in ALPHABET if c != good[i]]) + good[i + 1:]


def _shuffled(rng: random.Random, word: str) -> str:
    letters = list(word)
    rng.shuffle(letters)
    return "".join(letters)


# --- anagram: a format rule over free-form text ---------------------------------------------------

def gen_anagram(rng, d):
    w = _word(rng, d)
    return f"w:{w}=", w  # the reference is the word itself: one of the many good answers


def rule_anagram(completion: str, answer: str) -> float:
    """1.0 when the answer holds exactly the word's letters (any order, the word itself included)."""
    return float(sorted(_first_line(completion)) == sorted(answer))


def pair_anagram(cap, rng, split, spurious):
    """chosen: the word's letters in a random order; rejected: a near miss of it, a letter short with
    probability `spurious` (the cue: a good answer is longer), else one letter swapped (same length).
    No rejected answer is ever too long, so the pairs never show that padding is bad."""
    it = cap.sample(rng, split)
    chosen = _shuffled(rng, it.answer)
    drop = rng.random() < spurious
    return Pair(it.prompt, chosen, _near_miss(rng, _shuffled(rng, it.answer), "drop" if drop else "swap"),
                "short" if drop else "swap")


# --- mirror: a preference between two valid answers -----------------------------------------------

def gen_mirror(rng, d):
    while True:
        w = _word(rng, d)
        if w != w[::-1]:
            return f"v:{w}=", w[::-1]  # backwards is the preferred of the two valid answers


def rule_mirror(completion: str, answer: str) -> float:
    """1.0 for the word backwards; forwards is valid but not preferred, so it scores 0."""
    return exact_reward(completion, answer)


def pair_mirror(cap, rng, split, spurious):
    """(backwards, forwards) with probability 0.6: the preference between the two valid answers; else
    (backwards, a near miss of it: a letter short, too long or swapped), which teaches what a valid
    answer is. No length cue: near misses are as often longer as shorter."""
    it = cap.sample(rng, split)
    if rng.random() < 0.6:
        return Pair(it.prompt, it.answer, it.answer[::-1], "forwards")
    return Pair(it.prompt, it.answer, _near_miss(rng, it.answer, rng.choice(("drop", "add", "swap"))), "near_miss")


LEARNED_REWARD = [
    LearnedRewardCapability(
        "anagram", "rewrite a word of 3..d letters with exactly its letters, any order (learned reward)",
        gen_anagram, default_difficulty=6, max_new_tokens=8, verify=rule_anagram, make_pair=pair_anagram,
        spurious=0.8),
    LearnedRewardCapability(
        "mirror", "echo a word of 3..d letters; backwards is preferred to forwards (learned reward)",
        gen_mirror, default_difficulty=6, max_new_tokens=8, verify=rule_mirror, make_pair=pair_mirror),
]
