"""scripts/cost_model.py: the tables in docs/scale.md are its current output, its counts agree with
transformers' own models and with numbers worked out by hand, and the lab figures it cites are quoted
from the page it names."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cm():
    spec = importlib.util.spec_from_file_location("cost_model", ROOT / "scripts" / "cost_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cost_model"] = mod  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("cost_model", None)


def test_doc_tables_are_current(cm):
    doc = (ROOT / "docs" / "scale.md").read_text()
    assert cm.render(doc) == doc, "docs/scale.md's tables are stale: run `python scripts/cost_model.py --write`"


def test_render_fills_empty_markers_and_refuses_missing_ones(cm):
    doc = "".join(f"<!-- cost_model:{n} -->\n<!-- /cost_model:{n} -->\n" for n in cm.TABLES)
    out = cm.render(doc)
    assert "| 303,872 |" in out and cm.render(out) == out  # filled once, then stable
    with pytest.raises(SystemExit, match="cost_model:payload"):
        cm.render(doc.replace("cost_model:payload", "cost_model:other"))


def test_payload_bytes_by_hand(cm):
    rows = {name: b for name, b, _ in cm.payloads(151_936)}
    assert rows["full vocabulary, fp32"] == 607_744        # 151,936 x 4
    assert rows["full vocabulary, bf16"] == 303_872        # 151,936 x 2
    assert rows["top-64 (int32 id + fp32 logprob)"] == 512  # 64 x (4 + 4)
    assert rows["top-256 (int32 id + fp32 logprob)"] == 2_048  # 256 x (4 + 4)
    assert rows["sampled token (fp32 logprob)"] == 4


def test_qwen3_8b_by_hand(cm):
    s = cm.QWEN3_8B
    # K and V: 2 x 36 layers x 8 kv heads x 128 x 2 B = 147,456 B per token.
    assert s.kv_bytes_per_token() == 147_456
    # per layer: q and o 2 x 4096 x 4096 = 33,554,432; k and v 2 x 4096 x 1024 = 8,388,608;
    # MLP 3 x 4096 x 12288 = 150,994,944; sum 192,937,984 x 36 = 6,945,767,424;
    # embedding and untied head 2 x 151,936 x 4096 = 1,244,659,712; total 8,190,427,136 (Qwen3-8B's "8.2B").
    assert s.params() == (8_190_427_136, 8_190_427_136)
    # decode on one GPU at mean context 1024 + 4096 / 2 = 3072: KV per sequence 147,456 x 3072 = 453 MB;
    # free HBM 80e9 x 0.85 - 16.38e9 (bf16 weights) = 51.6e9 B, so 113 sequences in flight.
    d = cm.decode(s, 3072, 1)
    assert d["batch"] == 113 and d["bound"] == "HBM"


def test_glm45_size_matches_its_published_size(cm):
    total, active = cm.GLM45.params()
    assert 345e9 < total < 360e9  # published 355B, with a ~4B MTP layer left out
    non_embedding_active = active - 2 * cm.GLM45.vocab * cm.GLM45.hidden
    assert 31e9 < non_embedding_active < 33e9  # published 32B active


def _matrix_params(model) -> int:
    # norms and biases (1-D) are left out of the cost model on purpose; matrices and expert stacks count
    return sum(p.numel() for p in model.parameters() if p.ndim >= 2)


def test_param_count_matches_transformers_dense(cm):
    from opd.lab.model import ModelShape, build_model
    from opd.lab.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    assert len(tok) == cm.LAB.vocab
    assert cm.LAB.params()[0] == _matrix_params(build_model(ModelShape(), tok, 0))


def test_param_count_matches_transformers_moe(cm):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    shape = cm.Shape("tiny-moe", layers=3, hidden=32, q_heads=4, kv_heads=2, head_dim=8, intermediate=48,
                     vocab=64, tied=False, moe_layers=2, experts=6, topk=2, shared_experts=1, moe_intermediate=16)
    cfg = Glm4MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, tie_word_embeddings=False)
    assert shape.params()[0] == _matrix_params(Glm4MoeForCausalLM(cfg))


def test_lab_figures_are_quoted_from_their_page(cm):
    page = (ROOT / "docs" / "results" / "opd-throughput.md").read_text()
    assert cm.LAB_MS_QUOTE in page and cm.LAB_GFLOPS_QUOTE in page
    for ms in cm.LAB_MS.values():
        assert f"→ {ms:.0f} ms" in cm.LAB_MS_QUOTE


def test_lab_lengths_are_current(cm):
    p, a = cm.lab_lengths()
    assert (round(p, 2), round(a, 2)) == (cm.LAB_PROMPT_LEN, cm.LAB_ANSWER_LEN)
