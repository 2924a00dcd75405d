"""The reverse-KL estimators of on-policy distillation, one object each, in one registry.

Each estimator turns one minibatch of the student's forward (`Minibatch`) and what the teachers gave
for the batch (`TeacherOutputs`) into the loss to descend and its logged statistics:

- `sampled`: the per-token advantage -(log pi_s - log pi_t) of each sampled token under GSPO-token's
  clipped objective (opd.rl.distill_loss.sampled_advantages): teacher log-probs only.
- `full`: the exact sum_k w_k KL(pi_s || pi_k) over the whole vocabulary (opd_kernels.reverse_kl).
- `topk`: the reverse KL over the student's top-k tokens plus a tail bucket (`topk_reverse_kl`).
- `teacher_topk`: the reverse KL over each token's teacher's top-k tokens plus a tail bucket
  (`teacher_topk_reverse_kl`): what a teacher that returns only its top k gives (an SGLang server's
  `top_logprobs_num`, a Ray actor's); one teacher per row.

The full and top-k estimators read the teachers' full distributions: either the stacked forward's
precomputed mixture (`target`, `log_z`) or each teacher's hidden states and LM head. A verifier
reward term (`reward_weight` > 0) mixes into the sampled estimator's advantages and adds a GSPO term
to the others'. Pure tensor maths: nothing here knows the loop, the teachers' models or the engines.

Shapes: B rows of the batch, b of the minibatch, T completion slots, K teachers, V vocabulary,
H hidden size, N the batch's real tokens, n the minibatch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from opd_kernels import reverse_kl
from torch.utils.checkpoint import checkpoint

from opd.errors import OpdError
from opd.rl.distill_loss import (
    chunked_teacher_topk_kl,
    mix_teacher_logprobs,
    reward_mixed_advantages,
    sampled_advantages,
    scatter_tokens,
    sequence_mean_loss,
    topk_reverse_kl,
)
from opd.rl.gspo_loss import gspo_loss, k3_kl, masked_mean


@dataclass(frozen=True)
class EstimatorSettings:
    """The distillation settings an estimator reads (a DistillConfig's, see opd.distill.config)."""

    kl_weight: float = 1.0  # weight of the reverse-KL term
    reward_weight: float = 0.0  # weight of the group-normalised verifier reward term
    eps_low: float = 0.2  # GSPO clip below 1
    eps_high: float = 0.28  # GSPO clip above 1
    chunk: int = 1024  # tokens per chunk in the full-vocabulary kernels
    topk: int | None = None  # K of the top-k estimator
    domain_norm: bool = False  # DN-MOPD: scale each domain's per-token loss by clip(sigma_all / sigma_d, 0.25, 4)


@dataclass(frozen=True)
class TeacherOutputs:
    """What the teachers gave for one batch, in `names` order."""

    names: list[str]  # (K,)
    weights: torch.Tensor  # (K, B) teacher k's share of row b's target (0 where it does not serve b)
    logprobs: torch.Tensor  # (K, B, T) each teacher's log-prob of the sampled tokens
    target: torch.Tensor | None = None  # (N, V) the stacked forward's normalised geometric mixture per token
    log_z: torch.Tensor | None = None  # (N,) its normaliser: sum_k w_k KL_k = KL(s || target) - log_z
    hidden: list[torch.Tensor] | None = None  # K x (N, H) each teacher's hidden states (no `target`)
    heads: list[torch.Tensor] | None = None  # K x (V, H) each teacher's LM head (no `target`)
    top_ids: torch.Tensor | None = None  # (N, k) each token's teacher's k most likely tokens (teacher_topk)
    top_lp: torch.Tensor | None = None  # (N, k) their log-probs


@dataclass(frozen=True)
class Minibatch:
    """One minibatch of the student's forward, as the estimators read it."""

    rows: torch.Tensor  # (b,) the batch rows it holds
    mask: torch.Tensor  # (b, T) 1 on real completion tokens
    hidden: torch.Tensor  # (n, H) the student's hidden states predicting each real token (differentiable)
    head: torch.Tensor  # (V, H) the student's LM head
    new_lp: torch.Tensor  # (b, T) the student's log-probs of the sampled tokens (differentiable)
    old_lp: torch.Tensor | None  # (b, T) the sampling policy's (None when no loss reads them)
    tok: torch.Tensor  # (n,) each real token's index among the batch's N real tokens
    row_weights: torch.Tensor  # (b,) each row's capability weight (mean 1 over the batch)
    reward_adv: torch.Tensor | None  # (b,) group-normalised verifier rewards (None without a reward term)
    row_domains: torch.Tensor | None = None  # (b,) each row's capability as an integer id (for domain_norm)

    @property
    def row_of_tok(self) -> torch.Tensor:
        """(n,) each real token's batch row."""
        return self.rows[:, None].expand(-1, self.mask.shape[1])[self.mask.bool()]


class Estimator:
    """An estimator of the reverse KL; `loss` is its one job. `reads_logits`: it needs the teachers'
    full distributions (the stacked target or their hidden states), not only their log-probs of
    the sampled tokens; `reads_old_lp`: it needs the sampling policy's log-probs; `reads_top`: it needs
    each token's teacher's top-k log-probs (`TeacherOutputs.top_ids`, `top_lp`)."""

    name: ClassVar[str]
    reads_logits: ClassVar[bool] = True
    reads_old_lp: ClassVar[bool] = False
    reads_top: ClassVar[bool] = False

    def __init__(self, settings: EstimatorSettings):
        self.s = settings

    def loss(self, mb: Minibatch, teachers: TeacherOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        """The minibatch's loss (a scalar to descend) and its statistics (each teacher's KL as kl/<name>)."""
        raise NotImplementedError

    def batch_stats(self, old_lp: torch.Tensor | None, mask: torch.Tensor, teachers: TeacherOutputs
                    ) -> dict[str, float]:
        """Statistics over the whole batch, logged beside the minibatches' means (none by default)."""
        return {}

    def _row_weights(self, per_token: torch.Tensor, mb: Minibatch) -> torch.Tensor:
        """The rows' loss weights (b,): the capability weights, times DN-MOPD's domain weights of the
        per-token loss terms `per_token` (n,) when `domain_norm` is set."""
        if not self.s.domain_norm or mb.row_domains is None:
            return mb.row_weights
        local = torch.arange(mb.mask.shape[0], device=mb.mask.device)[:, None].expand_as(mb.mask)[mb.mask.bool()]
        w = mb.row_weights * domain_norm_weights(per_token.detach(), mb.row_domains[local], mb.row_domains)
        return w / w.mean()

    def _with_reward(self, kl: torch.Tensor, mb: Minibatch) -> torch.Tensor:
        """The per-token KL (n,) as the sequence-mean loss, capability-weighted, plus the reward's GSPO term."""
        row_w = self._row_weights(kl, mb)
        loss = self.s.kl_weight * sequence_mean_loss(scatter_tokens(kl, mb.mask) * row_w[:, None], mb.mask)
        if self.s.reward_weight > 0:
            pg, _ = gspo_loss(mb.new_lp, mb.old_lp, mb.reward_adv * row_w, mb.mask, self.s.eps_low,
                              self.s.eps_high)
            loss = loss + self.s.reward_weight * pg
        return loss


class SampledKL(Estimator):
    """The sampled tokens' advantages -(log pi_s - log pi_t) (plus the reward's) under GSPO-token's clip."""

    name = "sampled"
    reads_logits = False
    reads_old_lp = True

    def loss(self, mb: Minibatch, teachers: TeacherOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        lp_t = mix_teacher_logprobs(teachers.logprobs[:, mb.rows], teachers.weights[:, mb.rows])  # (b, T)
        adv = self.s.kl_weight * sampled_advantages(mb.old_lp, lp_t, mb.mask)  # (b, T)
        if self.s.reward_weight > 0:
            adv = reward_mixed_advantages(adv, mb.reward_adv, self.s.reward_weight, mb.mask)
        row_w = self._row_weights(adv[mb.mask.bool()], mb)
        adv = adv * row_w[:, None]  # weights > 0 pass through GSPO's min and clip: the per-token loss x w
        loss, st = gspo_loss(mb.new_lp, mb.old_lp, adv, mb.mask, self.s.eps_low, self.s.eps_high, level="token")
        st.pop("kl")  # GSPO's reference-KL penalty is off here; the teacher KLs are logged as kl/<name>
        return loss, st

    def batch_stats(self, old_lp, mask, teachers):
        # k3 (unbiased and never negative, unlike the plain log ratio) for readable per-teacher curves
        real = mask.bool()
        out = {}
        for k, name in enumerate(teachers.names):
            served = (teachers.weights[k] > 0)[:, None] & real  # (B, T)
            if served.any():
                out[f"kl/{name}"] = float(masked_mean(k3_kl(old_lp, teachers.logprobs[k]), served.float()))
        return out


class FullKL(Estimator):
    """Exact sum_k w_k KL(pi_s || pi_k) per token, over the whole vocabulary."""

    name = "full"

    def loss(self, mb: Minibatch, teachers: TeacherOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        kl, st = self.per_token(mb, teachers)
        return self._with_reward(kl, mb), st

    def per_token(self, mb: Minibatch, teachers: TeacherOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        """The KL of each real token (n,) and each teacher's mean over the tokens it serves."""
        h, W, tok, chunk = mb.hidden, mb.head, mb.tok, self.s.chunk
        if teachers.target is not None:  # the stacked mixture: one kernel call for all teachers
            kl = reverse_kl(h, W, teacher_logits=teachers.target[tok], chunk_size=chunk) - teachers.log_z[tok]  # (n,)
            return kl, teacher_means(kl, teachers, mb.row_of_tok)
        row_of_tok = mb.row_of_tok
        kl = torch.zeros(h.shape[0], device=h.device)
        st = {}
        for k, name in enumerate(teachers.names):
            w = teachers.weights[k, row_of_tok]  # (n,)
            sel = (w > 0).nonzero().squeeze(1)
            if not len(sel):
                continue
            kl_k = reverse_kl(h[sel], W, teachers.hidden[k][tok[sel]], teachers.heads[k].detach(),
                              chunk_size=chunk)  # (n_k,)
            kl = kl.index_add(0, sel, w[sel] * kl_k)
            st[f"kl/{name}"] = float(kl_k.detach().mean())
        return kl, st


class TopKKL(Estimator):
    """Top-k reverse KL (`topk_reverse_kl`) against the normalised geometric mixture of each token's
    teachers. The mixture is the stacked forward's target or is built here per chunk from each
    teacher's hidden states; as in `full`, its normaliser log_z is subtracted, so with k >= V this is
    exactly sum_k w_k KL(pi_s || pi_k). Each chunk's (c, V) student logits are recomputed in backward
    (checkpointed), so memory stays at one chunk's, as in the full kernels."""

    name = "topk"

    def loss(self, mb: Minibatch, teachers: TeacherOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        kl, st = self.per_token(mb, teachers)
        return self._with_reward(kl, mb), st

    def per_token(self, mb: Minibatch, teachers: TeacherOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        """The top-k KL of each real token (n,) and each teacher's mean over the tokens it serves."""
        h, W, tok, chunk, k = mb.hidden, mb.head, mb.tok, self.s.chunk, self.s.topk
        row_of_tok = mb.row_of_tok
        parts = []
        for s in range(0, h.shape[0], chunk):
            e = min(s + chunk, h.shape[0])
            with torch.no_grad():
                if teachers.target is not None:
                    target, log_z = teachers.target[tok[s:e]], teachers.log_z[tok[s:e]]  # (c, V), (c,)
                else:
                    mixed = 0
                    for j in range(len(teachers.names)):
                        w = teachers.weights[j, row_of_tok[s:e]]  # (c,)
                        if (w > 0).any():
                            zt = teachers.hidden[j][tok[s:e]] @ teachers.heads[j].float().T  # (c, V)
                            mixed = mixed + w[:, None] * torch.log_softmax(zt, -1)
                    log_z = torch.logsumexp(mixed, -1)
                    target = mixed - log_z[:, None]
            kl = checkpoint(lambda hc, w_, t: topk_reverse_kl(hc.float() @ w_.float().T, t, k), h[s:e], W, target,
                            use_reentrant=False)
            parts.append(kl - log_z)
        kl = torch.cat(parts)  # (n,)
        return kl, teacher_means(kl, teachers, row_of_tok)


class TeacherTopKKL(Estimator):
    """Reverse KL over each token's teacher's top-k tokens and a tail bucket (`teacher_topk_reverse_kl`),
    an exact KL between the (k+1)-way coarsenings, the full KL at k = V. The teacher's top k come from
    wherever it runs (`TeacherOutputs.top_ids`, `top_lp`: an SGLang server, a Ray actor, or in process), so
    this is the estimator past `sampled` that needs no teacher in this process. Each row has one teacher
    (geometric mixtures of teachers with different supports are not defined here). Each chunk's (c, V)
    student logits are recomputed in backward (checkpointed)."""

    name = "teacher_topk"
    reads_logits = False
    reads_top = True

    def loss(self, mb: Minibatch, teachers: TeacherOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        kl = chunked_teacher_topk_kl(mb.hidden, mb.head, teachers.top_ids[mb.tok], teachers.top_lp[mb.tok],
                                     self.s.chunk)  # (n,)
        return self._with_reward(kl, mb), teacher_means(kl, teachers, mb.row_of_tok)


def domain_norm_weights(values: torch.Tensor, tok_domain: torch.Tensor, row_domain: torch.Tensor) -> torch.Tensor:
    """DN-MOPD's per-domain loss weights: (n,) per-token loss terms, (n,) and (b,) their and the rows'
    domain ids -> (b,) each row's clip(sigma_all / sigma_d, 0.25, 4), with sigma_d the standard deviation
    of its domain's terms in this minibatch (weight 1 where a domain has fewer than 2 tokens or sigma_d is 0),
    divided by the mean over the rows so that only the ratios between domains change."""
    sigma_all = values.std() if values.numel() > 1 else values.new_tensor(0.0)
    w_dom = {}
    for d in row_domain.unique().tolist():
        v = values[tok_domain == d]
        sd = v.std() if v.numel() > 1 else v.new_tensor(0.0)
        w_dom[d] = float((sigma_all / sd).clamp(0.25, 4.0)) if float(sd) > 0 and float(sigma_all) > 0 else 1.0
    w = torch.tensor([w_dom[d] for d in row_domain.tolist()], dtype=torch.float32, device=row_domain.device)
    return w / w.mean()


def teacher_means(kl: torch.Tensor, teachers: TeacherOutputs, row_of_tok: torch.Tensor) -> dict[str, float]:
    """Each teacher's mean of the per-token `kl` (n,) over the tokens it serves (the logged kl/<name>)."""
    st = {}
    for k, name in enumerate(teachers.names):
        served = teachers.weights[k, row_of_tok] > 0
        if served.any():
            st[f"kl/{name}"] = float(kl.detach()[served].mean())
    return st


ESTIMATORS: dict[str, type[Estimator]] = {e.name: e for e in (SampledKL, FullKL, TopKKL, TeacherTopKKL)}


def get_estimator(name: str, settings: EstimatorSettings | None = None) -> Estimator:
    """The estimator registered as `name`, configured with `settings` (default: EstimatorSettings())."""
    if name not in ESTIMATORS:
        raise OpdError(f"estimator {name!r} is unknown; estimators opd has: {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](settings or EstimatorSettings())
