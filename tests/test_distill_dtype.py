"""`inference_dtype`: the student samples from a copy in that dtype and the stacked teachers score in it,
while the update stays in the student's own dtype."""

from __future__ import annotations

import pytest
import torch

import opd.distill.sampler as sampler_module
from opd.distill.batch import build_batch, sample_batch
from opd.distill.config import DistillConfig
from opd.distill.loop import distill, run_identity
from opd.distill.routing import resolve_routes
from opd.distill.teacher_bank import TeacherBank
from opd.distill.teachers import embedded_teacher
from opd.lab.model import build_model
from opd.lab.pico import PICO
from opd.rollout import get_engine


@pytest.fixture
def teachers(trained_pico_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    return {"count": embedded_teacher("count", "count", teacher, tokenizer)}


@pytest.mark.parametrize("layout", ["packed", "padded"])  # one forward per teacher, or one vmapped forward
def test_a_bf16_bank_holds_bf16_weights_and_scores_close_to_fp32(teachers, tokenizer, layout):
    import random

    routes = resolve_routes({"count": "count"})
    student = build_model(PICO, tokenizer, seed=0)
    items, groups = sample_batch(get_engine("embedded", model=student, tokenizer=tokenizer), routes, {"count": 1.0},
                                 random.Random(0), prompts=6, group=2, temperature=1.0, max_new_tokens=None, seed=0)
    fp32, bf16 = TeacherBank(teachers, ["count"]), TeacherBank(teachers, ["count"], torch.bfloat16)
    assert {v.dtype for v in bf16.params.values()} == {torch.bfloat16} and bf16.heads.dtype == torch.bfloat16
    # buffers (RoPE's frequencies) are not rounded
    assert all(bf16.buffers[k].dtype == v.dtype for k, v in fp32.buffers.items())
    out = {}
    for name, bank in (("fp32", fp32), ("bf16", bf16)):
        out[name] = build_batch(student, items, groups, teachers, routes, tokenizer.pad_token_id, bank=bank,
                                old_lp=False, layout=layout)
    a, b = out["fp32"], out["bf16"]
    assert a.target is not None and b.target is not None and b.target.dtype == torch.float32
    diff = (a.target.exp() - b.target.exp()).abs().max()  # probabilities of the mixed targets
    assert 0 < diff < 0.05, diff  # rounded (not the fp32 bank), and close to it
    assert torch.allclose(a.teacher_lp, b.teacher_lp, atol=0.1)


def test_the_student_samples_from_a_bf16_copy_synced_before_every_batch(teachers, tokenizer, monkeypatch):
    engines = []
    real_get_engine = sampler_module.get_engine
    gaps = []

    def spy_engine(kind, model, tokenizer, **options):
        engine = real_get_engine(kind, model=model, tokenizer=tokenizer, **options)
        engines.append(model)
        generate = engine.generate

        def checked(*args, **kwargs):  # the sampler is the student rounded to bf16, as it is now
            gaps.append(max(float((p.float() - q.to(torch.bfloat16).float()).abs().max())
                            for p, q in zip(model.parameters(), student.parameters(), strict=True)))
            return generate(*args, **kwargs)

        engine.generate = checked
        return engine

    monkeypatch.setattr(sampler_module, "get_engine", spy_engine)
    student = build_model(PICO, tokenizer, seed=0)
    cfg = DistillConfig(estimator="full", steps=5, lr=3e-3, prompts_per_step=8, group_size=2, layout="packed",
                        inference_dtype="bfloat16")
    state = distill(cfg, student, tokenizer, teachers, resolve_routes({"count": "count"}), log=lambda *_: None)
    (sampler,) = engines
    assert sampler is not student and {p.dtype for p in sampler.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in student.parameters()} == {torch.float32}  # the update stays fp32
    assert len(gaps) == 5 and max(gaps) == 0.0
    kls = [r["kl/count"] for r in state.history]
    assert kls[-1] < kls[0], kls


def test_inference_dtype_is_part_of_a_runs_identity_only_when_set():
    assert "inference_dtype" not in run_identity(DistillConfig())
    assert run_identity(DistillConfig(inference_dtype="bfloat16"))["inference_dtype"] == "bfloat16"


def test_an_unknown_inference_dtype_is_refused():
    with pytest.raises(ValueError, match="inference_dtype"):
        DistillConfig(inference_dtype="float16")


def test_auto_takes_bf16_only_where_it_multiplies_faster(monkeypatch, pico_model):
    import opd.distill.precision as precision

    for bf16_s, want in ((1.0, torch.float32), (0.01, torch.bfloat16)):
        precision.fastest_inference_dtype.cache_clear()
        monkeypatch.setattr(precision, "_seconds",
                            lambda dtype, width, device, repeats=5, s=bf16_s: s if dtype == torch.bfloat16 else 0.1)
        assert precision.resolve_inference_dtype("auto", pico_model) == want
    precision.fastest_inference_dtype.cache_clear()
    assert precision.resolve_inference_dtype(None, pico_model) == torch.float32  # the model's own
    assert precision.resolve_inference_dtype("bfloat16", pico_model) == torch.bfloat16
    assert DistillConfig(inference_dtype="auto").inference_dtype == "auto"


def test_the_banks_per_teacher_modules_are_views_of_the_stacked_weights(teachers):
    bank = TeacherBank({**teachers, "other": teachers["count"]}, ["count", "other"], torch.bfloat16)
    for k in range(2):
        for name, p in bank.plain[k].named_parameters():
            assert p.data_ptr() == bank.params[name][k].data_ptr() and p.dtype == torch.bfloat16
            assert not p.requires_grad
