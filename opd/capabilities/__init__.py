"""Capability registry: `get_capability(name)`, `register(cap)`, `list_capabilities()`."""

from __future__ import annotations

from opd.capabilities.base import EVAL_SPLITS, SPLIT_BUCKETS, Capability, Item, exact_reward, prompt_texts
from opd.capabilities.builtin import BUILTIN
from opd.capabilities.preference import LEARNED_REWARD
from opd.capabilities.reasoning_gym import reasoning_gym_capability
from opd.errors import OpdError

_REGISTRY: dict[str, Capability] = {}


def register(cap: Capability, *, overwrite: bool = False) -> Capability:
    if cap.name in _REGISTRY and not overwrite:
        raise ValueError(f"capability {cap.name!r} is already registered")
    _REGISTRY[cap.name] = cap
    return cap


def get_capability(name: str) -> Capability:
    if name not in _REGISTRY and name.startswith("rg:"):
        return register(reasoning_gym_capability(name[3:]))
    try:
        return _REGISTRY[name]
    except KeyError:
        raise OpdError(
            f"unknown capability {name!r}; known: {', '.join(sorted(_REGISTRY))} "
            "(or 'rg:<reasoning-gym task>')"
        ) from None


def list_capabilities() -> list[str]:
    return sorted(_REGISTRY)


for _cap in [*BUILTIN, *LEARNED_REWARD]:  # the learned-reward ones: opd.capabilities.preference
    register(_cap)

__all__ = [
    "Capability", "Item", "EVAL_SPLITS", "SPLIT_BUCKETS", "exact_reward",
    "get_capability", "list_capabilities", "prompt_texts", "register",
]
