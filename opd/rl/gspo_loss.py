"""GSPO loss maths (Zheng et al. 2025, "Group Sequence Policy Optimization"): pure tensor functions.

Shapes: P prompts, G samples per prompt, B = P*G sequences, T completion tokens (right-padded,
`mask` is 1 on real completion tokens), V vocabulary.
"""

from __future__ import annotations

from typing import Literal

import torch

Level = Literal["sequence", "token"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over entries where `mask` is 1; an empty row gives 0 (not NaN).

    x, mask: same shape. dim=None: scalar; else the mean over `dim`.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages: (r - mean_g r) / (std_g r + eps) within each prompt's group.

    rewards: (P, G) -> (P, G). The std is the population std (correction 0), so a group of two
    rewards {1, 0} gives exactly {+1, -1} up to eps. A group whose rewards are all equal carries no
    learning signal and gives zeros.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (P, G), got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)  # (P, 1)
    std = rewards.std(dim=1, keepdim=True, correction=0)  # (P, 1)
    return (rewards - mean) / (std + eps)


def sequence_log_ratio(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised log importance ratio of each sequence: log s_i = mean_t (logp_new - logp_old).

    logp_new, logp_old, mask: (B, T) -> (B,). GSPO normalises by length so that ratios of long and
    short answers live on one scale and a single clip range fits both.
    """
    return masked_mean(logp_new - logp_old, mask, dim=1)


def k3_kl(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(new || ref) on samples from `new`: exp(d) - d - 1, d = ref - new.

    (B, T) -> (B, T). Unbiased and always >= 0 (Schulman, "Approximating KL divergence", 2020).
    """
    d = logp_ref - logp_new
    return torch.exp(d) - d - 1.0


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at each position: (..., V) -> (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def truncated_is_weights(
    logp_trainer: torch.Tensor,
    logp_engine: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None,
    level: Level = "sequence",
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Truncated importance sampling (TIS, Yao et al. 2025) for the rollout engine's numerics: samples
    come from the engine's pi_e, the objective is written for the trainer's pi_t, so each sample is
    weighted by w = min(pi_t / pi_e, cap). No gradient flows through w.

    logp_trainer, logp_engine, mask: (B, T) log-probs of the sampled tokens under the trainer's copy of
    the sampling policy and as the engine reported them. level="sequence": r_i = exp(mean_t(logp_trainer
    - logp_engine)), length-normalised like GSPO's ratio -> w (B,); level="token": r_it = exp(logp_trainer
    - logp_engine) -> w (B, T). cap None: no weights (None), only the stats.

    Returns (w, stats): the distribution of r over sequences (token level: over masked tokens) as
    engine_ratio_mean/min/max/p10/p50/p90, and tis_truncated, the share of r above cap.
    """
    with torch.no_grad():
        diff = (logp_trainer - logp_engine).float()
        if level == "sequence":
            r = torch.exp(masked_mean(diff, mask, dim=1))  # (B,)
            values = r
        else:
            r = torch.exp(diff)  # (B, T)
            values = r[mask.bool()]
        if values.numel() == 0:
            values = torch.ones(1, device=values.device)
        q = torch.quantile(values, torch.tensor([0.1, 0.5, 0.9], device=values.device))
        stats = {"engine_ratio_mean": values.mean().item(), "engine_ratio_min": values.min().item(),
                 "engine_ratio_max": values.max().item(), "engine_ratio_p10": q[0].item(),
                 "engine_ratio_p50": q[1].item(), "engine_ratio_p90": q[2].item(),
                 "tis_truncated": (values > cap).float().mean().item() if cap is not None else 0.0}
        weights = torch.clamp(r, max=cap).to(logp_trainer.dtype) if cap is not None else None
    return weights, stats


def gspo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    level: Level = "sequence",
    kl_coef: float = 0.0,
    logp_ref: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GSPO objective, negated for minimisation.

    logp_new: (B, T) log-probs of the sampled tokens under the policy being trained (carries grad).
    logp_old: (B, T) the same under the policy that sampled them (no grad).
    advantages: (B,) per sequence; with level="token" also (B, T) per token.
    mask: (B, T) 1 on completion tokens.
    logp_ref: (B, T) under a frozen reference; needed when kl_coef > 0.

    level="sequence": s_i = exp(sequence_log_ratio); loss = -mean_i min(s_i A_i, clip(s_i) A_i),
    clip(s) = clamp(s, 1 - eps_low, 1 + eps_high).
    level="token" (GSPO-token): s_it = sg[s_i] * exp(logp_new_t - sg[logp_new_t]); its value is s_i
    and its gradient s_i * grad logp_new_t, so per-token advantages can be used. The per-token terms
    are averaged over each sequence's tokens, then over sequences: with A constant within a sequence
    this equals the sequence level in value and gradient.
    kl_coef > 0 adds kl_coef * mean_i mean_t k3(new, ref).
    is_weights: (B,), or (B, T) at the token level, multiplies each clipped term (no gradient), e.g.
    the truncated importance weights of `truncated_is_weights`.

    Returns (loss scalar, stats) with stats: ratio_mean/min/max (of s_i over sequences),
    clip_fraction (share of sequences, token level: of tokens averaged per sequence, where the clip
    removed the gradient: A > 0 and s > 1 + eps_high, or A < 0 and s < 1 - eps_low) and kl.
    """
    if level not in ("sequence", "token"):
        raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")
    mask = mask.to(logp_new.dtype)
    log_s = sequence_log_ratio(logp_new, logp_old, mask)  # (B,)
    s = torch.exp(log_s)  # (B,)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high

    if level == "sequence":
        if advantages.dim() != 1:
            raise ValueError(f"sequence-level GSPO needs advantages of shape (B,), got {tuple(advantages.shape)}")
        adv = advantages.to(s.dtype)
        obj = torch.minimum(s * adv, torch.clamp(s, lo, hi) * adv)  # (B,)
        if is_weights is not None:
            if is_weights.dim() != 1:
                raise ValueError(f"sequence-level GSPO needs is_weights of shape (B,), got {tuple(is_weights.shape)}")
            obj = obj * is_weights.detach()
        policy_loss = -obj.mean()
        clipped = ((adv > 0) & (s > hi)) | ((adv < 0) & (s < lo))  # (B,)
        clip_fraction = clipped.float().mean()
    else:
        adv = advantages.to(s.dtype)
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(logp_new)  # (B, T)
        s_tok = torch.exp(log_s.detach()[:, None] + logp_new - logp_new.detach())  # (B, T), value s_i
        obj = torch.minimum(s_tok * adv, torch.clamp(s_tok, lo, hi) * adv)  # (B, T)
        if is_weights is not None:
            w = is_weights.detach()
            obj = obj * (w[:, None] if w.dim() == 1 else w)
        policy_loss = -masked_mean(obj, mask, dim=1).mean()
        clipped = ((adv > 0) & (s_tok > hi)) | ((adv < 0) & (s_tok < lo))  # (B, T)
        clip_fraction = masked_mean(clipped.to(mask.dtype), mask, dim=1).mean()

    kl = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    if kl_coef > 0.0:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs logp_ref")
        kl = masked_mean(k3_kl(logp_new, logp_ref), mask, dim=1).mean()
    loss = policy_loss + kl_coef * kl

    with torch.no_grad():
        stats = {
            "ratio_mean": s.mean().item(),
            "ratio_min": s.min().item(),
            "ratio_max": s.max().item(),
            "clip_fraction": clip_fraction.item(),
            "kl": kl.item(),
        }
    return loss, stats
