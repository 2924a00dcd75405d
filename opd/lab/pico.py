"""Pico lab models for tests and benchmarks: real Qwen3s small enough to build in seconds."""

from __future__ import annotations

from pathlib import Path

from opd.lab.model import ModelShape

PICO = ModelShape(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, max_position_embeddings=64)


def build_trained_pico(out: Path, capability: str = "count", steps: int = 120) -> Path:
    """A pico model trained for a few seconds on `capability`: it scores clearly above 0 but below
    1, so score comparisons mean something. Written to `out` as an HF directory with tokenizer."""
    import torch

    from opd.lab.data import MixtureStream, encode_sft
    from opd.lab.model import build_model
    from opd.lab.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_model(PICO, tok, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = MixtureStream({capability: 1.0}, seed=0)
    for _ in range(steps):
        loss = model(**encode_sft(tok, stream.next_batch(32))).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
