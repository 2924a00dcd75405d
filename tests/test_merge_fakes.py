"""Fake experts for the merge tests and bench: pico base + small random task vectors, with manifests."""

from __future__ import annotations

from pathlib import Path

from opd.lab.pico import PICO, build_fake_lab  # noqa: F401  (re-exported for the tests)


def write_recipe(path: Path, lab: dict, out: Path, **fields) -> Path:
    import yaml

    doc = {"name": "t", "base": str(lab["base"]), "experts": [str(p) for p in lab["experts"].values()],
           "strategies": {"ties": {"density": [0.3, 1.0], "weight": [0.5, 1.0]}, "linear": {"weight": [0.2, 1.0]}},
           "budget": {"n_trials": 4}, "sampler": "random", "out": str(out),
           "screening": {"limit": 4, "margin": 0.5, "warmup": 1}, "final_candidates": 2, "eval_batch_size": 64}
    doc.update(fields)
    path.write_text(yaml.safe_dump(doc))
    return path
