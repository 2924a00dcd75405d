"""Teachers: a scoring engine per expert, plus its in-process model when the full estimator needs logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.rollout import RolloutEngine, get_engine


@dataclass
class Teacher:
    """`engine.score` gives the log-prob of every sampled token (embedded, or an SGLang server on a GPU);
    `model` is needed only by the full-vocabulary estimator, which reads the teacher's hidden states."""

    name: str
    capability: str
    engine: RolloutEngine
    model: torch.nn.Module | None = None
    tasks: tuple[str, ...] = ()  # the tasks whose prompts it serves (default: its capability)

    def __post_init__(self):
        if not self.tasks:
            self.tasks = (self.capability,)


def embedded_teacher(name: str, capability: str, model, tokenizer, tasks=()) -> Teacher:
    """A frozen in-process teacher: eval mode (no dropout in its targets) and no gradients."""
    model.eval()
    model.requires_grad_(False)
    return Teacher(name, capability, get_engine("embedded", model=model, tokenizer=tokenizer), model, tuple(tasks))


def completion_hidden(model, ids: torch.Tensor, attn: torch.Tensor, plen: torch.Tensor, Tc: int) -> torch.Tensor:
    """Final (post-norm) hidden states that predict each completion token: (B, L) -> (B, Tc, H).

    Reading hidden states instead of logits lets the chunked kernels apply the LM head piecewise, so
    (B, Tc, V) is never built.
    """
    h = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, L, H)
    # the token at position plen+j is predicted from position plen+j-1
    idx = (plen[:, None] - 1 + torch.arange(Tc, device=ids.device)[None, :]).clamp(max=ids.shape[1] - 1)  # (B, Tc)
    return h.gather(1, idx[:, :, None].expand(-1, -1, h.shape[-1]))


def lm_head_weight(model) -> torch.Tensor:
    """(V, H): the output embedding (tied to the input embedding in the lab's models)."""
    return model.get_output_embeddings().weight
