"""Fake experts for the merge tests and bench: pico base + small random task vectors, with manifests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from opd.io import state_dict_hash
from opd.lab.model import ModelShape, build_model
from opd.lab.pico import PICO
from opd.lab.tokenizer import build_char_tokenizer


def build_fake_lab(root: Path, capabilities=("add", "rev"), shape: ModelShape = PICO, scale: float = 0.02) -> dict:
    """Write root/base and root/experts/<cap>/ (HF dirs + manifest.json); returns their paths."""
    root = Path(root)
    tok = build_char_tokenizer()
    base = build_model(shape, tok, seed=0)
    base_hash = state_dict_hash(base)
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    (root / "base" / "manifest.json").write_text(json.dumps({"kind": "base", "content_hash": base_hash}))
    experts = {}
    for i, cap in enumerate(capabilities):
        m = build_model(shape, tok, seed=0)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "mlp" in name or "q_proj" in name:  # a sparse-ish task vector, as RL leaves
                    p.add_(torch.randn(p.shape, generator=g) * scale)
        d = root / "experts" / cap
        m.save_pretrained(d)
        tok.save_pretrained(d)
        zero = {"score": 0.0, "stderr": 0.0, "n": 1}
        (d / "manifest.json").write_text(json.dumps({
            "name": cap, "capability": cap, "content_hash": state_dict_hash(m),
            "base": {"path": str(root / "base"), "content_hash": base_hash},
            "metrics": {"val": {cap: zero}, "test": {cap: zero}},
        }))
        experts[cap] = d
    return {"base": root / "base", "experts": experts}


def write_recipe(path: Path, lab: dict, out: Path, **fields) -> Path:
    import yaml

    doc = {"name": "t", "base": str(lab["base"]), "experts": [str(p) for p in lab["experts"].values()],
           "strategies": {"ties": {"density": [0.3, 1.0], "weight": [0.5, 1.0]}, "linear": {"weight": [0.2, 1.0]}},
           "budget": {"n_trials": 4}, "sampler": "random", "out": str(out),
           "screening": {"limit": 4, "margin": 0.5, "warmup": 1}, "final_candidates": 2, "eval_batch_size": 64}
    doc.update(fields)
    path.write_text(yaml.safe_dump(doc))
    return path
