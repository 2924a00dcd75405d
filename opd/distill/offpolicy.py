"""Off-policy distillation: supervised training on teacher samples that the verifier accepts.

Each capability's main teacher samples `warmstart_group` completions of `warmstart_prompts` training
prompts; the completions the capability's verifier scores 1 are kept (rejection sampling) and the
student is trained on them by teacher forcing. Used as a warm start before on-policy distillation
(`warmstart_steps` in DistillConfig) or alone (`steps: 0`) as a baseline. The reward is the one the
experts were trained on, so no data beyond the experts and the lab's prompts is used.

With `verifier: none` (domains with no verifier) nothing is filtered and no reward is called: the
student trains on every sample its teachers drew, sequence-level knowledge distillation.
"""

from __future__ import annotations

import random

import torch
from opd_kernels import selective_log_softmax

from opd.capabilities import get_capability, prompt_texts
from opd.distill.routing import Routes
from opd.distill.teachers import Teacher, lm_head_weight
from opd.rl.batch import completion_targets, pad_sequences
from opd.rl.distill_loss import scatter_tokens, sequence_mean_loss
from opd.rl.packing import Layout, lay_out, padded_rows
from opd.rollout import SamplingParams
from opd.rollout.embedded import EmbeddedEngine

Sample = tuple[list[int], list[int]]  # (prompt ids, completion ids)


def verified_samples(teachers: dict[str, Teacher], routes: Routes, rng: random.Random, *, prompts: int,
                     group: int, temperature: float, seed: int, verify: bool = True,
                     prefill: Layout = "padded") -> dict[str, list[Sample]]:
    """Capability -> distinct (prompt, completion) pairs sampled from its highest-weight teacher that
    the capability's verifier accepts (score 1). Deterministic given `rng` and `seed`.

    verify False: every non-empty sample, duplicates included, and the verifier is never called; the
    pairs then follow the teacher's own distribution (deduplicating would flatten it towards its tail).
    prefill: how an in-process teacher prefills the prompts (EmbeddedEngine's; the same distribution)."""
    out: dict[str, list[Sample]] = {}
    for i, (cap, ts) in enumerate(sorted(routes.items())):
        capability = get_capability(cap)
        teacher = teachers[max(sorted(ts), key=ts.get)]
        engine = teacher.engine
        if isinstance(engine, EmbeddedEngine) and engine.prefill != prefill:
            engine = EmbeddedEngine(engine.model, engine.tokenizer, engine.batch_size, engine.compact_every, prefill)
        items = [capability.sample(rng, "train") for _ in range(prompts)]
        params = SamplingParams(temperature=temperature, max_new_tokens=capability.max_new_tokens + 1,
                                seed=seed * 1_000_003 + i)
        groups = engine.generate(prompt_texts(items, getattr(engine, "tokenizer", None)), group, params)
        kept = [(tuple(r.prompt_ids), tuple(r.completion_ids)) for it, g in zip(items, groups) for r in g
                if r.completion_ids and (not verify or capability.verify(r.text, it.answer) >= 1.0)]
        out[cap] = [(list(p), list(c)) for p, c in (dict.fromkeys(kept) if verify else kept)]
    return out


def sample_sft_batch(samples: dict[str, list[Sample]], mix: dict[str, float], rng: random.Random,
                     size: int) -> list[Sample]:
    """`size` pairs: a capability by `mix` (those with no accepted sample left out), then a pair of it."""
    caps = [c for c in mix if samples.get(c)]
    chosen = rng.choices(caps, weights=[mix[c] for c in caps], k=size)
    return [rng.choice(samples[c]) for c in chosen]


def sft_loss(policy, batch: list[Sample], pad_id: int, kernel_chunk: int = 1024,
             layout: Layout = "padded") -> tuple[torch.Tensor, int]:
    """policy: the loop's `StudentHidden` (or a DeepSpeed engine wrapping one). Mean over sequences
    of the mean negative log-likelihood of each completion token (the
    sequence-mean weighting of the OPD loss); returns (loss, completion tokens)."""
    device = next(policy.parameters()).device
    prompts, completions = [p for p, _ in batch], [c for _, c in batch]
    ids, attn, cmask, plen = (x.to(device) for x in pad_sequences(prompts, completions, pad_id))
    T = cmask.shape[1]
    real = cmask.bool()
    laid = (padded_rows(ids, attn, plen, cmask) if layout == "padded"
            else lay_out(prompts, completions, pad_id, "packed").to(device))
    h = policy(laid.ids, laid.mask, laid.pos, laid.index)  # (N, H)
    lp = selective_log_softmax(h, lm_head_weight(policy.lm), completion_targets(ids, plen, T)[real], kernel_chunk)  # (N,)
    return -sequence_mean_loss(scatter_tokens(lp, cmask), cmask), int(real.sum())
