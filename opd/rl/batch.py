"""Turn rollouts into padded tensors and per-token logprobs under a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


def pad_sequences(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int):
    """Right-pad prompt+completion rows; returns input_ids, attention_mask (B, L) and the
    completion mask (B, Tc) plus each row's prompt length, so logprobs can be gathered."""
    B = len(prompt_ids)
    L = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    Tc = max(len(c) for c in completion_ids)
    # built as Python lists, one tensor each: a row's slice assignment costs more than its ~10 tokens
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    ids = torch.tensor([s + [pad_id] * (L - len(s)) for s in seqs], dtype=torch.long).reshape(B, L)
    attn = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs], dtype=torch.long).reshape(B, L)
    cmask = torch.tensor([[1.0] * len(c) + [0.0] * (Tc - len(c)) for c in completion_ids],
                         dtype=torch.float32).reshape(B, Tc)
    plen = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    return ids, attn, cmask, plen


def completion_logits(model, ids, attn, plen, Tc: int) -> torch.Tensor:
    """Logits that predict each completion token: (B, Tc, V)."""
    logits = model(input_ids=ids, attention_mask=attn).logits  # (B, L, V)
    # token at position plen+j is predicted by logits at plen+j-1
    idx = (plen[:, None] - 1 + torch.arange(Tc, device=ids.device)[None, :]).clamp(max=ids.shape[1] - 1)  # (B, Tc)
    return logits.gather(1, idx[:, :, None].expand(-1, -1, logits.shape[-1]))


def completion_targets(ids, plen, Tc: int) -> torch.Tensor:
    idx = (plen[:, None] + torch.arange(Tc, device=ids.device)[None, :]).clamp(max=ids.shape[1] - 1)  # (B, Tc)
    return ids.gather(1, idx)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target]: (B, Tc, V), (B, Tc) -> (B, Tc)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)  # (B, Tc)


@dataclass
class GroupedBatch:
    """Rollouts as tensors with each distinct prompt stored once (a GSPO group shares its prompt).

    prompt_ids, prompt_attn: (U, Lp) right-padded distinct prompts; prompt_len: (U,).
    completion_ids, cmask: (B, Tc) right-padded completions; row_prompt: (B,) each row's prompt.
    """

    prompt_ids: torch.Tensor
    prompt_attn: torch.Tensor
    prompt_len: torch.Tensor
    completion_ids: torch.Tensor
    cmask: torch.Tensor
    row_prompt: torch.Tensor


def group_rollouts(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                   device: torch.device | str = "cpu") -> GroupedBatch:
    """Pack rows (prompt, completion) into a `GroupedBatch` on `device` (the model's), deduplicating equal prompts."""
    index: dict[tuple[int, ...], int] = {}
    row_prompt = [index.setdefault(tuple(p), len(index)) for p in prompt_ids]
    prompts = list(index)
    Lp, Tc = max(len(p) for p in prompts), max(len(c) for c in completion_ids)
    p_ids = torch.tensor([list(p) + [pad_id] * (Lp - len(p)) for p in prompts], device=device)  # (U, Lp)
    p_len = torch.tensor([len(p) for p in prompts], device=device)
    p_attn = (torch.arange(Lp, device=device)[None, :] < p_len[:, None]).long()
    c_ids = torch.tensor([list(c) + [pad_id] * (Tc - len(c)) for c in completion_ids], device=device)  # (B, Tc)
    c_len = torch.tensor([len(c) for c in completion_ids], device=device)
    cmask = (torch.arange(Tc, device=device)[None, :] < c_len[:, None]).float()
    return GroupedBatch(p_ids, p_attn, p_len, c_ids, cmask, torch.tensor(row_prompt, device=device))


def grouped_completion_logits(model, batch: GroupedBatch, rows: torch.Tensor | None = None,
                              n_grad: int | None = None) -> torch.Tensor:
    """Logits that predict each completion token of `rows` (default: all): (b, Tc, V).

    Each distinct prompt goes through the model once; its KV cache is then gathered per row and
    the completions (all but their last token, which predicts nothing) run on top of it. Same
    values and gradients as one right-padded forward over every prompt+completion row, at a cost of
    U*Lp + b*(Tc-1) token positions instead of b*(Lp+Tc).

    Only the first `n_grad` rows (default: all) carry gradient; the others reuse the prompt pass
    but run without autograd (so a minibatch and the old logprobs of a whole batch share a pass).
    """
    dev = batch.row_prompt.device
    rows = torch.arange(batch.row_prompt.shape[0], device=dev) if rows is None else rows
    n_grad = len(rows) if n_grad is None else n_grad
    used, which = batch.row_prompt[rows].unique(return_inverse=True)  # (u,), (b,): row -> used prompt
    p_attn, p_len = batch.prompt_attn[used], batch.prompt_len[used]
    with torch.set_grad_enabled(torch.is_grad_enabled() and n_grad > 0):
        out = model(input_ids=batch.prompt_ids[used], attention_mask=p_attn, use_cache=True)
    # the last real prompt token predicts the first completion token
    first = out.logits[torch.arange(len(used), device=dev), p_len - 1][which]  # (b, V)
    first = torch.cat([first[:n_grad], first[n_grad:].detach()])
    Tc = batch.completion_ids.shape[1]
    rest = []  # (h, Tc-1, V) for the grad rows, then for the others
    for lo, hi in ((0, n_grad), (n_grad, len(rows))) if Tc > 1 else ():
        if lo == hi:
            continue
        r, w = rows[lo:hi], which[lo:hi]
        with torch.set_grad_enabled(torch.is_grad_enabled() and lo == 0):
            # each row's copy of its prompt's cache; under autograd the prompt grads sum over the rows
            cache = DynamicCache([(k[w], v[w], sw) for k, v, sw in out.cache])
            attn = torch.cat([p_attn[w], batch.cmask[r, : Tc - 1].long()], dim=1)  # (h, Lp+Tc-1)
            pos = p_len[w][:, None] + torch.arange(Tc - 1, device=dev)[None, :]  # (h, Tc-1): positions continue the prompt
            rest.append(model(input_ids=batch.completion_ids[r, : Tc - 1], attention_mask=attn, position_ids=pos,
                              cache=cache, use_cache=True).logits)
    return torch.cat([first[:, None], *([torch.cat(rest)] if rest else [])], dim=1)  # (b, Tc, V)
