"""The Bradley-Terry loss a reward model is fitted with on preference pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs: the negative log-likelihood of the
    preferences under P(chosen > rejected) = sigmoid(r_chosen - r_rejected) (Bradley and Terry, 1952).

    chosen, rejected: (B,) scalar rewards of each pair's two answers. Returns (loss, stats) with the
    share of pairs ranked right (`accuracy`, ties count as wrong) and the mean margin.
    """
    margin = chosen - rejected  # (B,)
    loss = -F.logsigmoid(margin).mean()
    return loss, {"accuracy": (margin > 0).float().mean().detach(), "margin": margin.mean().detach()}
