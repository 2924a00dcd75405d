"""The on-policy distillation loop: the student samples, its capability's teachers score, the student
moves towards them by per-token reverse KL.

One step = one rollout batch over all routed capabilities, then `updates_per_batch` minibatch
updates. Resumable like GSPO: model, optimizer, RNG states and history are checkpointed every
`checkpoint_every` steps; rerunning with the same config continues from the last checkpoint.
Under DeepSpeed (`wrap`, see opd.rl.distributed) every rank runs this loop on its own prompts.
"""

from __future__ import annotations

import copy
import os
import pickle
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from opd_kernels import selective_log_softmax

from opd.distill.ahead import start_ahead
from opd.distill.batch import OpdBatch, build_batch, sample_batch, teacher_outputs
from opd.distill.config import DistillConfig
from opd.distill.offpolicy import sample_sft_batch, sft_loss, verified_samples
from opd.distill.precision import resolve_inference_dtype
from opd.distill.routing import Routes, prompt_mix, require_routed
from opd.distill.teacher_bank import TeacherBank
from opd.distill.teachers import Teacher, lm_head_weight
from opd.errors import OpdError
from opd.io import atomic_torch_save
from opd.rl.distill_loss import row_capability_weights, scatter_tokens
from opd.rl.distributed import (
    common_step,
    init_distributed,
    load_optimizer_state,
    optimizer_step,
    rank0_value,
    rank_path,
    ranks_sum,
    zero_checkpoint_globals,
)
from opd.rl.estimators import Estimator, EstimatorSettings, Minibatch, get_estimator
from opd.rl.gspo_loss import group_advantages
from opd.rl.packing import TokenRows, hidden_at
from opd.rollout import get_engine
from opd.schedule import lr_at
from opd.tracking import Tracker


@dataclass
class DistillState:
    step: int = 0
    elapsed: float = 0.0
    gen_tokens: int = 0  # student tokens sampled so far, over all ranks (the cost the bench compares)
    history: list[dict] = field(default_factory=list)
    # The best student by minimum val retention (retention can peak and fall within a run).
    best_min_retention: float = -1.0
    best_step: int = 0
    best_model: dict | None = None
    # Off-policy warm start: steps done, the verified teacher samples it trains on (kept for a
    # resume), and the completion tokens it trained on.
    warm_step: int = 0
    warm_samples: dict | None = None
    warm_tokens: int = 0


class StudentHidden(torch.nn.Module):
    """The student's forward as the loss reads it: the hidden states that predict each completion
    token (N, H), no logits, from rows laid out by opd.rl.packing. Under DeepSpeed the engine wraps
    this module, so the loss comes from the engine's forward."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, mask, pos, index) -> torch.Tensor:
        return hidden_at(self.lm, TokenRows(ids, mask, pos, index))  # (N, H)


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


def estimator_of(cfg: DistillConfig) -> Estimator:
    """The config's reverse-KL estimator (opd.rl.estimators), configured by its settings."""
    return get_estimator(cfg.estimator, EstimatorSettings(cfg.kl_weight, cfg.reward_weight, cfg.eps_low,
                                                          cfg.eps_high, cfg.kernel_chunk, cfg.topk))


def opd_step(policy, opt, batch: OpdBatch, cfg: DistillConfig, teachers: dict[str, Teacher], backward=None,
             generator: torch.Generator | None = None) -> dict:
    """Minibatch updates on one batch; returns loss, clip and per-teacher KL statistics.

    policy: a `StudentHidden`, or the DeepSpeed engine wrapping one with its `backward(loss) -> grad
    norm` (which also clips and steps). generator: the minibatch split's random source (default torch's
    global one; `sample_ahead` gives each step its own, as another thread may sample meanwhile).
    """
    est = estimator_of(cfg)
    outputs = teacher_outputs(batch, teachers, logits=est.reads_logits)
    cmask, real = batch.cmask, batch.cmask.bool()
    tok_index = torch.full(real.shape, -1, dtype=torch.long, device=real.device)  # (B, T) -> index among real tokens
    tok_index[real] = torch.arange(int(real.sum()), device=real.device)
    # only a reward term reads rewards (under verifier: none the batch has none and reward_weight is 0)
    reward_adv = group_advantages(batch.rewards).reshape(-1) if cfg.reward_weight > 0 else None  # (B,)
    row_w = row_capability_weights(batch.row_caps, cfg.capability_weights).to(cmask.device)  # (B,)
    stats: dict[str, list[float]] = {}
    # B = prompts x group rows on every rank, so every rank calls backward equally often (DeepSpeed needs it)
    for rows in minibatches(batch, cfg.updates_per_batch, generator):
        m, r = cmask[rows], real[rows]
        laid = batch.token_rows(rows)
        h = policy(laid.ids, laid.mask, laid.pos, laid.index)  # (n, H)
        W = lm_head_weight(policy.lm)  # (V, H)
        new_lp = scatter_tokens(selective_log_softmax(h, W, batch.targets[rows][r], cfg.kernel_chunk), m)  # (b, T)
        mb = Minibatch(rows, m, h, W, new_lp, None if batch.old_lp is None else batch.old_lp[rows], tok_index[rows][r],
                       row_w[rows], None if reward_adv is None else reward_adv[rows])
        loss, st = est.loss(mb, outputs)
        gn = optimizer_step(loss, opt, policy.parameters(), cfg.grad_clip, backward)
        for k, v in {**st, "loss": float(loss.detach()), "grad_norm": float(gn)}.items():
            stats.setdefault(k, []).append(v)
    return {**{k: sum(v) / len(v) for k, v in stats.items()}, **est.batch_stats(batch.old_lp, cmask, outputs)}


# Fields that do not change the trajectory up to a given step: a run may resume under new values
# (e.g. more steps to extend it; not under a cosine schedule, whose every lr depends on `steps`).
# sample_worker: a thread and a process sample the same batches from the same weights and prompt RNG.
RESUMABLE_FIELDS = {"steps", "checkpoint_every", "eval_every", "eval_limit", "report_to", "sample_worker",
                    "teachers_on", "teacher_actors"}  # where teachers score: the same targets to float rounding


def _warm_start(cfg: DistillConfig, policy, opt, backward, teachers, routes, mix, rng, state: DistillState,
                pad_id: int, save, log, t0: float, rank: int, progress=None) -> None:
    """Off-policy distillation before OPD: supervised steps on verified teacher samples, or on all of
    them under verifier: none (see opd.distill.offpolicy), checkpointed every `checkpoint_every * 5`
    steps through `save()`; `progress(state, None)` after each step."""
    if state.warm_samples is None:
        verify = cfg.verifier != "none"
        state.warm_samples = verified_samples(teachers, routes, rng, prompts=cfg.warmstart_prompts,
                                              group=cfg.warmstart_group, temperature=cfg.warmstart_temperature,
                                              seed=cfg.seed + rank, verify=verify)
        log(f"warm start: {'verified' if verify else 'unfiltered'} teacher samples "
            + " ".join(f"{c}={len(v)}" for c, v in state.warm_samples.items()))
        if not any(state.warm_samples.values()):
            raise OpdError(f"warm start: {'the verifier accepted none' if verify else 'no non-empty one'} of the "
                           f"teachers' {cfg.warmstart_group} samples "
                           f"of {cfg.warmstart_prompts} prompts per capability: raise warmstart_prompts or "
                           "warmstart_group, or set warmstart_steps: 0")
    policy.train()
    while state.warm_step < cfg.warmstart_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(state.warm_step, cfg.warmstart_steps - 1, cfg.warmstart_lr, 0, cfg.lr_min_ratio)
        batch = sample_sft_batch(state.warm_samples, mix, rng, cfg.warmstart_batch)
        loss, n_tok = sft_loss(policy, batch, pad_id, cfg.kernel_chunk, cfg.layout)
        optimizer_step(loss, opt, policy.parameters(), cfg.grad_clip, backward)
        state.warm_step += 1
        state.warm_tokens += n_tok
        state.elapsed = time.time() - t0
        if progress:
            progress(state, None)
        if state.warm_step % 50 == 0 or state.warm_step == cfg.warmstart_steps:
            log(f"warm start step {state.warm_step}/{cfg.warmstart_steps}: loss {float(loss.detach()):.4f}")
        if state.warm_step % (cfg.checkpoint_every * 5) == 0:
            save()


# Fields added after runs had checkpoints: left unset they stay out of the identity, so those resume.
UNSET_LATER_FIELDS = ("topk", "capability_weights", "inference_dtype", "compact_every")
# Fields added after runs had checkpoints, whose default is what those runs did: left at it, they
# stay out of the identity too.
DEFAULTED_LATER_FIELDS = {"layout": "padded", "sample_ahead": False, "verifier": "capability"}


def _identity(cfg: DistillConfig) -> dict:
    exclude = RESUMABLE_FIELDS - ({"steps"} if cfg.lr_schedule != "constant" else set())
    exclude |= {f for f in UNSET_LATER_FIELDS if getattr(cfg, f) is None}
    exclude |= {f for f, v in DEFAULTED_LATER_FIELDS.items() if getattr(cfg, f) == v}
    return cfg.model_dump(mode="json", exclude=exclude)


def _sampler_copy(student, dtype: torch.dtype):
    """A copy of the student whose parameters are in `dtype`; its buffers (RoPE's frequencies) keep their
    own dtype, so positions are not rounded."""
    # eval for good: it only samples and scores, so the engine never has to switch its mode (a walk over
    # every module per call, with transformers' kernel checks)
    sampler = copy.deepcopy(student).eval()
    for p in sampler.parameters():
        p.data = p.data.to(dtype)
    return sampler


def step_lr(cfg: DistillConfig, step: int) -> float:
    """The learning rate of step `step` (0-based) under the config's schedule."""
    return cfg.lr if cfg.lr_schedule == "constant" else lr_at(step, cfg.steps - 1, cfg.lr, 0, cfg.lr_min_ratio)


PLAIN = {"deepspeed": False, "world_size": 1}


def save_checkpoint(path: Path, student, opt, state: DistillState, rng: random.Random, cfg: DistillConfig,
                    ranks: dict = PLAIN) -> None:
    """`ranks` ({deepspeed, world_size}) is part of the identity: a ZeRO optimizer's state is this
    rank's partition. With several ranks the previous checkpoint stays (`.prev`): ranks killed
    between their saves are then still one common step apart."""
    if ranks["world_size"] > 1 and path.exists():
        os.replace(path, _prev(path))
    atomic_torch_save({"config": _identity(cfg), "ranks": ranks, "model": student.state_dict(),
                       "optim": opt.state_dict(), "state": state.__dict__, "rng": rng.getstate(),
                       "torch_rng": torch.get_rng_state()}, path)


def _prev(path: Path) -> Path:
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def resume_checkpoint(path: Path, cfg: DistillConfig, ranks: dict = PLAIN) -> dict | None:
    """This rank's checkpoint to resume from (of this config, up to RESUMABLE_FIELDS), or None.
    With several ranks: the latest step that every rank holds (collective: every rank calls it)."""
    import sys

    found = {}
    for p in (path, _prev(path)):  # one rank keeps no .prev; several fall back to it
        if p.exists():
            try:
                with torch.serialization.safe_globals(zero_checkpoint_globals() if ranks["deepspeed"] else []):
                    ck = torch.load(p, weights_only=True)
            except pickle.UnpicklingError:  # a DeepSpeed run's checkpoint, read by a plain run
                continue
            except Exception as e:  # torn or empty (EOFError, RuntimeError): the .prev one, else a fresh start
                print(f"warning: checkpoint {p} is unreadable ({type(e).__name__}); "
                      f"{'trying the previous one' if p == path and _prev(path).exists() else 'starting fresh'}",
                      file=sys.stderr)
                continue
            if ck["config"] == _identity(cfg) and ck.get("ranks", PLAIN) == ranks:
                found[ck["state"]["step"]] = ck
    if ranks["world_size"] == 1:
        return found.get(max(found, default=None))
    step = common_step(list(found))
    return found[step] if step is not None else None


def restore_checkpoint(ck: dict, student, rng: random.Random) -> tuple[DistillState, dict]:
    """Model and RNG states back in place; returns the state and the optimizer state, which goes into
    the final optimizer (a ZeRO optimizer exists only after `wrap`)."""
    student.load_state_dict(ck["model"])
    rng.setstate(ck["rng"])
    torch.set_rng_state(ck["torch_rng"])
    return DistillState(**ck["state"]), ck["optim"]


def retention_record(scores: dict[str, float], references: dict[str, float]) -> dict:
    """Score / teacher's own score per capability (1 where the teacher scores 0), plus the minimum."""
    ret = {c: (s / references[c] if references.get(c, 0) > 0 else 1.0) for c, s in scores.items()}
    return {**{f"val/{c}": s for c, s in scores.items()}, **{f"retention/{c}": v for c, v in ret.items()},
            "min_retention": min(ret.values()) if ret else float("nan")}


def adapted_mix(mix: dict[str, float], history: list[dict], strength: float) -> dict[str, float]:
    """`mix` reweighted by the latest retention check in `history`: share_c ∝ mix_c * (1 + strength *
    max(0, 1 - retention_c)). Derived from the history, so a resumed run draws the same prompts."""
    last = next((r for r in reversed(history) if "min_retention" in r), None)
    if not strength or last is None:
        return mix
    raw = {c: w * (1 + strength * max(0.0, 1 - last.get(f"retention/{c}", 1.0))) for c, w in mix.items()}
    total = sum(raw.values())
    return {c: v / total for c, v in raw.items()}


def _shared(value, world: int):
    """Rank 0's value on every rank: decisions (keep-best, stop) must not differ between ranks."""
    return value if world == 1 else rank0_value(value)


def distill(cfg: DistillConfig, student, tokenizer, teachers: dict[str, Teacher], routes: Routes,
            ckpt_path: Path | None = None, *, evaluate_fn: Callable[[object], dict[str, float]] | None = None,
            references: dict[str, float] | None = None, teacher_weights: dict[str, float] | None = None,
            log=print, progress=None, stop: Callable[[dict], bool] | None = None, wrap=None,
            tracker: Tracker | None = None) -> DistillState:
    """Train `student` in place for `cfg.steps` steps; returns the state with the per-step history.

    routes: capability -> {teacher: weight} (see `opd.distill.routing.resolve_routes`).
    evaluate_fn(student) -> {capability: val score}, run every `eval_every` steps and at the end;
    with `references` (each capability's teacher score) the records carry retention.
    stop(record) -> True ends the run after that step (e.g. once a target score is reached).
    wrap(model, opt) -> (engine, opt, backward): DeepSpeed (`opd.rl.distributed.deepspeed_wrap`). Each rank
    draws its own `prompts_per_step` prompts and checkpoints to its own file; rank 0 evaluates and
    its keep-best and stop decisions hold on every rank.
    tracker (opd.tracking): gets every history record, each teacher's KL as kl/<teacher>.
    progress(state, rec): after each OPD step; rec None after a warm-start step and on resume.
    """
    tracker = tracker or Tracker()
    mix = prompt_mix(routes, cfg.mix, teacher_weights)
    require_routed("capability_weights", cfg.capability_weights or {}, routes)
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    rank, world = init_distributed() if wrap is not None else (0, 1)
    ranks = {"deepspeed": wrap is not None, "world_size": world}
    rng = random.Random(f"opd|{cfg.seed}" + (f"|{rank}" if rank else ""))
    torch.manual_seed(cfg.seed + rank)
    ckpt_path = rank_path(ckpt_path, rank) if ckpt_path else None
    ck = resume_checkpoint(ckpt_path, cfg, ranks) if ckpt_path else None
    state, optim_state = restore_checkpoint(ck, student, rng) if ck else (DistillState(), None)
    if ck:
        log(f"resuming distillation at step {state.step}")
        if progress:
            progress(state, None)  # a resumed run's bars start where it had got to
    policy, backward = StudentHidden(student), None
    if wrap is not None:
        policy, opt, backward = wrap(policy, opt)
    if optim_state is not None:
        load_optimizer_state(opt, optim_state)
    # sample_ahead samples from a copy of the student that a worker reads while the update runs;
    # inference_dtype samples from a copy in that dtype (synced before each batch)
    own = next(student.parameters()).dtype
    dtype = resolve_inference_dtype(cfg.inference_dtype, student)
    if cfg.inference_dtype == "auto":
        log(f"inference_dtype auto: sampling and teacher scoring in {str(dtype).removeprefix('torch.')} on this machine")
    cast = dtype != own
    sampler = _sampler_copy(student, dtype) if cfg.sample_ahead or cast else student
    engine = get_engine("embedded", model=sampler, tokenizer=tokenizer, compact_every=cfg.compact_every,
                        prefill=cfg.layout)
    t0 = time.time() - state.elapsed
    routed = sorted({t for ts in routes.values() for t in ts})
    bank = None
    if cfg.teachers_on != "local":  # the same bank and engines, served by actors (opd.distill.remote)
        from opd.distill.remote import remote_teachers

        teachers, bank = remote_teachers(cfg, teachers, routed, tokenizer, dtype if cast else None)
    elif cfg.teacher_forward == "stacked" and all(teachers[n].model is not None for n in routed):
        bank = TeacherBank(teachers, routed, dtype if cast else None)

    ahead = worker = None  # sample_ahead's batch in flight, and where it is sampled

    def check(rec: dict) -> None:  # a retention check on val; keeps the best student
        if ahead is not None and cfg.sample_worker == "thread":
            ahead.result()  # sampling ahead in this process and lm-eval would share torch's global RNG
        scores = _shared(evaluate_fn(student) if rank == 0 else None, world)
        rec.update(retention_record(scores, references or {}))
        student.train()
        if rec.get("min_retention", -1.0) > state.best_min_retention:
            state.best_min_retention, state.best_step = rec["min_retention"], state.step
            state.best_model = {k: v.detach().clone() for k, v in student.state_dict().items()}

    if state.warm_step < cfg.warmstart_steps:
        _warm_start(cfg, policy, opt, backward, teachers, routes, mix, rng, state, tokenizer.pad_token_id,
                    lambda: save_checkpoint(ckpt_path, student, opt, state, rng, cfg, ranks) if ckpt_path else None,
                    log, t0, rank, progress)
        rec = {"step": 0, "phase": "warmstart", "warm_tokens": state.warm_tokens, "gen_tokens": 0}
        if evaluate_fn is not None:
            check(rec)
            log(f"warm start done: min retention {rec['min_retention']:.3f}")
        state.history.append(rec)
        tracker.log(rec, 0)
        if backward is None:
            opt.state.clear()  # OPD starts with fresh Adam moments (the SFT gradients' scale differs)
        if ckpt_path:
            save_checkpoint(ckpt_path, student, opt, state, rng, cfg, ranks)

    def produce(step: int, step_mix: dict[str, float], prompt_rng: random.Random) -> tuple[OpdBatch, float, float]:
        """The rollout batch of `step`: the sampler samples, the teachers score. Returns it and both phases' seconds."""
        t_sample = time.perf_counter()
        items, groups = sample_batch(engine, routes, step_mix, prompt_rng, prompts=cfg.prompts_per_step,
                                     group=cfg.group_size, temperature=cfg.temperature,
                                     max_new_tokens=cfg.max_new_tokens, seed=cfg.seed * 100_003 + step + rank * 1_000_003)
        t_score = time.perf_counter()
        batch = build_batch(sampler, items, groups, teachers, routes, tokenizer.pad_token_id, cfg.kernel_chunk, bank,
                            old_lp=estimator_of(cfg).reads_old_lp or cfg.reward_weight > 0, layout=cfg.layout,
                            rewards=cfg.verifier != "none")
        return batch, t_score - t_sample, time.perf_counter() - t_score

    def produce_ahead(step: int, step_mix: dict[str, float], rng_state) -> tuple[OpdBatch, object]:
        """`produce` from the prompt RNG state given; returns the batch and the RNG state after it."""
        prompt_rng = random.Random()
        prompt_rng.setstate(rng_state)
        return produce(step, step_mix, prompt_rng)[0], prompt_rng.getstate()

    # sample_ahead: a worker (opd.distill.ahead: a thread, or a forked process) samples and scores step
    # k+1's batch on a copy of the student (synced when step k's batch is taken, so one update behind)
    # while step k's update runs; on a CPU the two use both cores. The prompt mix and the prompt RNG's
    # state go with each call, and the RNG moves on only when its batch is taken, so a checkpoint saves
    # the RNG as it was before the batch in flight and a resumed run draws the same prompts (its first
    # batch then samples the checkpoint's student, not the one before). The update draws its minibatches
    # from a per-step generator; in a thread, a retention check waits for the batch in flight, as both
    # would otherwise share torch's global RNG with the sampling.
    try:
        if cfg.sample_ahead:  # a process samples what load_state_dict writes into the shared sampler
            worker = start_ahead(cfg.sample_worker, produce_ahead, torch.get_num_threads(), shared=sampler)
        while state.step < cfg.steps:
            generator = None
            if worker is None:
                if sampler is not student:
                    sampler.load_state_dict(student.state_dict())  # casts to the sampler's dtype
                batch, s_sample, s_score = produce(state.step, adapted_mix(mix, state.history, cfg.adaptive_mix),
                                                   rng)
                t_update = time.perf_counter()
            else:
                t_wait = time.perf_counter()
                if ahead is None:
                    ahead = worker.submit(state.step, adapted_mix(mix, state.history, cfg.adaptive_mix),
                                          rng.getstate())
                batch, rng_state = ahead.result()
                rng.setstate(rng_state)
                sampler.load_state_dict(student.state_dict())  # the next batch samples the student as it is now
                ahead = None
                if state.step + 1 < cfg.steps:
                    ahead = worker.submit(state.step + 1, adapted_mix(mix, state.history, cfg.adaptive_mix),
                                          rng.getstate())
                t_update = time.perf_counter()
                s_sample, s_score = t_update - t_wait, 0.0  # the wait for the batch; its own seconds overlapped
                generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.step * 7_919 + rank)
            for g in opt.param_groups:
                g["lr"] = step_lr(cfg, state.step)
            rec = {"step": state.step + 1, "lr": opt.param_groups[0]["lr"],
                   **opd_step(policy, opt, batch, cfg, teachers, backward, generator)}
            # where a step's seconds go: student sampling, teacher (and old-policy) scoring, the update
            rec.update({"time/sample": s_sample, "time/score": s_score, "time/update": time.perf_counter() - t_update})
            for cap in dict.fromkeys(batch.row_caps) if batch.rewards is not None else ():
                rows = [b for b, c in enumerate(batch.row_caps) if c == cap]
                rec[f"reward/{cap}"] = float(batch.rewards.reshape(-1)[rows].mean())
            state.step += 1
            state.gen_tokens += batch.gen_tokens if world == 1 else ranks_sum(batch.gen_tokens)
            rec["gen_tokens"] = state.gen_tokens
            if state.warm_tokens:
                rec["warm_tokens"] = state.warm_tokens  # teacher-sample tokens of the off-policy warm start
            last = state.step == cfg.steps
            if evaluate_fn is not None and (last or (cfg.eval_every and state.step % cfg.eval_every == 0)):
                check(rec)
            state.elapsed = time.time() - t0
            state.history.append(rec)
            tracker.log(rec, state.step)
            kls = " ".join(f"{k[3:]}={v:.3f}" for k, v in rec.items() if k.startswith("kl/"))
            log(f"opd step {state.step}/{cfg.steps}: loss {rec['loss']:.4f} KL {kls}"
                + (f" min retention {rec['min_retention']:.3f}" if "min_retention" in rec else ""))
            if progress:
                progress(state, rec)
            if ckpt_path and (last or state.step % cfg.checkpoint_every == 0):
                save_checkpoint(ckpt_path, student, opt, state, rng, cfg, ranks)
            if stop is not None and _shared(stop(rec), world):
                break
    finally:
        if worker is not None:
            worker.close()
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # every rank's last checkpoint is written before rank 0 removes them
    return state
