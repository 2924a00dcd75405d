"""The lab's reward-model stage: before the experts train, fit the reward model of each learned-reward
expert (`reward: reward_model`, docs/reward-models.md) whose directory holds none that is up to date.

Up to date means: a reward model of that capability, trained on the base's tokenizer, with the same
settings, and for `init: base` started from the same base weights (its manifest's `init_from_hash`).
Anything else is refitted, so a lab with another base seed gets reward models of its own base."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from opd.capabilities.reward_model import RewardModelSettings, check_reward_model, learned_reward_capability
from opd.errors import OpdError
from opd.rl.reward_fit import base_hash, train_reward_model


def reward_model_settings(capability: str, overrides: dict) -> RewardModelSettings:
    """The settings the lab fits `capability`'s reward model with: the defaults, then `overrides`."""
    learned_reward_capability(capability)  # a verified capability has no reward model: one line naming it
    return RewardModelSettings.model_validate({**overrides, "capability": capability})


def up_to_date(path: Path, settings: RewardModelSettings, tokenizer, base: Path) -> str | None:
    """Why the reward model at `path` must be refitted, or None when it may be reused."""
    try:
        m = check_reward_model(path, settings.capability, tokenizer)
    except OpdError as e:
        return str(e).split(": ", 1)[-1].split("; train it with")[0]
    if m.get("settings") != settings.model_dump(mode="json"):
        return "its settings differ from the recipe's train.reward_models"
    if settings.init == "base" and m.get("init_from_hash") != base_hash(base):
        return "it was started from other base weights"
    return None


def ensure_reward_models(specs, base: str | Path, overrides: dict[str, dict], log: Callable[[str], None] = print
                         ) -> dict[str, float]:
    """Fit the reward model of every learned-reward spec in `specs` (ExpertSpec) that is not up to
    date, one after another; returns the seconds each fit took (empty when all were reused)."""
    from transformers import AutoTokenizer  # lazy: the lab's CLI refuses bad input before transformers loads

    wanted = {}
    for spec in specs:
        if spec.reward_model_dir is not None:
            wanted.setdefault(Path(spec.reward_model_dir), spec.capability)
    if not wanted:
        return {}
    tokenizer = AutoTokenizer.from_pretrained(base)
    seconds = {}
    for path, capability in wanted.items():
        settings = reward_model_settings(capability, overrides.get(capability, {}))
        why = up_to_date(path, settings, tokenizer, Path(base))
        if why is None:
            log(f"reward model {path} is up to date; reusing it")
            continue
        log(f"fitting the reward model of {capability!r} into {path} ({why})")
        m = train_reward_model(settings, tokenizer, path, log=log, base_dir=Path(base))
        seconds[capability] = m["train"]["seconds"]
        log(f"reward model {path}: held-out accuracy {m['heldout']['accuracy']:.3f} on {m['heldout']['n']} pairs")
    return seconds
