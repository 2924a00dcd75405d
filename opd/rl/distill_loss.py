"""Reverse-KL distillation maths: pure tensor functions.

Shapes: B sequences (student samples), T completion tokens (right-padded; `mask` is 1 on real
tokens), K teachers, V vocabulary, N = number of real tokens (mask.sum()).

The student pi_s is trained towards KL(pi_s || pi_t) on its own samples (on-policy, mode-seeking).
With several teachers for one prompt the target is sum_k w_k KL(pi_s || pi_k), sum_k w_k = 1, which
equals KL(pi_s || geometric mixture of the teachers) up to a constant that does not depend on pi_s.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from opd.rl.gspo_loss import masked_mean


def mix_teacher_logprobs(teacher_lp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k w_kb * teacher_lp_kbt: the log-prob target of each sampled token.

    teacher_lp: (K, B, T); weights: (K, B), each column summing to 1 (0 where teacher k does not
    serve row b) -> (B, T).
    """
    return (weights[:, :, None] * teacher_lp).sum(0)


def sampled_advantages(logp_student: torch.Tensor, logp_teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantage A_t = -(log pi_s(y_t) - log pi_t(y_t)), zero on padding.

    (B, T) x 3 -> (B, T). On samples y ~ pi_s, E[log pi_s - log pi_t] is the per-token reverse KL,
    and E[A grad log pi_s] = -grad KL (the score function has zero mean), so a policy-gradient step
    on A descends the reverse KL. logp_student must come from the sampling policy (no grad).
    """
    return -(logp_student - logp_teacher) * mask.to(logp_student.dtype)


def reward_mixed_advantages(token_adv: torch.Tensor, seq_reward_adv: torch.Tensor, weight: float,
                            mask: torch.Tensor) -> torch.Tensor:
    """token_adv + weight * seq_reward_adv broadcast over each sequence's tokens.

    token_adv: (B, T); seq_reward_adv: (B,) group-normalised verifier rewards -> (B, T).
    """
    return token_adv + weight * seq_reward_adv[:, None].to(token_adv.dtype) * mask.to(token_adv.dtype)


def sequence_mean_loss(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's real tokens, then over sequences, as the GSPO-token loss averages:
    (B, T) -> scalar."""
    return masked_mean(per_token, mask, dim=1).mean()


def scatter_tokens(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put per-token values (N,) back in the padded layout (B, T), zero on padding."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    out[mask.bool()] = values
    return out


def topk_reverse_kl(student_logits: torch.Tensor, teacher_lp: torch.Tensor, k: int) -> torch.Tensor:
    """Reverse KL over the student's top-k tokens plus one tail bucket: (N, V), (N, V) -> (N,).

    Per position, both distributions are coarsened to k + 1 outcomes: the student's k most likely
    tokens (chosen without gradient) and one bucket holding the rest of each side's mass, so the
    result is an exact KL between two (k+1)-way distributions, never negative, and 0 only where
    they agree on the top tokens and the tail. k >= V is the full-vocabulary KL (an empty tail).
    The gradient flows through the student's log-probs as in the full estimator's (no score function).

    student_logits: the student's logits (differentiable); teacher_lp: the target's normalised
    log-probs (a constant).
    """
    ls = torch.log_softmax(student_logits.float(), -1)  # (N, V)
    lt = teacher_lp.float()
    k = min(k, ls.shape[-1])
    top = ls.detach().topk(k, -1).indices  # (N, k)
    if k == ls.shape[-1]:
        return _coarse_reverse_kl(ls, top, lt.gather(-1, top), None)
    in_top = torch.zeros_like(ls, dtype=torch.bool).scatter(-1, top, True)  # (N, V)
    # the tail's log-mass as a logsumexp over the other tokens, not log(1 - sum of the top), which
    # loses every digit when the top holds nearly all the mass
    lt_tail = lt.masked_fill(in_top, float("-inf")).logsumexp(-1)
    return _coarse_reverse_kl(ls, top, lt.gather(-1, top), lt_tail, in_top)


# The teacher's tail mass below which `teacher_topk_reverse_kl` treats it as this floor: a server's top-k
# log-probs (rounded, often from bf16) can sum past 1, which leaves no tail to take the log of.
TAIL_FLOOR = 1e-12


def teacher_topk_reverse_kl(student_logits: torch.Tensor, top_ids: torch.Tensor, teacher_top_lp: torch.Tensor
                            ) -> torch.Tensor:
    """Reverse KL over the *teacher's* top-k tokens plus one tail bucket: (N, V), (N, k), (N, k) -> (N,).

    What a teacher that returns only its k most likely tokens per position allows (an SGLang server's
    `top_logprobs_num`, or a cache of k log-probs a token instead of V): both distributions are
    coarsened to those k tokens and one bucket with the rest, the student's tail as a logsumexp over
    its other tokens, the teacher's as 1 - the sum of its top k (floored at TAIL_FLOOR). An exact KL
    between two (k+1)-way distributions, so never above the full KL and 0 where they agree on the
    teacher's top tokens and the tail; with k = V (every token) it is the full-vocabulary KL.

    student_logits: differentiable; top_ids: the teacher's k token ids per position (distinct);
    teacher_top_lp: its normalised log-probs of them (a constant).
    """
    ls = torch.log_softmax(student_logits.float(), -1)  # (N, V)
    top, lt_top = top_ids.long(), teacher_top_lp.float()
    if top.shape[-1] >= ls.shape[-1]:
        return _coarse_reverse_kl(ls, top, lt_top, None)
    in_top = torch.zeros_like(ls, dtype=torch.bool).scatter(-1, top, True)  # (N, V)
    # log(1 - sum exp(lt_top)) through expm1, precise where the top holds nearly all the mass
    lt_tail = torch.log((-torch.expm1(lt_top.logsumexp(-1))).clamp_min(TAIL_FLOOR))
    return _coarse_reverse_kl(ls, top, lt_top, lt_tail, in_top)


def chunked_teacher_topk_kl(h: torch.Tensor, W: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor,
                            chunk: int) -> torch.Tensor:
    """`teacher_topk_reverse_kl` of the student's hidden states h (N, H) under its head W (V, H) against the
    teacher's top tokens (N, k), `chunk` tokens at a time, each chunk's (c, V) logits recomputed in backward
    (checkpointed), so memory stays at one chunk's, as in the full kernels: (N,)."""
    parts = []
    for s in range(0, h.shape[0], chunk):
        e = min(s + chunk, h.shape[0])
        parts.append(checkpoint(lambda hc, w_, i, lp: teacher_topk_reverse_kl(hc.float() @ w_.float().T, i, lp),
                                h[s:e], W, top_ids[s:e], top_lp[s:e], use_reentrant=False))
    return torch.cat(parts) if parts else h.new_zeros(0)


def _coarse_reverse_kl(ls: torch.Tensor, top: torch.Tensor, lt_top: torch.Tensor, lt_tail: torch.Tensor | None,
                       in_top: torch.Tensor | None = None) -> torch.Tensor:
    """KL(student || teacher) between the (k+1)-way coarsenings onto the tokens `top` (N, k) and one tail
    bucket: ls the student's log-probs (N, V), lt_top the teacher's at `top`, lt_tail its tail's
    log-mass (N,) (None: `top` covers the vocabulary, no tail); in_top marks `top` in (N, V)."""
    ls_top = ls.gather(-1, top)  # (N, k)
    kl = (ls_top.exp() * (ls_top - lt_top)).sum(-1)
    if lt_tail is None:
        return kl
    ls_tail = ls.masked_fill(in_top, float("-inf")).logsumexp(-1)  # (N,)
    return kl + ls_tail.exp() * (ls_tail - lt_tail)


def row_capability_weights(row_caps: list[str], weights: dict[str, float] | None) -> torch.Tensor:
    """Each row's loss weight from its capability's (`weights`, default 1), divided by the mean over
    the rows so the batch's mean weight is 1: (B,) rows -> (B,). Every prompt has the same number of
    rows (its group), so this is also the mean over the batch's prompts; the weights move loss between
    capabilities without changing its overall scale (or the lr it suits)."""
    w = torch.tensor([(weights or {}).get(c, 1.0) for c in row_caps], dtype=torch.float32)
    return w / w.mean()
