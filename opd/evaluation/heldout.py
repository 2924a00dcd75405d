"""Held-out evaluation items: fixed sizes and seeds per split, as datasets lm-eval can read."""

from __future__ import annotations

from opd.capabilities import EVAL_SPLITS, get_capability
from opd.errors import OpdError

SPLIT_SIZES = {"val": 200, "test": 300}
HELDOUT_SEED = 0  # training never draws from val/test buckets, whatever its seed


def heldout_items(capability: str, split: str, n: int | None = None) -> list[dict]:
    if split not in EVAL_SPLITS:
        raise OpdError(f"split {split!r} is not an evaluation split; use one of {EVAL_SPLITS}")
    cap = get_capability(capability)
    n = SPLIT_SIZES[split] if n is None else n
    if cap.prompt_space is not None:
        n = min(n, cap.prompt_space // 40)  # a split holds ~1/20 of the space; leave slack
    return [it.to_dict() for it in cap.items(split, n, seed=HELDOUT_SEED)]


def load_dataset_dict(capability: str, split: str, **_: object):
    """`custom_dataset` hook for lm-eval task YAMLs: a DatasetDict with one `test` split."""
    import datasets  # lazy: datasets is slow to import

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(heldout_items(capability, split))})


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval metric hook: the capability's own verifier, so eval and RL reward agree."""
    return {"score": get_capability(doc["capability"]).verify(results[0], doc["answer"])}
