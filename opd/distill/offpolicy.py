"""Off-policy distillation: supervised training on teacher samples that the verifier accepts.

Each capability's main teacher samples `warmstart_group` completions of `warmstart_prompts` training
prompts; the completions the capability's verifier scores 1 are kept (rejection sampling) and the
student is trained on them by teacher forcing. Used as a warm start before on-policy distillation
(`warmstart_steps` in DistillConfig) or alone (`steps: 0`) as a baseline. The reward is the one the
experts were trained on, so no data beyond the experts and the lab's prompts is used.

With `verifier: none` (domains with no verifier) nothing is filtered and no reward is called: the
student trains on every sample its teachers drew, sequence-level knowledge distillation. With
`select: mbr` it trains instead on one sample per prompt, the one that agrees most with the teacher's
other samples of that prompt (minimum Bayes risk selection, Kumar & Byrne 2004; as a distillation target,
Finkelstein et al. 2023, "MBR and QE Finetuning"): a consensus over the teacher's own samples, which
reads no reward and needs no answer format (the utility is a similarity of token sequences).

With `loss: kl` (`kd_loss`, word-level KD) each token's target is the teacher's whole distribution. The
samples are fixed for the whole warm start, so `teacher_logits_cache` scores each teacher over all of its
samples once, in large batches, where they fit in memory, and a step then runs the student alone. With
`topk` K the target at each token is the teacher's K most likely tokens and a tail bucket
(`teacher_topk_reverse_kl`): K log-probs a token to hold instead of the vocabulary's, and what a teacher
on an SGLang server returns (`SGLangEngine.top_logprobs`), so the KL warm start runs at a real
vocabulary and with teachers that are not in this process.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from difflib import SequenceMatcher
from itertools import accumulate, groupby
from typing import Literal

import torch
from opd_kernels import reverse_kl, selective_log_softmax

from opd.capabilities import get_capability, prompt_texts
from opd.distill.routing import Routes
from opd.distill.teachers import Teacher, TopLogprobs, lm_head_weight, teacher_targets
from opd.errors import OpdError
from opd.rl.batch import completion_targets, pad_sequences
from opd.rl.distill_loss import chunked_teacher_topk_kl, scatter_tokens, sequence_mean_loss
from opd.rl.gspo_loss import masked_mean
from opd.rl.packing import Layout, hidden_at, lay_out, padded_rows
from opd.rollout import SamplingParams
from opd.rollout.embedded import EmbeddedEngine

Sample = tuple[list[int], list[int]]  # (prompt ids, completion ids)
Select = Literal["all", "mbr"]


def similarity(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """MBR's utility between two completions: difflib's Ratcliff/Obershelp ratio of their token ids,
    2 * matched / (len a + len b); 1 for equal sequences, 0 for disjoint ones."""
    return SequenceMatcher(None, a, b, autojunk=False).ratio()


def mbr_pick(completions: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The completion with the highest summed utility against the prompt's other samples (minimum
    Bayes risk under the teacher's own distribution). Equal completions are scored once and weighted by
    their count, so on short answers this is the majority answer, with ties to the one drawn first."""
    counts = Counter(completions)
    distinct = list(counts)  # in order of first draw
    if len(distinct) == 1:
        return distinct[0]

    def risk_gain(c):
        return (counts[c] - 1) + sum(n * similarity(c, o) for o, n in counts.items() if o != c)

    return max(distinct, key=risk_gain)


def verified_samples(teachers: dict[str, Teacher], routes: Routes, rng: random.Random, *, prompts: int,
                     group: int, temperature: float, seed: int, verify: bool = True,
                     prefill: Layout = "padded", select: Select = "all",
                     on_capability: Callable[[str, int, int], None] | None = None) -> dict[str, list[Sample]]:
    """Capability -> distinct (prompt, completion) pairs sampled from its highest-weight teacher that
    the capability's verifier accepts (score 1). Deterministic given `rng` and `seed`.

    verify False: every non-empty sample, duplicates included, and the verifier is never called; the
    pairs then follow the teacher's own distribution (deduplicating would flatten it towards its tail).
    select "mbr": of each prompt's kept samples, only the one `mbr_pick` chooses (one pair per prompt).
    prefill: how an in-process teacher prefills the prompts (EmbeddedEngine's; the same distribution).
    on_capability(cap, i, n): called before the i-th (from 0) of the n capabilities is sampled."""
    out: dict[str, list[Sample]] = {}
    main = main_teachers(teachers, routes)
    for i, cap in enumerate(sorted(routes)):
        if on_capability is not None:
            on_capability(cap, i, len(routes))
        capability = get_capability(cap)
        teacher = main[cap]
        engine = teacher.engine
        if isinstance(engine, EmbeddedEngine) and engine.prefill != prefill:
            engine = EmbeddedEngine(engine.model, engine.tokenizer, engine.batch_size, engine.compact_every, prefill)
        items = [capability.sample(rng, "train") for _ in range(prompts)]
        params = SamplingParams(temperature=temperature, max_new_tokens=capability.max_new_tokens + 1,
                                seed=seed * 1_000_003 + i)
        groups = engine.generate(prompt_texts(items, getattr(engine, "tokenizer", None)), group, params)
        kept = []
        for it, g in zip(items, groups):
            ok = [(tuple(r.prompt_ids), tuple(r.completion_ids)) for r in g
                  if r.completion_ids and (not verify or capability.verify(r.text, it.answer) >= 1.0)]
            if select == "mbr" and ok:
                ok = [(ok[0][0], mbr_pick([c for _, c in ok]))]
            kept += ok
        out[cap] = [(list(p), list(c)) for p, c in (dict.fromkeys(kept) if verify else kept)]
    return out


PackedSamples = dict[str, dict[str, torch.Tensor]]


def pack_samples(samples: dict[str, list[Sample]]) -> PackedSamples:
    """The samples as a checkpoint holds them: per capability, every pair's prompt and completion
    tokens end to end, and their lengths, as three int32 tensors. A checkpoint saves and loads these as
    tensors, where the same samples as Python lists are pickled item by item (the lab12 recipe's
    196,608 pairs: 0.78 s a save against 0.041 s, 4.5 s a load against 0.03 s; bench/bench_warm_checkpoint.py)."""
    out: PackedSamples = {}
    for cap, pairs in samples.items():
        out[cap] = {"tokens": torch.tensor([t for p, c in pairs for t in (*p, *c)], dtype=torch.int32),
                    "prompt_len": torch.tensor([len(p) for p, _ in pairs], dtype=torch.int32),
                    "completion_len": torch.tensor([len(c) for _, c in pairs], dtype=torch.int32)}
    return out


def unpack_samples(packed: PackedSamples | dict[str, list[Sample]]) -> dict[str, list[Sample]]:
    """`pack_samples`' samples as (prompt, completion) lists again; a checkpoint written before the
    samples were packed holds the lists themselves, which come back as they are."""
    out: dict[str, list[Sample]] = {}
    for cap, d in packed.items():
        if isinstance(d, list):
            out[cap] = d
            continue
        tokens, pl, cl = d["tokens"].tolist(), d["prompt_len"].tolist(), d["completion_len"].tolist()
        starts = accumulate((a + b for a, b in zip(pl, cl)), initial=0)
        out[cap] = [(tokens[s: s + a], tokens[s + a: s + a + b]) for s, a, b in zip(starts, pl, cl)]
    return out


Draws = Literal["pairs", "groups"]


def prompt_groups(pairs: list[Sample]) -> list[range]:
    """The runs of consecutive pairs with one prompt (`verified_samples` keeps a prompt's samples
    together): each prompt's kept samples, as index ranges."""
    runs = groupby(range(len(pairs)), key=lambda i: tuple(pairs[i][0]))
    return [range(ix[0], ix[-1] + 1) for ix in (list(g) for _, g in runs)]


def draw_sft(samples: dict[str, list[Sample]], mix: dict[str, float], rng: random.Random,
             size: int, draws: Draws = "pairs", groups: dict[str, list[range]] | None = None
             ) -> list[tuple[str, int]]:
    """Draws (capability, index into its samples), each from a capability by `mix` (those with no
    accepted sample left out). "pairs": `size` pairs, each uniform over the capability's pairs (the
    random draws of `rng.choice`). "groups": whole prompts, each with all its kept samples (uniform over
    the capability's prompts; `groups`: its `prompt_groups`, computed when not given), until there are
    at least `size` pairs: a packed layout then lays each prompt out once for its samples."""
    caps = [c for c in mix if samples.get(c)]
    weights = [mix[c] for c in caps]
    if draws == "pairs":
        chosen = rng.choices(caps, weights=weights, k=size)
        return [(c, rng.randrange(len(samples[c]))) for c in chosen]
    groups = groups or {c: prompt_groups(samples[c]) for c in caps}
    out: list[tuple[str, int]] = []
    while len(out) < size:
        c = rng.choices(caps, weights=weights)[0]
        out += [(c, i) for i in rng.choice(groups[c])]
    return out


# What a teacher gives at each completion token: its logits (T, V) float32 on the CPU, or its top k.
Targets = torch.Tensor | TopLogprobs

# capability -> (the teacher's targets at every completion token of its distinct samples; the row offsets
# of those distinct samples, one more than them; each sample's distinct one): sample i is rows
# offsets[which[i]]:offsets[which[i] + 1]
TeacherLogits = dict[str, tuple[Targets, list[int], list[int]]]


def distinct(pairs: list[Sample]) -> tuple[list[Sample], list[int]]:
    """The distinct pairs in first-seen order, and the index among them of each pair (teachers sampling
    near their mode repeat themselves: at the lab12 recipe's temperature 0.3 30% of the pairs are
    distinct)."""
    first: dict[tuple, int] = {}
    which = [first.setdefault((tuple(p), tuple(c)), len(first)) for p, c in pairs]
    return [(list(p), list(c)) for p, c in first], which


def cache_bytes(samples: dict[str, list[Sample]], vocab: int, topk: int | None = None) -> int:
    """Bytes `teacher_logits_cache` would hold: float32 logits at every completion token of the
    distinct samples, or with `topk` K int32 ids and float32 log-probs of K tokens."""
    per_token = 4 * vocab if topk is None else 8 * min(topk, vocab)
    return per_token * sum(len(c) for pairs in samples.values() for _, c in distinct(pairs)[0])


def teacher_logits_cache(samples: dict[str, list[Sample]], teachers: dict[str, Teacher], pad_id: int,
                         layout: Layout = "padded", chunk: int = 512, topk: int | None = None) -> TeacherLogits:
    """Each capability's teacher (`teachers`: capability -> Teacher) scored once over its distinct
    samples (`teacher_targets`, `chunk` pairs per forward): the same targets (to float rounding) that
    `kd_loss` would compute at each step's few pairs, so the warm start's steps cost the student's
    forward and backward alone, and the teachers run in large batches. The samples are fixed for the
    whole warm start (off-policy), so nothing goes stale."""
    require_models(teachers, [c for c in samples if samples[c]], topk)
    out: TeacherLogits = {}
    for cap, pairs in samples.items():
        if not pairs:
            continue
        unique, which = distinct(pairs)
        targets = teacher_targets(teachers[cap], unique, pad_id, layout, chunk, topk)
        out[cap] = (targets, list(accumulate((len(c) for _, c in unique), initial=0)), which)
    return out


def cached_logits(cache: TeacherLogits, draws: list[tuple[str, int]]) -> list[Targets]:
    """The cached teacher targets of each draw's completion tokens: (len(completion), V) logits each, or
    their top k."""
    out = []
    for c, i in draws:
        logits, offsets, which = cache[c]
        out.append(logits[offsets[which[i]]: offsets[which[i] + 1]])
    return out


def main_teachers(teachers: dict[str, Teacher], routes: Routes) -> dict[str, Teacher]:
    """Capability -> the teacher that samples its warm start (its highest-weight one)."""
    return {cap: teachers[max(sorted(ts), key=ts.get)] for cap, ts in routes.items()}


def require_models(teachers: dict[str, Teacher], caps, topk: int | None = None) -> None:
    """Refuse `warmstart_loss: kl` when a capability in `caps` has no in-process teacher model (with `topk`,
    nor an engine that returns top-k log-probs, as an SGLang server's does)."""
    missing = sorted(c for c in caps if teachers[c].model is None
                     and (topk is None or not hasattr(teachers[c].engine, "top_logprobs")))
    if missing:
        fix = ("use warmstart_loss: nll" if topk is not None else
               "set warmstart_topk: K (a server's top-K log-probs and a tail bucket), or use warmstart_loss: nll")
        raise OpdError(f"warmstart_loss: kl needs in-process teacher models (the full vocabulary)"
                       f"{' or top-k log-probs' if topk is not None else ''}, but the teacher of "
                       f"{', '.join(missing)} has none (teachers_on: ray, or a server): {fix}")


def kd_loss(policy, batch: list[tuple[str, Sample]], teachers: dict[str, Teacher], pad_id: int,
            kernel_chunk: int = 1024, layout: Layout = "padded",
            teacher_logits: list[Targets] | None = None, target_temperature: float = 1.0,
            topk: int | None = None) -> tuple[torch.Tensor, int]:
    """Word-level distillation on teacher samples (`warmstart_loss: kl`): at every completion token of
    each pair, the exact KL(student || teacher) over the full vocabulary to its capability's teacher
    (`teachers`: capability -> Teacher with an in-process model), the per-token target of the `full`
    OPD estimator, here on the teacher's own samples; mean over each sequence's tokens, then over
    sequences, as `sft_loss`. Returns (loss, completion tokens).

    teacher_logits: each pair's teacher targets at its completion tokens, (len(completion), V) logits or
    their `TopLogprobs`, in the order of `batch` (`cached_logits` of a `teacher_logits_cache`); given, no
    teacher runs here.
    target_temperature: the KL's target is softmax(teacher logits / it): 1.0 the teacher itself, the
    sampling temperature the sharper distribution its samples were drawn from (full logits only).
    topk: K: the KL over the teacher's K most likely tokens and a tail bucket (`teacher_topk_reverse_kl`),
    from an in-process teacher or one that returns top-k log-probs (an SGLang server)."""
    per_seq, _, n_tok = kd_sequence_losses(policy, batch, teachers, pad_id, kernel_chunk, layout, teacher_logits,
                                           target_temperature, topk)
    return per_seq.mean(), n_tok


def capability_means(per_seq: torch.Tensor, caps: list[str]) -> dict[str, float]:
    """Capability -> the mean of its sequences' losses in `per_seq` (detached; `kd_sequence_losses`' rows)."""
    values = per_seq.detach().tolist()
    out: dict[str, list[float]] = {}
    for c, v in zip(caps, values):
        out.setdefault(c, []).append(v)
    return {c: sum(v) / len(v) for c, v in out.items()}


def kd_sequence_losses(policy, batch: list[tuple[str, Sample]], teachers: dict[str, Teacher], pad_id: int,
                       kernel_chunk: int = 1024, layout: Layout = "padded",
                       teacher_logits: list[Targets] | None = None, target_temperature: float = 1.0,
                       topk: int | None = None) -> tuple[torch.Tensor, list[str], int]:
    """`kd_loss` per sequence: (each pair's mean KL over its completion tokens (B,), each row's capability,
    completion tokens). The rows are in capability order (each teacher's pairs consecutive), not in the
    order of `batch`; their mean is `kd_loss`."""
    if topk is not None and target_temperature != 1.0:
        raise ValueError("kd_sequence_losses: a top-k target keeps no full logits to rescale: target_temperature "
                         "must be 1.0 with topk")
    if teacher_logits is None:
        require_models(teachers, {c for c, _ in batch}, topk)
    order = sorted(range(len(batch)), key=lambda j: batch[j][0])  # stable: each teacher's pairs are consecutive
    batch = [batch[j] for j in order]
    pairs = [pair for _, pair in batch]
    device = next(policy.parameters()).device
    prompts, completions = [p for p, _ in pairs], [c for _, c in pairs]
    laid = lay_out(prompts, completions, pad_id, layout).to(device)
    h = policy(laid.ids, laid.mask, laid.pos, laid.index)  # (N, H), the pairs' tokens in order
    W = lm_head_weight(policy.lm)
    if topk is not None:
        if teacher_logits is not None:
            top = TopLogprobs.cat([teacher_logits[j] for j in order])
        else:
            top = TopLogprobs.cat([teacher_targets(teachers[cap], [pair for c, pair in batch if c == cap], pad_id,
                                                   layout, topk=topk) for cap in dict.fromkeys(c for c, _ in batch)])
        kl = chunked_teacher_topk_kl(h, W, top.ids.to(device), top.logprobs.to(device), kernel_chunk)
    elif teacher_logits is not None:
        zt = torch.cat([teacher_logits[j] for j in order]).to(device) / target_temperature  # (N, V)
        kl = reverse_kl(h, W, teacher_logits=zt, chunk_size=kernel_chunk)
    else:
        parts, at = [], 0
        for cap in dict.fromkeys(c for c, _ in batch):
            sub = [pair for c, pair in batch if c == cap]
            n = sum(len(c) for _, c in sub)
            model = teachers[cap].model
            with torch.no_grad():
                ht = hidden_at(model, lay_out([p for p, _ in sub], [c for _, c in sub], pad_id, layout).to(device))
                ht = ht / target_temperature  # the logits ht @ W.T, scaled
            parts.append(reverse_kl(h[at: at + n], W, ht, lm_head_weight(model), chunk_size=kernel_chunk))  # (n,)
            at += n
        kl = torch.cat(parts)
    _, _, cmask, _ = pad_sequences(prompts, completions, pad_id)
    cmask = cmask.to(device)
    return masked_mean(scatter_tokens(kl, cmask), cmask, dim=1), [c for c, _ in batch], int(cmask.sum())


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
