"""Reward functions: `(completion, answer, capability) -> float in [0, 1]`, registered by name.

Evaluation always uses the capability's own verifier; a training reward may add partial credit
so that small models get signal before they are ever fully right.
"""

from __future__ import annotations

from collections.abc import Callable

from opd.capabilities.base import Capability
from opd.errors import OpdError

Reward = Callable[[str, str, Capability], float]


def verifier(completion: str, answer: str, cap: Capability) -> float:
    """The capability's verifier: what lm-eval scores."""
    return cap.verify(completion, answer)


def partial(completion: str, answer: str, cap: Capability) -> float:
    """1.0 when verified; otherwise up to 0.5 for characters right in the right place
    (a wrong length costs: positions are counted over the longer string)."""
    if cap.verify(completion, answer) == 1.0:
        return 1.0
    got = completion.split("\n", 1)[0].strip()
    same = sum(a == b for a, b in zip(got, answer))
    return 0.5 * same / max(len(got), len(answer), 1)


REWARDS: dict[str, Reward] = {"verifier": verifier, "partial": partial}


def get_reward(name: str) -> Reward:
    try:
        return REWARDS[name]
    except KeyError:
        raise OpdError(f"unknown reward {name!r}; choose one of: {', '.join(sorted(REWARDS))}") from None
