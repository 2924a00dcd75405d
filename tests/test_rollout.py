"""The embedded (transformers) rollout engine on the pico Qwen3."""

from __future__ import annotations

import pytest
import torch

from opd.errors import OpdError
from opd.rollout import Rollout, RolloutEngine, SamplingParams, get_engine
from opd.rollout.embedded import EmbeddedEngine

PROMPTS = ["12+7=", "reverse abc:", "9*9="]


@pytest.fixture
def engine(pico_model, tokenizer):
    return get_engine("embedded", model=pico_model, tokenizer=tokenizer)


def _forward_logprobs(model, prompt_ids, completion_ids):
    """Teacher-forced log-probs of one unpadded sequence, the plainest possible recomputation."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # (T, V)
    pos = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(completion_ids) - 1)
    return logp[pos, torch.tensor(completion_ids)].tolist()


def test_registry(engine):
    assert isinstance(engine, EmbeddedEngine)
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(OpdError, match="embedded, sglang"):
        get_engine("vllm")


def test_sampling_params_validated():
    with pytest.raises(OpdError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(OpdError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_generate_shapes_and_logprobs_match_forward(engine, pico_model, tokenizer):
    out = engine.generate(PROMPTS, n=3, params=SamplingParams(max_new_tokens=6, seed=1))
    assert len(out) == 3 and all(len(group) == 3 for group in out)
    stops = {tokenizer.convert_tokens_to_ids("\n"), tokenizer.eos_token_id}
    for prompt, group in zip(PROMPTS, out, strict=True):
        for r in group:
            assert isinstance(r, Rollout) and r.prompt == prompt
            assert r.prompt_ids == tokenizer(prompt, add_special_tokens=False).input_ids
            assert 1 <= len(r.completion_ids) <= 6
            assert len(r.logprobs) == len(r.completion_ids)
            # A stop token may only be the last token; it is kept with its logprob.
            assert not stops & set(r.completion_ids[:-1])
            if len(r.completion_ids) < 6:
                assert r.completion_ids[-1] in stops
            assert r.text == tokenizer.decode(r.completion_ids, skip_special_tokens=True)
            # Left-padded batched KV-cache sampling gives the same numbers as one clean forward pass.
            ref = _forward_logprobs(pico_model, r.prompt_ids, r.completion_ids)
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)


def test_one_token_prompt_next_to_longer_ones(engine, pico_model, tokenizer):
    # Prompts are prefilled once per group from a shared left-padded cache; a one-token prompt has
    # nothing to prefill, and its samples must still match a clean forward pass.
    out = engine.generate(["7", *PROMPTS], n=3, params=SamplingParams(max_new_tokens=4, seed=2))
    assert [r.prompt for r in out[0]] == ["7"] * 3 and [len(g) for g in out] == [3] * 4
    for group in out:
        for r in group:
            ref = _forward_logprobs(pico_model, r.prompt_ids, r.completion_ids)
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)
    solo = engine.generate(["7"], n=3, params=SamplingParams(max_new_tokens=4, seed=2))
    assert len(solo[0]) == 3 and all(len(r.logprobs) == len(r.completion_ids) for r in solo[0])


def test_logprobs_are_temperature_one_even_when_sampling_hot(engine, pico_model):
    out = engine.generate(PROMPTS[:1], n=2, params=SamplingParams(temperature=2.0, top_k=5, seed=3))
    for r in out[0]:
        ref = _forward_logprobs(pico_model, r.prompt_ids, r.completion_ids)
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)


def test_stops_at_newline(pico_model, tokenizer):
    # Zero output weights plus a bias of -1e4 on every other token: every sample is exactly "\n".
    nl = tokenizer.convert_tokens_to_ids("\n")
    with torch.no_grad():
        pico_model.lm_head.weight.zero_()
        bias = torch.full((pico_model.config.vocab_size,), -1e4)
        bias[nl] = 0.0
    pico_model.lm_head.bias = torch.nn.Parameter(bias)
    engine = EmbeddedEngine(pico_model, tokenizer)
    out = engine.generate(["1+1="], n=2, params=SamplingParams(max_new_tokens=5, seed=0))
    for r in out[0]:
        assert r.completion_ids == [nl] and r.text == "\n"
        assert r.logprobs[0] == pytest.approx(0.0, abs=1e-4)


def test_seeded_determinism(engine):
    params = SamplingParams(max_new_tokens=6, seed=7)
    a = engine.generate(PROMPTS, n=2, params=params)
    b = engine.generate(PROMPTS, n=2, params=params)
    assert [[r.completion_ids for r in g] for g in a] == [[r.completion_ids for r in g] for g in b]
    c = engine.generate(PROMPTS, n=2, params=SamplingParams(max_new_tokens=6, seed=8))
    assert [[r.completion_ids for r in g] for g in a] != [[r.completion_ids for r in g] for g in c]


def test_greedy_and_small_batches_agree(pico_model, tokenizer):
    # Batch size 1 vs one big batch: padding must not change greedy answers.
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    big = EmbeddedEngine(pico_model, tokenizer).generate(PROMPTS, n=1, params=params)
    small = EmbeddedEngine(pico_model, tokenizer, batch_size=1).generate(PROMPTS, n=1, params=params)
    assert [g[0].completion_ids for g in big] == [g[0].completion_ids for g in small]


def test_score_equals_forward(engine, pico_model, tokenizer):
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    completions = [tokenizer(c, add_special_tokens=False).input_ids for c in ["19\n", "cba", "81\n"]]
    scores = engine.score(prompts, completions)
    for p, c, s in zip(prompts, completions, scores, strict=True):
        assert len(s) == len(c)
        ref = _forward_logprobs(pico_model, p, c)
        torch.testing.assert_close(torch.tensor(s), torch.tensor(ref), atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        engine.score(prompts, completions[:1])


def test_sync_weights_copies(pico_model, tokenizer):
    torch.manual_seed(1)
    other = type(pico_model)(pico_model.config)
    engine = EmbeddedEngine(pico_model, tokenizer)
    engine.sync_weights(other)
    for a, b in zip(pico_model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_top_k_zero_overrides_model_default(pico_model, tokenizer):
    # A checkpoint default of top_k=1 must not leak in: SamplingParams.top_k=0 means no cut, so the
    # near-uniform random pico model gives several different first tokens over 16 samples.
    pico_model.generation_config.top_k = 1
    out = EmbeddedEngine(pico_model, tokenizer).generate(["1+1="], n=16, params=SamplingParams(seed=0))
    assert len({r.completion_ids[0] for r in out[0]}) > 1
