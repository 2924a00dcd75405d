"""Pico lab models for tests and benchmarks: real Qwen3s small enough to build in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.io import state_dict_hash
from opd.lab.data import MixtureStream, encode_sft
from opd.lab.model import ModelShape, build_model
from opd.lab.tokenizer import build_char_tokenizer

PICO = ModelShape(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, max_position_embeddings=64)


def pretrain_pico(capability: str = "count", steps: int = 120, shape: ModelShape = PICO, tokenizer=None):
    """A lab model of `shape` trained for `steps` supervised batches on `capability` (seconds for
    pico sizes): it scores clearly above 0 but below 1. `tokenizer`: default the char one.
    Returns (model, tokenizer)."""
    tok = tokenizer or build_char_tokenizer()
    model = build_model(shape, tok, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = MixtureStream({capability: 1.0}, seed=0)
    for _ in range(steps):
        loss = model(**encode_sft(tok, stream.next_batch(32))).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, tok


def build_trained_pico(out: Path, capability: str = "count", steps: int = 120, tokenizer=None) -> Path:
    """`pretrain_pico`, written to `out` as an HF directory with its tokenizer, so score comparisons
    in tests and benches mean something."""
    model, tok = pretrain_pico(capability, steps, tokenizer=tokenizer)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_fake_lab(root: Path, capabilities=("add", "rev"), shape: ModelShape = PICO, scale: float = 0.02,
                   base: Path | None = None, tokenizer=None) -> dict:
    """Write root/base and root/experts/<cap>/ (HF dirs + manifest.json); returns their paths.

    The base is a fresh pico model of `shape` (with `tokenizer`, default the char one), or a copy of
    the model directory `base` (e.g. one from `build_trained_pico`); each expert is the base plus a seeded sparse-ish random task vector
    (MLP and query weights), with a manifest like a trained expert's (scores 0)."""
    root = Path(root)
    if base is None:
        tok = tokenizer or build_char_tokenizer()

        def load():
            return build_model(shape, tok, seed=0)
    else:
        tok = AutoTokenizer.from_pretrained(base)

        def load():
            return AutoModelForCausalLM.from_pretrained(base)
    model = load()
    base_hash = state_dict_hash(model)
    model.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    (root / "base" / "manifest.json").write_text(json.dumps({"kind": "base", "content_hash": base_hash}))
    experts = {}
    for i, cap in enumerate(capabilities):
        m = load()
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
