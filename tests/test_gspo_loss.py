"""GSPO maths against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from opd.gspo.loss import (
    entropy_from_logits,
    group_advantages,
    gspo_loss,
    k3_kl,
    masked_mean,
    sequence_log_ratio,
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
