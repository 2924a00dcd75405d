"""Turn rollouts into padded tensors and per-token logprobs under a model."""

from __future__ import annotations

import torch


def pad_sequences(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int):
    """Right-pad prompt+completion rows; returns input_ids, attention_mask (B, L) and the
    completion mask (B, Tc) plus each row's prompt length, so logprobs can be gathered."""
    B = len(prompt_ids)
    L = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    Tc = max(len(c) for c in completion_ids)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    cmask = torch.zeros((B, Tc), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        cmask[i, : len(c)] = 1.0
    plen = torch.tensor([len(p) for p in prompt_ids])
    return ids, attn, cmask, plen


def completion_logits(model, ids, attn, plen, Tc: int) -> torch.Tensor:
    """Logits that predict each completion token: (B, Tc, V)."""
    logits = model(input_ids=ids, attention_mask=attn).logits  # (B, L, V)
    # token at position plen+j is predicted by logits at plen+j-1
    idx = (plen[:, None] - 1 + torch.arange(Tc)[None, :]).clamp(max=ids.shape[1] - 1)  # (B, Tc)
    return logits.gather(1, idx[:, :, None].expand(-1, -1, logits.shape[-1]))


def completion_targets(ids, plen, Tc: int) -> torch.Tensor:
    idx = (plen[:, None] + torch.arange(Tc)[None, :]).clamp(max=ids.shape[1] - 1)  # (B, Tc)
    return ids.gather(1, idx)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target]: (B, Tc, V), (B, Tc) -> (B, Tc)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)  # (B, Tc)
