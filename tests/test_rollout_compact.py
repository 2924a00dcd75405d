"""The embedded engine's faster sampling: a packed prompt prefill and compaction (rows that have stopped
leave the batch between `generate` calls). Both must give what the plain engine gives: the same greedy
answers and, for every sampled token, the log-prob of one clean forward pass."""

from __future__ import annotations

import pytest
import torch

from opd.rollout import SamplingParams
from opd.rollout.embedded import EmbeddedEngine

# mixed lengths, a one-token prompt, and two equal prompts side by side (packed as one document)
PROMPTS = ["7", "12+7=", "reverse abc:", "9*9=", "9*9=", "#a:abca="]
FAST = [dict(prefill="packed"), dict(compact_every=1), dict(compact_every=3),
        dict(prefill="packed", compact_every=2)]


def _forward_logprobs(model, prompt_ids, completion_ids):
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(completion_ids) - 1)
    return logp[pos, torch.tensor(completion_ids)].tolist()


@pytest.mark.parametrize("options", FAST, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_greedy_answers_are_the_plain_engines(pico_model, tokenizer, options):
    params = SamplingParams(temperature=0.0, max_new_tokens=7)  # 7: not a multiple of compact_every
    plain = EmbeddedEngine(pico_model, tokenizer).generate(PROMPTS, n=2, params=params)
    fast = EmbeddedEngine(pico_model, tokenizer, **options).generate(PROMPTS, n=2, params=params)
    assert [[r.completion_ids for r in g] for g in fast] == [[r.completion_ids for r in g] for g in plain]
    for gp, gf in zip(plain, fast, strict=True):
        for p, f in zip(gp, gf, strict=True):
            torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(p.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", FAST, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_sampled_logprobs_are_a_clean_forwards(trained_pico_dir, tokenizer, options):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    out = EmbeddedEngine(model, tokenizer, **options).generate(PROMPTS, n=3,
                                                                params=SamplingParams(max_new_tokens=6, seed=4))
    assert [len(g) for g in out] == [3] * len(PROMPTS)
    stops = {tokenizer.convert_tokens_to_ids("\n"), tokenizer.eos_token_id}
    for group in out:
        for r in group:
            assert 1 <= len(r.completion_ids) <= 6 and len(r.logprobs) == len(r.completion_ids)
            assert not stops & set(r.completion_ids[:-1])  # nothing after a stop token
            ref = _forward_logprobs(model, r.prompt_ids, r.completion_ids)
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)


def test_compaction_samples_only_the_rows_still_going(trained_pico_dir, tokenizer, monkeypatch):
    """The trained pico answers a prompt ending in '=' in two tokens (a digit, then a newline) and
    rambles on one without: after the first call only the rambling rows are still generated."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    rows = []
    generate = model.generate

    def spy(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    prompts = ["#a:abca=", "#b:bbcd=", "#c:acca=", "hello"]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    out = EmbeddedEngine(model, tokenizer, compact_every=2).generate(prompts, n=2, params=params)
    lengths = [len(r.completion_ids) for g in out for r in g]
    assert rows[0] == 8 and len(rows) >= 2
    assert rows[1] == sum(n > 2 for n in lengths) < 8, (rows, lengths)  # the two-token answers left
    assert rows == sorted(rows, reverse=True)
    rows.clear()
    plain = EmbeddedEngine(model, tokenizer).generate(prompts, n=2, params=params)
    assert rows == [8]  # one call, every row to the end
    assert [[r.completion_ids for r in g] for g in plain] == [[r.completion_ids for r in g] for g in out]


def test_seeded_compacted_sampling_repeats(pico_model, tokenizer):
    engine = EmbeddedEngine(pico_model, tokenizer, compact_every=2, prefill="packed")
    params = SamplingParams(max_new_tokens=6, seed=11)
    a = engine.generate(PROMPTS, n=2, params=params)
    b = engine.generate(PROMPTS, n=2, params=params)
    assert [[r.completion_ids for r in g] for g in a] == [[r.completion_ids for r in g] for g in b]


def test_compact_every_must_be_positive():
    from opd.distill.config import DistillConfig

    with pytest.raises(ValueError, match="compact_every"):
        DistillConfig(compact_every=0)
    assert DistillConfig(compact_every=3).compact_every == 3


@pytest.mark.parametrize("training", [True, False])
def test_engine_leaves_the_models_mode_as_it_found_it(pico_model, tokenizer, training):
    """A training student samples in eval mode and is handed back training; a sampler kept in eval mode
    (the loop's copy) is not switched at all (train() walks every module on each call)."""
    pico_model.train(training)
    calls = []
    original = type(pico_model).train
    pico_model.train = lambda mode=True: (calls.append(mode), original(pico_model, mode))[1]
    engine = EmbeddedEngine(pico_model, tokenizer, compact_every=2)
    engine.generate(["1+2="], 2, SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))
    engine.score([[5, 6]], [[7]])
    assert pico_model.training is training
    assert calls == ([False, True, False, True] if training else [])
