"""GSPO maths against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from opd.rl.gspo_loss import (
    entropy_from_logits,
    group_advantages,
    gspo_loss,
    k3_kl,
    masked_mean,
    sequence_log_ratio,
    truncated_is_weights,
)


def test_group_advantages_by_hand():
    # Group {1, 0}: mean 0.5, population std 0.5 -> (+0.5/0.5, -0.5/0.5) = (+1, -1).
    # Group {2, 2}: no variance -> zeros. Group {1, 0, 0, 0}: mean 0.25, std sqrt(0.25*0.75) = 0.4330,
    # so 0.75/0.4330 = 1.7321 and -0.25/0.4330 = -0.5774.
    adv = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0], [1.0, 0.0, 0.0, 0.0]]))
    expected = torch.tensor([[1.0, -1.0, 1.0, -1.0], [0.0, 0.0, 0.0, 0.0], [1.7321, -0.5774, -0.5774, -0.5774]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)
    assert torch.all(adv[1] == 0)


def test_group_advantages_refuses_flat_input():
    with pytest.raises(ValueError, match=r"\(P, G\)"):
        group_advantages(torch.zeros(4))


def test_sequence_log_ratio_is_length_normalised():
    # Row 0: two real tokens, each new - old = +0.5; the padded third token must be ignored -> 0.5.
    # Row 1: one real token with difference -0.3 -> -0.3. Row 2: no tokens -> 0, not NaN.
    new = torch.tensor([[-1.0, -2.0, 9.0], [-0.4, 5.0, 5.0], [1.0, 1.0, 1.0]])
    old = torch.tensor([[-1.5, -2.5, 0.0], [-0.1, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(sequence_log_ratio(new, old, mask), torch.tensor([0.5, -0.3, 0.0]))


def _three_sequences():
    # One token per sequence so each log ratio is simply new - old.
    # seq 0: ratio 1, A = +2 -> inside the clip range, objective 2.
    # seq 1: ratio e^0.01 = 1.01005 > 1 + 4e-4, A = +1 -> clipped to 1.0004 (no gradient).
    # seq 2: ratio e^-0.01 = 0.99005 < 1 - 3e-4, A = -1 -> min(-0.99005, -0.9997) = -0.9997, clipped.
    old = torch.tensor([[-1.0], [-1.0], [-1.0]])
    new = (old + torch.tensor([[0.0], [0.01], [-0.01]])).requires_grad_(True)
    adv = torch.tensor([2.0, 1.0, -1.0])
    mask = torch.ones(3, 1)
    return new, old, adv, mask


def test_gspo_sequence_loss_by_hand():
    new, old, adv, mask = _three_sequences()
    loss, stats = gspo_loss(new, old, adv, mask)
    # loss = -(2 + 1.0004 - 0.9997) / 3 = -0.66690
    assert loss.item() == pytest.approx(-(2.0 + 1.0004 - 0.9997) / 3, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    assert stats["ratio_min"] == pytest.approx(math.exp(-0.01), abs=1e-6)
    assert stats["ratio_max"] == pytest.approx(math.exp(0.01), abs=1e-6)
    assert stats["kl"] == 0.0
    loss.backward()
    # Only seq 0 is unclipped: d/d logp_new = -(1/B) * A * s / T = -(1/3) * 2 * 1 / 1.
    torch.testing.assert_close(new.grad, torch.tensor([[-2.0 / 3], [0.0], [0.0]]))


def test_clip_keeps_gradient_in_the_helpful_direction():
    # Ratio above 1 + eps_high but advantage negative: min picks the unclipped term, gradient flows.
    # loss = -(s * A) with s = e^0.01, A = -1; d loss / d logp = -A * s = e^0.01.
    old = torch.tensor([[-1.0]])
    new = (old + 0.01).requires_grad_(True)
    loss, stats = gspo_loss(new, old, torch.tensor([-1.0]), torch.ones(1, 1))
    loss.backward()
    assert stats["clip_fraction"] == 0.0
    assert new.grad.item() == pytest.approx(math.exp(0.01), abs=1e-6)


def test_sequence_gradient_spreads_over_tokens():
    # One sequence of 2 tokens, equal logps: s = 1, A = 3. loss = -s*A, d s / d logp_t = s / T = 1/2,
    # so each token gets gradient -3 / 2; the padded third token gets 0.
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    new = old.clone().requires_grad_(True)
    loss, _ = gspo_loss(new, old, torch.tensor([3.0]), torch.tensor([[1, 1, 0]]))
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.5, -1.5, 0.0]]))


def test_token_level_matches_sequence_level_with_constant_advantages():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    old = -torch.rand(B, T, generator=g) * 3
    # Differences of about +-0.05 put some sequences inside and some outside the clip range.
    delta = (torch.rand(B, T, generator=g) - 0.5) * 0.1
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    adv = torch.randn(B, generator=g)
    grads, losses = [], []
    for level in ("sequence", "token"):
        new = (old + delta).requires_grad_(True)
        loss, stats = gspo_loss(new, old, adv, mask, eps_low=0.01, eps_high=0.02, level=level)
        loss.backward()
        grads.append(new.grad)
        losses.append((loss.item(), stats["clip_fraction"]))
    assert losses[0][0] == pytest.approx(losses[1][0], abs=1e-6)
    assert losses[0][1] == pytest.approx(losses[1][1])
    assert 0 < losses[0][1] < 1
    torch.testing.assert_close(grads[0], grads[1])


def test_token_level_with_per_token_advantages_by_hand():
    # s = 1; advantages (+1, -1) on the two tokens: objective mean(1, -1) = 0.
    # d loss / d logp_t = -(1/B)(1/T) s A_t = (-0.5, +0.5).
    old = torch.tensor([[-1.0, -1.0]])
    new = old.clone().requires_grad_(True)
    loss, _ = gspo_loss(new, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), level="token")
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    torch.testing.assert_close(new.grad, torch.tensor([[-0.5, 0.5]]))


def test_kl_k3_by_hand():
    # ref - new = ln 2 -> k3 = e^{ln 2} - ln 2 - 1 = 2 - 0.693147 - 1 = 0.306853.
    new = torch.tensor([[-2.0, -2.0]])
    ref = new + math.log(2.0)
    torch.testing.assert_close(k3_kl(new, ref), torch.full((1, 2), 2 - math.log(2) - 1))
    # In the loss: A = 0 leaves only the KL term, so loss = 0.1 * 0.306853.
    loss, stats = gspo_loss(new, new, torch.zeros(1), torch.ones(1, 2), kl_coef=0.1, logp_ref=ref)
    assert stats["kl"] == pytest.approx(0.306853, abs=1e-6)
    assert loss.item() == pytest.approx(0.0306853, abs=1e-7)


def test_kl_needs_reference_and_bad_level_refused():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="logp_ref"):
        gspo_loss(x, x, torch.zeros(1), torch.ones(1, 1), kl_coef=0.1)
    with pytest.raises(ValueError, match="level"):
        gspo_loss(x, x, torch.zeros(1), torch.ones(1, 1), level="tokens")
    with pytest.raises(ValueError, match=r"\(B,\)"):
        gspo_loss(x, x, torch.zeros(1, 1), torch.ones(1, 1))


def test_helpers():
    # Uniform over 4 -> entropy ln 4; one-hot-ish logits -> about 0.
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ent, torch.tensor([math.log(4), 0.0]), atol=1e-5, rtol=0)
    assert masked_mean(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0])).item() == 2.0


def test_truncated_is_weights_by_hand():
    # Sequence 0: the trainer gives both tokens 0.5 more log-prob than the engine, r = e^0.5 = 1.6487,
    # cut to the cap 1.5. Sequence 1: one real token, 0.5x as likely for the trainer, r = 0.5; its
    # padded second token (engine -9) is ignored.
    trainer = torch.tensor([[-1.0, -2.0], [-0.5 - math.log(2), 0.0]])
    engine = torch.tensor([[-1.5, -2.5], [-0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w, st = truncated_is_weights(trainer, engine, mask, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([1.5, 0.5]))
    assert st["engine_ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert st["engine_ratio_min"] == pytest.approx(0.5, rel=1e-6)
    assert st["engine_ratio_mean"] == pytest.approx((math.exp(0.5) + 0.5) / 2, rel=1e-6)
    # Quantiles interpolate linearly between the two sorted ratios 0.5 and e^0.5.
    assert st["engine_ratio_p50"] == pytest.approx((0.5 + math.exp(0.5)) / 2, rel=1e-6)
    assert st["engine_ratio_p10"] == pytest.approx(0.5 + 0.1 * (math.exp(0.5) - 0.5), rel=1e-6)
    assert st["tis_truncated"] == 0.5
    # Token level: per-token ratios e^0.5, e^0.5, 0.5 over the masked tokens.
    w_tok, st_tok = truncated_is_weights(trainer, engine, mask, cap=1.5, level="token")
    torch.testing.assert_close(w_tok[mask.bool()], torch.tensor([1.5, 1.5, 0.5]))
    assert st_tok["tis_truncated"] == pytest.approx(2 / 3)
    # cap None (the default setting): no weights, the distribution is still reported.
    w_none, st_none = truncated_is_weights(trainer, engine, mask, cap=None)
    assert w_none is None and st_none["engine_ratio_min"] == pytest.approx(0.5, rel=1e-6)


def test_gspo_loss_with_is_weights_by_hand():
    # On-policy (s = 1), advantages +1 and -1: unweighted the terms cancel, loss 0. Weighted by
    # 1.5 and 0.5: loss = -(1.5 * 1 + 0.5 * -1) / 2 = -0.5, and d/d logp_new of sequence 0's single
    # token is -(1/B) * w * A * s / T = -(1/2) * 1.5 = -0.75.
    new = torch.zeros(2, 1, requires_grad=True)
    old, mask, adv = torch.zeros(2, 1), torch.ones(2, 1), torch.tensor([1.0, -1.0])
    assert gspo_loss(new, old, adv, mask)[0].item() == pytest.approx(0.0)
    loss, _ = gspo_loss(new, old, adv, mask, is_weights=torch.tensor([1.5, 0.5]))
    assert loss.item() == pytest.approx(-0.5)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-0.75], [0.25]]))
    tok, _ = gspo_loss(new, old, adv, mask, level="token", is_weights=torch.tensor([[1.5], [0.5]]))
    assert tok.item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="is_weights of shape"):
        gspo_loss(new, old, adv, mask, is_weights=torch.ones(2, 1))


def test_gspo_step_logs_engine_ratio_and_applies_tis(pico_model):
    # Engine log-probs 0.5 below the trainer's on every token: r = e^0.5 everywhere, cut to 1.2.
    import pydantic

    from opd.expert.spec import ExpertSpec
    from opd.expert.trainer import gspo_step
    from opd.rl.batch import group_rollouts, grouped_completion_logits, token_logprobs
    from opd.rollout import Rollout

    prompts, completions = [[5, 6], [7]], [[8, 9], [10], [11, 12], [13]]
    batch = group_rollouts([prompts[i // 2] for i in range(4)], completions, pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(grouped_completion_logits(pico_model, batch), batch.completion_ids)  # (4, Tc)
    rollouts = [Rollout("p", prompts[i // 2], c, "t", [float(x) - 0.5 for x in lp[i, : len(c)]])
                for i, c in enumerate(completions)]
    kept = [(rollouts[:2], [1.0, 0.0]), (rollouts[2:], [0.0, 1.0])]
    spec = ExpertSpec(capability="add", gspo={"updates_per_batch": 1, "tis_cap": 1.2})
    opt = torch.optim.SGD(pico_model.parameters(), lr=0.0)
    out = gspo_step(pico_model, opt, None, kept, spec.gspo, pad_id=0)
    assert out["engine_ratio_min"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert out["engine_ratio_p90"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert out["tis_truncated"] == 1.0
    with pytest.raises(pydantic.ValidationError, match="tis_cap needs recompute_old_logprobs"):
        ExpertSpec(capability="add", gspo={"tis_cap": 2.0, "recompute_old_logprobs": False})
