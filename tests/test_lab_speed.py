"""What makes the lab faster without changing what it computes: experts started longest first,
the base's patience, and the warm start's teachers prefilling packed prompts."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from opd.lab.pipeline import longest_first


def test_experts_start_longest_first_by_sampled_tokens():
    from opd.expert.spec import ExpertSpec

    specs = {n: ExpertSpec(capability=c, steps=s) for n, c, s in
             [("add", "add", 400), ("dedup", "dedup", 400), ("sort", "sort", 100), ("mod", "mod", 400)]}
    # steps x (answer cap + 1): dedup 400 x 9, add 400 x 5, mod 400 x 4, sort 100 x 10 (its long answers
    # but a quarter of the steps)
    assert longest_first(specs) == ["dedup", "add", "mod", "sort"]
    # a spec's own answer cap wins over its capability's
    specs["mod"] = ExpertSpec(capability="mod", steps=400, gspo={"max_new_tokens": 31})
    assert longest_first(specs)[0] == "mod"


def test_equal_costs_keep_the_recipes_order():
    from opd.expert.spec import ExpertSpec

    specs = {n: ExpertSpec(capability="count", name=n) for n in ("b", "a", "c")}
    assert longest_first(specs) == ["b", "a", "c"]


def test_lab_pipeline_hands_the_experts_longest_first(monkeypatch, tmp_path):
    """run_lab's experts stage passes run_parallel the recipe's experts in longest-first order."""
    import opd.lab.pipeline as pipeline

    seen = {}
    monkeypatch.setattr(pipeline, "run_parallel", lambda cmds, jobs, log_dir: seen.update(order=list(cmds)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("experts: [rev, count, add]\nstrategies: {linear: {weight: 1.0}}\ntrain: {jobs: 2}\n")
    pipeline.run_lab(str(recipe), ["experts"])
    # the shipped specs: count and add 1000 steps x answer cap 4 + 1, rev 400 x 9 + 1
    assert seen["order"] == ["count", "add", "rev"]
    recipe.write_text("experts: [rev, count, add]\nstrategies: {linear: {weight: 1.0}}\n"
                      "train: {jobs: 2, overrides: {steps: 400}}\n")
    pipeline.run_lab(str(recipe), ["experts"])
    assert seen["order"] == ["rev", "count", "add"]


@pytest.mark.parametrize("patience, stop", [(None, 8), (2, 6), (3, 7)])
def test_base_patience_stops_after_screenings_without_a_better_checkpoint(tmp_path, monkeypatch, patience, stop):
    """Screenings whose band keys rise to step 4 and then fall: with patience p the build stops at
    step 4 + p (one screening a step) and keeps step 4, as the full run does."""
    import opd.lab.base as base
    from opd.evaluation.api import Score
    from opd.lab.pico import PICO

    scores = {1: 0.0, 2: 0.2, 3: 0.3, 4: 0.4, 5: 0.9, 6: 0.9, 7: 0.3, 8: 0.2}
    calls = []

    def fake_evaluate(model, tok, caps, split, limit=None):
        calls.append(1)
        return {c: Score(scores[len(calls)], 0.0, 4) for c in caps}

    monkeypatch.setattr(base, "evaluate", fake_evaluate)
    spec = base.BaseSpec(capabilities=["count"], mixture={"count": 1.0}, steps=8, eval_every=1, eval_limit=4,
                         batch_size=4, warmup=0, shape=PICO, threads=1, report_to="none", patience=patience,
                         band=(0.3, 0.5))
    logs = []
    manifest = base.build_base(spec, tmp_path / "runs" / "base", log=logs.append)
    assert manifest["kept_step"] == 4 and len(calls) == stop
    assert [h["step"] for h in manifest["history"]][-1] == stop
    assert any("patience" in m for m in logs) == (patience is not None)


def test_warm_start_teachers_prefill_as_the_layout_says(trained_pico_dir, tokenizer, monkeypatch):
    """verified_samples with prefill packed samples through a packed prefill (the teacher's own engine
    is left as it was) and draws the same samples as the padded prefill on the lab's models."""
    from transformers import AutoModelForCausalLM

    from opd.distill.offpolicy import verified_samples
    from opd.distill.routing import resolve_routes
    from opd.distill.teachers import embedded_teacher
    from opd.rollout.embedded import EmbeddedEngine

    teacher = embedded_teacher("count", "count", AutoModelForCausalLM.from_pretrained(trained_pico_dir), tokenizer)
    routes = resolve_routes({"count": "count"})
    packed_calls = []
    real = EmbeddedEngine._packed_prefill
    monkeypatch.setattr(EmbeddedEngine, "_packed_prefill",
                        lambda self, *a: packed_calls.append(1) or real(self, *a))

    def draw(prefill):
        return verified_samples({"count": teacher}, routes, random.Random(0), prompts=32, group=4,
                                temperature=1.0, seed=0, verify=False, prefill=prefill)

    padded = draw("padded")
    assert not packed_calls
    packed = draw("packed")
    assert packed_calls and teacher.engine.prefill == "padded"
    # the same seeded draws: the packed prefill's keys and values differ from the padded ones by float
    # rounding only, which may flip a rare sample
    def pairs(out):
        return Counter((tuple(p), tuple(c)) for p, c in out["count"])

    assert sum((pairs(packed) & pairs(padded)).values()) >= 0.95 * len(padded["count"]) > 0


@pytest.mark.parametrize("patience, stop, best", [(None, 8, 4), (1, 5, 4), (2, 6, 4), (3, 7, 4)])
def test_expert_patience_stops_after_screenings_without_a_better_checkpoint(trained_pico_dir, tmp_path,
                                                                             patience, stop, best):
    """GSPO screenings (one a step) rise to step 4 and then fall: with patience p the loop stops at
    step 4 + p and keeps step 4, as the full run does. A rerun of a stopped run trains nothing more."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.expert.spec import ExpertSpec
    from opd.expert.trainer import train

    vals = [0.05, 0.1, 0.2, 0.3, 0.4, 0.35, 0.2, 0.1, 0.0]  # step 0 .. 8
    tok = AutoTokenizer.from_pretrained(trained_pico_dir)
    spec = ExpertSpec(capability="count", base=str(trained_pico_dir), steps=8, eval_every=1, checkpoint_every=1,
                      patience=patience, gspo={"prompts_per_step": 2, "group_size": 2, "updates_per_batch": 1,
                                               "min_informative": 0.0})
    calls, logs = [], []

    def screen(m):
        calls.append(1)
        return vals[len(calls) - 1]

    ck = tmp_path / "ck" / "state.pt"
    state = train(spec.gspo, spec.run_settings(), AutoModelForCausalLM.from_pretrained(trained_pico_dir), tok, ck,
                  evaluate_fn=screen, log=logs.append)
    assert (state.step, state.best_step) == (stop, best)
    assert len(calls) == stop + 1  # step 0 and one a step
    assert any("patience" in m for m in logs) == (patience is not None)
    again = train(spec.gspo, spec.run_settings(), AutoModelForCausalLM.from_pretrained(trained_pico_dir), tok, ck,
                  evaluate_fn=screen, log=logs.append)
    assert (again.step, again.best_step, len(calls)) == (stop, best, stop + 1)
