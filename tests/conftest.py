"""Shared fixtures: tiny real Qwen3 models built on the CPU in milliseconds."""

from __future__ import annotations

import pytest
import torch

from opd.lab.model import ModelShape, build_model
from opd.lab.tokenizer import build_char_tokenizer

PICO = ModelShape(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Each test gets its own eval cache and one torch thread (the CI box has 2 cores)."""
    monkeypatch.setenv("OPD_CACHE", str(tmp_path / "opd-cache"))
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def pico_model(tokenizer):
    """A 2-layer, hidden-32 Qwen3 with the lab tokenizer (random weights, seed 0)."""
    return build_model(PICO, tokenizer, seed=0)


@pytest.fixture
def pico_dir(tmp_path, tokenizer):
    """The pico model saved as an HF model directory with its tokenizer."""
    model = build_model(PICO, tokenizer, seed=0)
    d = tmp_path / "pico"
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def trained_pico_dir(tmp_path_factory, tokenizer):
    """A pico model trained for a few seconds on `count`: it scores clearly above 0 but below 1,
    so score comparisons between evaluation paths mean something."""
    from opd.lab.data import MixtureStream, encode_sft

    torch.set_num_threads(1)
    model = build_model(PICO, tokenizer, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = MixtureStream({"count": 1.0}, seed=0)
    for _ in range(120):
        loss = model(**encode_sft(tokenizer, stream.next_batch(32))).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    d = tmp_path_factory.mktemp("trained") / "pico-count"
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d
