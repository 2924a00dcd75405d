"""A model's state dict as the merges see it: each stored tensor once. Below opd.weights.merge and the
methods it registers (opd.weights.adamerging), which both need it."""

from __future__ import annotations


def merge_keys(sd: dict) -> dict:
    """Drop tied aliases (lm_head sharing the embedding): mergekit merges each stored tensor once."""
    seen, out = set(), {}
    for k, t in sd.items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[k] = t
    return out
