"""Weight-space interference: metrics on hand-made task vectors, layer groups, the report section."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from opd.evaluation.api import Score
from opd.merge.interference import interference_matrix, to_records
from opd.merge.weightspace import layer_group, n_layers, weightspace_interference

BASE = {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}


def one_tensor(**taus) -> dict:
    """Metrics of experts whose task vectors (on one zero base tensor) are the given 4-vectors."""
    experts = {n: {"model.layers.0.mlp.up_proj.weight": torch.tensor(t, dtype=torch.float32).view(2, 2)}
               for n, t in taus.items()}
    ws = weightspace_interference(BASE, experts)
    assert ws["groups"] == ["block 0"]
    return {m: ws[m]["block 0"] for m in ("cosine", "sign_conflict", "norm_ratio")}


def test_identical_task_vectors():
    m = one_tensor(a=[1.0, -2.0, 0.0, 3.0], b=[1.0, -2.0, 0.0, 3.0])
    assert m["cosine"][0][1] == pytest.approx(1.0)
    assert m["sign_conflict"][0][1] == 0.0
    assert m["norm_ratio"][0][1] == pytest.approx(1.0)


def test_negated_task_vectors():
    # b = -2a: cosine -1; every coordinate both moved (3 of them, the zero one is not counted) conflicts;
    # ||a|| / ||b|| = 1/2 and the matrix is reciprocal.
    m = one_tensor(a=[1.0, -2.0, 0.0, 3.0], b=[-2.0, 4.0, 0.0, -6.0])
    assert m["cosine"][0][1] == pytest.approx(-1.0)
    assert m["sign_conflict"][0][1] == 1.0
    assert m["norm_ratio"][0][1] == pytest.approx(0.5) and m["norm_ratio"][1][0] == pytest.approx(2.0)


def test_orthogonal_and_partly_conflicting():
    # a = (1, 1, 0, 0), b = (1, -1, 0, 0): dot 0 -> cosine 0; both move coordinates 0 and 1, signs differ on
    # coordinate 1 only -> conflict 1/2; ||a|| = ||b|| = sqrt 2.
    m = one_tensor(a=[1.0, 1.0, 0.0, 0.0], b=[1.0, -1.0, 0.0, 0.0])
    assert m["cosine"][0][1] == pytest.approx(0.0)
    assert m["sign_conflict"][0][1] == 0.5
    # Disjoint supports: orthogonal, and no coordinate both moved, so the conflict rate is undefined.
    m = one_tensor(a=[3.0, 0.0, 0.0, 0.0], b=[0.0, 0.0, 4.0, 0.0])
    assert m["cosine"][0][1] == 0.0 and m["sign_conflict"][0][1] is None
    assert m["norm_ratio"][0][1] == pytest.approx(3 / 4)  # ||a|| = 3, ||b|| = 4


def test_zero_task_vector_is_undefined_not_orthogonal():
    m = one_tensor(a=[0.0, 0.0, 0.0, 0.0], b=[1.0, 0.0, 0.0, 0.0])
    assert m["cosine"][0][1] is None and m["norm_ratio"][1][0] is None and m["norm_ratio"][0][1] == 0.0
    assert m["cosine"][0][0] is None and m["cosine"][1][1] == pytest.approx(1.0)


def test_groups_sum_over_their_tensors():
    # Two tensors in one group: the cosine is over their concatenation. a = (1 | 1), b = (1 | 0) over
    # up_proj | down_proj: dot 1, ||a|| = sqrt 2, ||b|| = 1 -> cosine 1/sqrt 2 (per-tensor cosines: 1 and undefined).
    base = {"model.layers.0.mlp.up_proj.weight": torch.zeros(1), "model.layers.0.mlp.down_proj.weight": torch.zeros(1),
            "model.embed_tokens.weight": torch.zeros(2, 2)}
    a = {"model.layers.0.mlp.up_proj.weight": torch.ones(1), "model.layers.0.mlp.down_proj.weight": torch.ones(1),
         "model.embed_tokens.weight": torch.ones(2, 2)}
    b = {"model.layers.0.mlp.up_proj.weight": torch.ones(1), "model.layers.0.mlp.down_proj.weight": torch.zeros(1),
         "model.embed_tokens.weight": -torch.ones(2, 2)}
    ws = weightspace_interference(base, {"a": a, "b": b})
    assert ws["experts"] == ["a", "b"] and ws["groups"] == ["embeddings", "block 0"]
    assert ws["cosine"]["block 0"][0][1] == pytest.approx(1 / math.sqrt(2))
    assert ws["cosine"]["embeddings"][0][1] == pytest.approx(-1.0)
    assert ws["norms"]["embeddings"] == pytest.approx([2.0, 2.0])


def test_layer_groups():
    names = ["model.embed_tokens.weight", "model.layers.11.self_attn.q_proj.weight", "model.norm.weight",
             "lm_head.weight"]
    assert n_layers(names) == 12
    assert layer_group("model.embed_tokens.weight", 12) == "embeddings"
    assert layer_group("lm_head.weight", 12) == "head"
    assert layer_group("model.norm.weight", 12) == "head"
    # A block's own norms belong to the block, not the head.
    assert layer_group("model.layers.3.input_layernorm.weight", 12) == "blocks 0-3"
    assert layer_group("model.layers.3.mlp.up_proj.weight", 12) == "blocks 0-3"
    assert layer_group("model.layers.4.self_attn.k_norm.weight", 12) == "blocks 4-7"
    assert layer_group("model.layers.11.mlp.down_proj.weight", 12) == "blocks 8-11"
    # 28 blocks (Qwen3-0.6B): thirds of 9, 9 and 10 blocks.
    assert [layer_group(f"model.layers.{i}.mlp.up_proj.weight", 28) for i in (8, 9, 17, 18, 27)] == \
        ["blocks 0-8", "blocks 9-17", "blocks 9-17", "blocks 18-27", "blocks 18-27"]
    # Up to 3 blocks, one group each.
    assert layer_group("model.layers.1.mlp.up_proj.weight", 2) == "block 1"
    assert layer_group("model.rotary_emb.inv_freq", 2) == "other"


def test_report_has_weightspace_section(tmp_path):
    from opd.merge.report import write_report

    caps = ["add", "rev"]
    experts = {"add": {"add": 0.8, "rev": 0.1}, "rev": {"add": 0.1, "rev": 0.9}, "sub": {"add": 0.2, "rev": 0.2}}
    rows = {"#0 linear": {"add": 0.5, "rev": 0.6}, "base": {"add": 0.1, "rev": 0.1},
            **{f"expert {e}": s for e, s in experts.items()}}
    refs = {"add": 0.8, "rev": 0.9}
    scores = {r: {c: Score(v, 0.01, 100) for c, v in s.items()} for r, s in rows.items()}
    cells = interference_matrix(scores, refs, rows["base"], "test")
    cand = {"strategy": "linear", "shared": {}, "per_model": {}, "seed": 0}
    base = {"model.embed_tokens.weight": torch.zeros(4, 2), "model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2),
            "model.norm.weight": torch.ones(2)}
    gen = torch.Generator().manual_seed(0)
    sds = {e: {k: v + torch.randn(v.shape, generator=gen) for k, v in base.items()} for e in experts}
    summary = {
        "inputs": {"base": {"path": "b", "content_hash": "h"},
                   "experts": {e: {"path": e, "content_hash": e, "capability": e} for e in experts}},
        "objectives": ["min_retention"], "best": "#0 linear", "counted": caps,
        "trials": [{"number": 0, "stage": "full", "candidate": cand, "min_retention": 0.625,
                    "retention": {"add": 0.625, "rev": 0.667}}],
        "final": {"#0 linear": {"trial": 0, "candidate": cand, "label": "linear"}},
        "matrix": {"test": to_records(cells)},
        "weightspace": weightspace_interference(base, sds),
    }
    recipe = SimpleNamespace(out_dir=tmp_path, name="t", verifier="capability")
    write_report(recipe, summary, {"test": cells, "val": cells})
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "## Weight-space interference" in md and "sign-conflict rate" in md
    assert md.index("## Interference matrix (val)") < md.index("## Weight-space interference") < md.index("## Plots")
    assert "<h2>Weight-space interference</h2>" in page and 'alt="weightspace_cosine"' in page
    for metric in ("cosine", "sign_conflict", "norm_ratio"):
        assert (tmp_path / f"weightspace_{metric}.png").stat().st_size > 0
        assert f"![weightspace_{metric}](weightspace_{metric}.png)" in md

    # One expert: no pairs, no section.
    del summary["weightspace"]
    summary["inputs"]["experts"] = {"add": summary["inputs"]["experts"]["add"]}
    out = tmp_path / "one"
    out.mkdir()
    write_report(SimpleNamespace(out_dir=out, name="t", verifier="capability"), summary, {"test": cells, "val": cells})
    assert "Weight-space" not in (out / "report.md").read_text() and not (out / "weightspace_cosine.png").exists()
