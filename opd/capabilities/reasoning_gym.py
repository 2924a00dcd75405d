"""Adapter: any reasoning-gym task as an opd capability (for real models; prompts are long)."""

from __future__ import annotations

import random

from opd.capabilities.base import Capability
from opd.errors import OpdError


def reasoning_gym_capability(task: str, pool: int = 2000) -> Capability:
    """Wrap `reasoning_gym.create_dataset(task)`; the verifier is the task's own `score_answer`.

    Items are drawn from a seeded pool of `pool` entries; the answer stored with an item is the
    dataset's reference answer, and `verify` scores with the dataset's scorer against the entry.

    Prompts carry reasoning-gym's own answer-format instruction (`SYSTEM_PROMPTS["default"]` in
    reasoning_gym/utils.py: answer inside <answer></answer>), as the system turn of the chat template
    where the tokenizer has one. Training and lm-eval both stop at the model's eos (no "\n" stop:
    a reasoning trace spans lines), and both score the last <answer> tag (`extract_answer`).
    """
    try:
        import reasoning_gym  # lazy: reasoning_gym is slow to import; only rg: tasks need it
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # lazy: as above
    except ImportError as e:  # pragma: no cover - reasoning-gym is a core dependency
        raise OpdError("reasoning-gym is not installed: pip install reasoning-gym") from e
    try:
        ds = reasoning_gym.create_dataset(task, size=pool, seed=0)
    except Exception as e:
        raise OpdError(f"reasoning-gym task {task!r} could not be created: {e}") from None
    entries = {str(ds[i]["question"]): ds[i] for i in range(len(ds))}
    prompts = sorted(entries)

    def generate(rng: random.Random, difficulty: int) -> tuple[str, str]:
        q = rng.choice(prompts)
        return q, str(entries[q]["answer"])

    def verify(completion: str, answer: str) -> float:
        entry = next((e for e in entries.values() if str(e["answer"]) == answer), None)
        if entry is None:
            return 0.0
        extracted = extract_answer(completion) or completion.strip()
        return float(ds.score_answer(extracted.strip(), entry))

    return Capability(f"rg:{task}", f"reasoning-gym {task}", generate, default_difficulty=1,
                      max_new_tokens=256, verify=verify, prompt_space=pool, chat=True,
                      instruction=SYSTEM_PROMPTS["default"], until=())
