"""Teachers: a scoring engine per expert, plus its in-process model when the full estimator needs logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.errors import OpdError
from opd.rl.packing import Layout, hidden_at, lay_out
from opd.rollout import RolloutEngine, get_engine

Sample = tuple[list[int], list[int]]  # (prompt ids, completion ids)
# Tokens whose logits `teacher_targets` holds at once when it keeps only their top k (1024 x 150k floats: 0.6 GB).
HEAD_CHUNK = 1024


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


@dataclass(frozen=True)
class TopLogprobs:
    """A teacher's k most likely tokens at each of T completion tokens: ids (T, k) int32 and their
    log-probs (T, k) float32, on the CPU; sliced and concatenated as one (T, ...) tensor would be."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    def __getitem__(self, rows: slice) -> TopLogprobs:
        return TopLogprobs(self.ids[rows], self.logprobs[rows])

    @staticmethod
    def cat(parts: list[TopLogprobs]) -> TopLogprobs:
        return TopLogprobs(torch.cat([p.ids for p in parts]), torch.cat([p.logprobs for p in parts]))


def teacher_targets(teacher: Teacher, pairs: list[Sample], pad_id: int, layout: Layout = "padded",
                    chunk: int = 512, topk: int | None = None) -> torch.Tensor | TopLogprobs:
    """The teacher's targets at every completion token of `pairs`, in order, `chunk` pairs per forward: its
    logits (T, V), or with `topk` K its K most likely tokens and their log-probs (`TopLogprobs`). An
    in-process teacher runs its model; one without (an SGLang server) answers `top_logprobs`, which
    needs `topk`."""
    if teacher.model is None:
        if topk is None or not hasattr(teacher.engine, "top_logprobs"):
            raise OpdError(f"teacher {teacher.name!r} has no in-process model and its engine returns no top-k "
                           "log-probs: the KL warm start needs one of them")
        parts = []
        for s in range(0, len(pairs), chunk):
            sub = pairs[s: s + chunk]
            for ids, lps in teacher.engine.top_logprobs([p for p, _ in sub], [c for _, c in sub], topk):
                if ids:  # (len(completion), k): k is the engine's, at most the vocabulary
                    parts.append(TopLogprobs(torch.tensor(ids, dtype=torch.int32),
                                             torch.tensor(lps, dtype=torch.float32)))
        if not parts:
            return TopLogprobs(torch.zeros(0, topk, dtype=torch.int32), torch.zeros(0, topk))
        return TopLogprobs.cat(parts)
    model = teacher.model
    device, W = next(model.parameters()).device, lm_head_weight(model).float()
    parts = []
    with torch.no_grad():
        for s in range(0, len(pairs), chunk):
            sub = pairs[s: s + chunk]
            rows = lay_out([p for p, _ in sub], [c for _, c in sub], pad_id, layout).to(device)
            h = hidden_at(model, rows, last_mlp_at_index=True).float()  # (t, H)
            if topk is None:
                parts.append((h @ W.T).cpu())  # (t, V): the cache holds them all
                continue
            for a in range(0, h.shape[0], HEAD_CHUNK):  # (c, V) at a time: a real vocabulary's logits are large
                lp, ids = torch.log_softmax(h[a: a + HEAD_CHUNK] @ W.T, -1).topk(min(topk, W.shape[0]), -1)
                parts.append(TopLogprobs(ids.int().cpu(), lp.cpu()))
    return torch.cat(parts) if topk is None else TopLogprobs.cat(parts)
