"""One OPD rollout batch: student samples, routed teacher scores, and the tensors the update needs."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from opd_kernels import selective_log_softmax

from opd.capabilities import get_capability, prompt_texts
from opd.distill.routing import Routes
from opd.distill.teacher_bank import TeacherBank
from opd.distill.teachers import Teacher, completion_hidden, lm_head_weight, teacher_targets
from opd.rl.batch import completion_targets, pad_sequences
from opd.rl.distill_loss import scatter_tokens
from opd.rl.estimators import TeacherOutputs
from opd.rl.packing import Layout, TokenRows, hidden_at, lay_out, padded_rows
from opd.rollout import SamplingParams


@dataclass
class OpdBatch:
    """B = prompts x group rows, T completion tokens, K teachers (in `names` order), N real tokens."""

    ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    attn: torch.Tensor  # (B, L)
    cmask: torch.Tensor  # (B, T)
    plen: torch.Tensor  # (B,)
    targets: torch.Tensor  # (B, T) the sampled completion tokens
    old_lp: torch.Tensor | None  # (B, T) student log-probs at sampling time (None when no loss needs them)
    teacher_lp: torch.Tensor  # (K, B, T) each teacher's log-prob of the sampled tokens (0 where unrouted)
    weights: torch.Tensor  # (K, B) teacher k's share of row b's target (columns sum to 1)
    rewards: torch.Tensor | None  # (P, G) verifier rewards (None under verifier: none: never computed)
    row_caps: list[str]  # (B,) capability of each row
    names: list[str]  # (K,) teacher names
    gen_tokens: int
    # With a TeacherBank: each real token's full-vocabulary target, the normalised geometric mixture
    # of its teachers (N, V), and its normaliser (N,) (sum_k w_k KL_k = KL(s || target) - log_z).
    target: torch.Tensor | None = None
    log_z: torch.Tensor | None = None
    # Each row's token ids (the packed layout lays out any subset of rows from them) and the layout
    # the update reads the student's hidden states in.
    prompts: list[list[int]] | None = None
    completions: list[list[int]] | None = None
    pad_id: int = 0
    layout: Layout = "padded"
    group: int = 1  # samples per prompt: rows are prompt-major, `group` rows per prompt
    # Packed: the layouts of the minibatches the update will draw (keyed by their rows), laid out ahead
    # by the sampling worker (`Sampler`), so the update process does not spend its time on them.
    laid: dict[tuple[int, ...], TokenRows] | None = None

    def token_rows(self, rows: torch.Tensor) -> TokenRows:
        """Rows `rows` of the batch laid out for `hidden_at`: the batch's own padded tensors (so the
        padded layout is exactly the forward the loop always ran), or packed afresh."""
        if self.layout == "padded":
            return padded_rows(self.ids[rows], self.attn[rows], self.plen[rows], self.cmask[rows])
        r = rows.tolist()
        if self.laid is not None and tuple(r) in self.laid:
            return self.laid[tuple(r)].to(self.ids.device)
        return lay_out([self.prompts[b] for b in r], [self.completions[b] for b in r], self.pad_id,
                       "packed").to(self.ids.device)

    def lay_out_ahead(self, n: int, generator: torch.Generator) -> None:
        """Packed: lay out now the `n` minibatches that `minibatches(self, n, generator)` draws (the
        generator is used up, so pass one seeded as the update's will be)."""
        if self.layout == "packed":
            self.laid = {tuple(rows.tolist()): self.token_rows(rows) for rows in minibatches(self, n, generator)}


def minibatches(batch: OpdBatch, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """`n` random minibatches of row indices (drawn from `generator`, default torch's global one). Packed:
    whole groups (a group's prompt is laid out once), which for one sample per prompt is the padded
    layout's row split."""
    B = len(batch.cmask)
    if batch.layout == "padded":
        return torch.randperm(B, generator=generator).to(batch.cmask.device).chunk(n)
    G = batch.group  # rows are prompt-major, G per prompt
    groups = torch.randperm(B // G, generator=generator).to(batch.cmask.device).chunk(n)
    return tuple((g[:, None] * G + torch.arange(G, device=g.device)).reshape(-1) for g in groups)


def sample_batch(engine, routes: Routes, mix: dict[str, float], rng: random.Random, *, prompts: int, group: int,
                 temperature: float, max_new_tokens: int | None, seed: int):
    """Draw prompts from the routed capabilities by `mix` and sample `group` completions each.
    Returns (items, groups) with groups[i][j] sample j of items[i]."""
    caps = rng.choices(list(mix), weights=list(mix.values()), k=prompts)
    items = [get_capability(c).sample(rng, "train") for c in caps]
    cap_tokens = max(get_capability(c).max_new_tokens for c in routes) + 1
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens or cap_tokens, seed=seed)
    return items, engine.generate(prompt_texts(items, getattr(engine, "tokenizer", None)), group, params)


@torch.no_grad()
def build_batch(student, items, groups, teachers: dict[str, Teacher], routes: Routes, pad_id: int,
                kernel_chunk: int = 1024, bank: TeacherBank | None = None, old_lp: bool = True,
                layout: Layout = "padded", rewards: bool = True) -> OpdBatch:
    """Score every student token under each routed teacher and, with `old_lp`, under the student
    itself (the GSPO ratio's old policy: the sampled estimator and a reward term need it; the full
    estimator alone does not, and skipping it saves one student forward per batch). `rewards` False
    (verifier: none): no capability's reward is called and the batch carries none.

    With `bank` (every teacher in process, one architecture) all teachers score in one stacked
    forward that also yields the full-vocabulary targets; otherwise each teacher's engine scores its
    rows (an SGLang server, or one in-process forward per teacher)."""
    rollouts = [r for g in groups for r in g]
    row_caps = [it.capability for it, g in zip(items, groups) for _ in g]
    scores = torch.tensor([[get_capability(it.capability).verify(r.text, it.answer) for r in g]
                           for it, g in zip(items, groups)], dtype=torch.float32) if rewards else None  # (P, G)
    device = next(student.parameters()).device
    padded = pad_sequences([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    ids, attn, cmask, plen = (x.to(device) for x in padded)
    B, T = cmask.shape
    targets = completion_targets(ids, plen, T)
    real = cmask.bool()
    prompts, completions = [list(r.prompt_ids) for r in rollouts], [list(r.completion_ids) for r in rollouts]
    if old_lp:  # the same chunked head as the update, so the first update's ratio is exactly 1
        rows = (padded_rows(ids, attn, plen, cmask) if layout == "padded"
                else lay_out(prompts, completions, pad_id, "packed").to(device))
        h = hidden_at(student, rows, last_mlp_at_index=True)  # (N, H), as the update's StudentHidden
        old_lp = scatter_tokens(selective_log_softmax(h, lm_head_weight(student), targets[real], kernel_chunk),
                                cmask)
    else:
        old_lp = None
    names = sorted({t for ts in routes.values() for t in ts})
    weights = torch.tensor([[routes.get(c, {}).get(name, 0.0) for c in row_caps] for name in names],
                           dtype=torch.float32).reshape(len(names), B).to(device)
    target = log_z = None
    if layout == "packed" and bank is not None and bank.names == names and bank.fits_tokens(
            int(((weights > 0).float() @ cmask.sum(1)).sum())):
        target, log_z, teacher_lp = bank.score_packed(prompts, completions, pad_id, targets, cmask, weights)
    elif bank is not None and bank.names == names and bank.fits(int((weights > 0).sum(1).max()), T):
        target, log_z, teacher_lp = bank.score(ids, attn, plen, targets, weights)
        teacher_lp = teacher_lp * cmask  # (K, B, T): 0 on padding, as the engines return nothing there
        target, log_z = target[real], log_z[real]  # (N, V), (N,)
    else:
        teacher_lp = torch.zeros(len(names), B, T)
        for k, name in enumerate(names):
            rows = weights[k].nonzero().squeeze(1).tolist()
            if not rows:
                continue
            scored = teachers[name].engine.score([rollouts[b].prompt_ids for b in rows],
                                                 [rollouts[b].completion_ids for b in rows])
            for b, lps in zip(rows, scored):
                teacher_lp[k, b, : len(lps)] = torch.tensor(lps)
    return OpdBatch(ids, attn, cmask, plen, targets, old_lp, teacher_lp.to(device), weights,
                    None if scores is None else scores.to(device), row_caps, names, gen_tokens=int(cmask.sum()),
                    target=target, log_z=log_z, prompts=prompts, completions=completions, pad_id=pad_id,
                    layout=layout, group=B // len(items))


@torch.no_grad()
def teacher_hidden(batch: OpdBatch, teachers: dict[str, Teacher]) -> list[torch.Tensor]:
    """Per teacher, its final hidden states at every real token (N, H), zeros on tokens it does not
    serve: the full estimator's constant targets, computed once per batch on the routed rows only."""
    real = batch.cmask.bool()  # (B, T)
    tok_index = torch.full(real.shape, -1, dtype=torch.long, device=real.device)
    tok_index[real] = torch.arange(int(real.sum()), device=real.device)
    out = []
    T = batch.cmask.shape[1]
    for k, name in enumerate(batch.names):
        model = teachers[name].model
        if model is None:
            raise ValueError(f"teacher {name!r} has no in-process model: the full and top-k estimators need its "
                             "hidden states")
        rows = batch.weights[k].nonzero().squeeze(1)
        h = torch.zeros(int(real.sum()), model.config.hidden_size, device=real.device)
        if len(rows):
            hk = completion_hidden(model, batch.ids[rows], batch.attn[rows], batch.plen[rows], T)  # (b, T, H)
            h[tok_index[rows][real[rows]]] = hk[real[rows]].float()
        out.append(h)
    return out


def teacher_outputs(batch: OpdBatch, teachers: dict[str, Teacher], logits: bool,
                    topk: int | None = None) -> TeacherOutputs:
    """What the batch's teachers gave, as the estimators (opd.rl.estimators) read it. `logits`: the
    estimator reads the teachers' full distributions; without the stacked forward's target, each
    teacher's hidden states are computed here (once per batch) with its LM head. `topk` K: each token's
    teacher's K most likely tokens and their log-probs (`teacher_topk_of`)."""
    hidden = heads = None
    if logits and batch.target is None:
        hidden = teacher_hidden(batch, teachers)  # K x (N, H)
        heads = [lm_head_weight(teachers[n].model) for n in batch.names]
    top_ids = top_lp = None
    if topk is not None:
        top_ids, top_lp = teacher_topk_of(batch, teachers, topk)
    return TeacherOutputs(batch.names, batch.weights, batch.teacher_lp, batch.target, batch.log_z, hidden, heads,
                          top_ids, top_lp)


@torch.no_grad()
def teacher_topk_of(batch: OpdBatch, teachers: dict[str, Teacher], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each real token's teacher's k most likely tokens and their log-probs, (N, k) each, in the batch's
    token order: each teacher's `teacher_targets` over the rows routed to it (its model in process, or the
    top-k log-probs of its server or actor), once per batch. Every row has one teacher (`distill` refuses
    routes that mix teachers under teacher_topk)."""
    real = batch.cmask.bool()  # (B, T)
    tok_index = torch.full(real.shape, -1, dtype=torch.long, device=real.device)
    tok_index[real] = torch.arange(int(real.sum()), device=real.device)
    N, device = int(real.sum()), batch.cmask.device
    if batch.target is not None:  # the stacked bank's per-token target: with one teacher a row, its log-probs
        lps, ids = batch.target.topk(min(k, batch.target.shape[-1]), -1)
        return ids, lps
    parts = []
    for j, name in enumerate(batch.names):
        rows = batch.weights[j].nonzero().squeeze(1)
        if len(rows):
            top = teacher_targets(teachers[name], [(batch.prompts[b], batch.completions[b]) for b in rows.tolist()],
                                  batch.pad_id, batch.layout, topk=k)
            parts.append((tok_index[rows][real[rows]], top))  # the rows' tokens, in row order as returned
    width = min((top.ids.shape[1] for _, top in parts), default=k)  # k, or the vocabulary where k exceeds it
    ids, lps = torch.zeros(N, width, dtype=torch.long, device=device), torch.zeros(N, width, device=device)
    for at, top in parts:
        ids[at], lps[at] = top.ids[:, :width].long().to(device), top.logprobs[:, :width].to(device)
    return ids, lps
