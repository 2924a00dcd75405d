"""The rollout interface: sampling parameters, one sampled completion, and the engine protocol."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from opd.errors import OpdError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy; top_k 0 means no top-k cut."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise OpdError(f"sampling: temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise OpdError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise OpdError(f"sampling: top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise OpdError(f"sampling: max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Rollout:
    """One sampled completion.

    completion_ids ends with the stop token ("\\n" or eos) when one was sampled, and `logprobs` has
    one entry per completion id: the model's log-softmax at temperature 1 (before any temperature,
    top-p or top-k reshaping), i.e. the log-prob a teacher-forced forward pass gives the same token.
    `text` is the decoded completion: the "\n" stop included, special tokens (<eos>) left out, as
    lm-eval decodes its generations, so an answer ended by <eos> is rewarded as lm-eval scores it.
    Training uses `completion_ids` as sampled, never `text` re-tokenized: with a BPE the same text
    has several tokenizations, and the sampled one is what the log-probs belong to.
    """

    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: list[str], n: int, params: SamplingParams) -> list[list[Rollout]]:
        """`n` samples for each prompt: result[i][j] is sample j of prompts[i]."""
        ...

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Per-token log-probs (temperature 1) of each given completion after its prompt."""
        ...

    def sync_weights(self, model) -> None:
        """Make the engine sample from `model`'s current weights."""
        ...


# name -> "module:attribute"; imported on demand so an engine's dependencies load only when used.
ENGINES: dict[str, str] = {
    "embedded": "opd.rollout.embedded:EmbeddedEngine",
    "sglang": "opd.rollout.sglang:SGLangEngine",
}


def get_engine(name: str, **kwargs) -> RolloutEngine:
    """Build the rollout engine registered as `name` with `kwargs`."""
    if name not in ENGINES:
        raise OpdError(f"unknown rollout engine {name!r}; choose one of: {', '.join(sorted(ENGINES))}")
    module, attr = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), attr)(**kwargs)


def cut_at_stop(ids: list[int], stop_ids: set[int]) -> list[int]:
    """`ids` up to and including the first stop token (all of it when none occurs)."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids


def stop_token_ids(model=None, tokenizer=None) -> list[int]:
    """The ids that end an answer: the model's generation_config.eos_token_id (an int or a list,
    in the lab ["\\n", <eos>]), falling back to the tokenizer's eos."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
