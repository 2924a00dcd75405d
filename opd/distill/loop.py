"""The on-policy distillation loop: the student samples, its capability's teachers score, the student
moves towards them by per-token reverse KL.

One step = one rollout batch over all routed capabilities, then `updates_per_batch` minibatch
updates. Resumable like GSPO: model, optimizer, RNG states and history are checkpointed every
`checkpoint_every` steps; rerunning with the same config continues from the last checkpoint.
Under DeepSpeed (`wrap`, see opd.rl.distributed) every rank runs this loop on its own prompts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from opd_kernels import selective_log_softmax

from opd.distill.batch import OpdBatch, minibatches, teacher_outputs
from opd.distill.config import DistillConfig
from opd.distill.offpolicy import (
    Sample,
    TeacherLogits,
    cache_bytes,
    cached_logits,
    capability_means,
    draw_sft,
    kd_sequence_losses,
    main_teachers,
    pack_samples,
    prompt_groups,
    require_models,
    sft_loss,
    teacher_logits_cache,
    unpack_samples,
    verified_samples,
)
from opd.distill.routing import Routes, capability_kl, prompt_mix, require_routed
from opd.distill.sampler import Sampler
from opd.distill.teachers import Teacher, lm_head_weight
from opd.errors import OpdError
from opd.rl.checkpoint import PLAIN, Checkpointer, Ranks
from opd.rl.distill_loss import row_capability_weights, scatter_tokens
from opd.rl.distributed import load_optimizer_state, optimizer_step, rank0_value, ranks_sum
from opd.rl.estimators import Estimator, EstimatorSettings, Minibatch, get_estimator
from opd.rl.gspo_loss import group_advantages
from opd.rl.packing import TokenRows, hidden_at
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
    # resume until it ends, as offpolicy.pack_samples' tensors), and the completion tokens it trained on.
    warm_step: int = 0
    warm_samples: dict | None = None
    warm_tokens: int = 0
    # its end (the retention check as step 0, fresh Adam moments) is done: a run killed after its last
    # step's checkpoint, in that check, resumes into the end, not past it
    warm_done: bool = False
    # warmstart_loss kl: each capability's running mean sequence KL in the warm start's steps so far (what
    # warmstart_balance d3 draws by; logged every 50 steps)
    warm_kl: dict[str, float] = field(default_factory=dict)


class StudentHidden(torch.nn.Module):
    """The student's forward as the loss reads it: the hidden states that predict each completion
    token (N, H), no logits, from rows laid out by opd.rl.packing. Under DeepSpeed the engine wraps
    this module, so the loss comes from the engine's forward."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, mask, pos, index) -> torch.Tensor:
        return hidden_at(self.lm, TokenRows(ids, mask, pos, index), last_mlp_at_index=True)  # (N, H)


def estimator_of(cfg: DistillConfig) -> Estimator:
    """The config's reverse-KL estimator (opd.rl.estimators), configured by its settings."""
    return get_estimator(cfg.estimator, EstimatorSettings(cfg.kl_weight, cfg.reward_weight, cfg.eps_low,
                                                          cfg.eps_high, cfg.kernel_chunk, cfg.topk,
                                                          domain_norm=cfg.domain_balance == "dn"))


def opd_step(policy, opt, batch: OpdBatch, cfg: DistillConfig, teachers: dict[str, Teacher], backward=None,
             generator: torch.Generator | None = None) -> dict:
    """Minibatch updates on one batch; returns loss, clip and per-teacher KL statistics.

    policy: a `StudentHidden`, or the DeepSpeed engine wrapping one with its `backward(loss) -> grad
    norm` (which also clips and steps). generator: the minibatch split's random source (default torch's
    global one; `sample_ahead` gives each step its own, as another thread may sample meanwhile).
    """
    est = estimator_of(cfg)
    outputs = teacher_outputs(batch, teachers, logits=est.reads_logits, topk=cfg.topk if est.reads_top else None)
    cmask, real = batch.cmask, batch.cmask.bool()
    tok_index = torch.full(real.shape, -1, dtype=torch.long, device=real.device)  # (B, T) -> index among real tokens
    tok_index[real] = torch.arange(int(real.sum()), device=real.device)
    # only a reward term reads rewards (under verifier: none the batch has none and reward_weight is 0)
    reward_adv = group_advantages(batch.rewards).reshape(-1) if cfg.reward_weight > 0 else None  # (B,)
    row_w = row_capability_weights(batch.row_caps, cfg.capability_weights).to(cmask.device)  # (B,)
    row_dom = None  # (B,) each row's capability id, read by domain_norm (domain_balance: dn) alone
    if cfg.domain_balance == "dn":
        cap_ids = {c: i for i, c in enumerate(sorted(set(batch.row_caps)))}
        row_dom = torch.tensor([cap_ids[c] for c in batch.row_caps], device=cmask.device)
    stats: dict[str, list[float]] = {}
    # B = prompts x group rows on every rank, so every rank calls backward equally often (DeepSpeed needs it)
    for rows in minibatches(batch, cfg.updates_per_batch, generator):
        m, r = cmask[rows], real[rows]
        laid = batch.token_rows(rows)
        h = policy(laid.ids, laid.mask, laid.pos, laid.index)  # (n, H)
        W = lm_head_weight(policy.lm)  # (V, H)
        new_lp = scatter_tokens(selective_log_softmax(h, W, batch.targets[rows][r], cfg.kernel_chunk), m)  # (b, T)
        mb = Minibatch(rows, m, h, W, new_lp, None if batch.old_lp is None else batch.old_lp[rows], tok_index[rows][r],
                       row_w[rows], None if reward_adv is None else reward_adv[rows],
                       None if row_dom is None else row_dom[rows])
        loss, st = est.loss(mb, outputs)
        gn = optimizer_step(loss, opt, policy.parameters(), cfg.grad_clip, backward)
        for k, v in {**st, "loss": float(loss.detach()), "grad_norm": float(gn)}.items():
            stats.setdefault(k, []).append(v)
    return {**{k: sum(v) / len(v) for k, v in stats.items()}, **est.batch_stats(batch.old_lp, cmask, outputs)}


# Fields that do not change the trajectory up to a given step: a run may resume under new values
# (e.g. more steps to extend it; not under a cosine schedule, whose every lr depends on `steps`).
# sample_worker: a thread and a process sample the same batches from the same weights and prompt RNG.
RESUMABLE_FIELDS = {"steps", "checkpoint_every", "eval_every", "eval_limit", "report_to", "sample_worker",
                    "teachers_on", "teacher_actors",  # where teachers score: the same targets to float rounding
                    "warmstart_cache_mib"}  # when the warm start's teachers score: the same targets too
# Fields added after runs had checkpoints: left unset they stay out of the identity, so those resume.
UNSET_LATER_FIELDS = ("topk", "capability_weights", "inference_dtype", "compact_every", "warmstart_topk")
# Fields added after runs had checkpoints, whose default is what those runs did: left at it, they
# stay out of the identity too.
DEFAULTED_LATER_FIELDS = {"layout": "padded", "sample_ahead": False, "verifier": "capability",
                          "domain_balance": "none", "warmstart_select": "all",
                          "warmstart_loss": "nll", "warmstart_draws": "pairs", "warmstart_target_temperature": 1.0,
                          "warmstart_balance": "none"}


def run_identity(cfg: DistillConfig) -> dict:
    """What a checkpoint must match for a rerun under `cfg` to continue it."""
    exclude = RESUMABLE_FIELDS - ({"steps"} if cfg.lr_schedule != "constant" else set())
    exclude |= {f for f in UNSET_LATER_FIELDS if getattr(cfg, f) is None}
    exclude |= {f for f, v in DEFAULTED_LATER_FIELDS.items() if getattr(cfg, f) == v}
    return cfg.model_dump(mode="json", exclude=exclude)


def checkpointer(path: Path | None, cfg: DistillConfig, ranks: Ranks = Ranks(), log=print) -> Checkpointer:
    """The run's checkpoint (opd.rl.checkpoint): its identity under "config"; one written before ranks
    were recorded was a plain run's."""
    return Checkpointer(path, ranks, run_identity(cfg), "config", legacy_ranks=PLAIN, log=log)


def step_lr(cfg: DistillConfig, step: int) -> float:
    """The learning rate of step `step` (0-based) under the config's schedule."""
    return cfg.lr if cfg.lr_schedule == "constant" else lr_at(step, cfg.steps - 1, cfg.lr, 0, cfg.lr_min_ratio)


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
    return _normalised({c: w * (1 + strength * max(0.0, 1 - last.get(f"retention/{c}", 1.0))) for c, w in mix.items()})


def kl_scheduled_mix(mix: dict[str, float], history: list[dict], routes: Routes) -> dict[str, float]:
    """D3-MOPD's prompt mix: share_c ∝ mix_c * clip(KL_c / mean_c KL_c, 0.25, 4), KL_c the teacher-weighted
    mean of the latest step's kl/<teacher> over c's teachers (`routes`: capability -> {teacher: weight}).
    `mix` itself before the first step. Derived from the history, so a resumed run draws the same prompts."""
    last = next((r for r in reversed(history) if any(k.startswith("kl/") for k in r)), None)
    if last is None:
        return mix
    kl = {c: v for c in mix if (v := capability_kl(last, routes.get(c, {}))) is not None}
    return kl_shares(mix, kl)


def kl_shares(mix: dict[str, float], kl: dict[str, float]) -> dict[str, float]:
    """share_c ∝ mix_c * clip(KL_c / mean_c KL_c, 0.25, 4) (D3-MOPD; `kl`'s capabilities are among `mix`'s); a
    capability with no KL yet counts as the mean, and `mix` itself while there is none."""
    mean = sum(kl.values()) / len(kl) if kl else 0.0
    if mean <= 0:
        return mix
    return _normalised({c: w * min(4.0, max(0.25, kl.get(c, mean) / mean)) for c, w in mix.items()})


WARM_KL_DECAY = 0.9  # warmstart_balance d3's running mean: a step's capabilities hold ~5 of its 64 pairs each


def running_kl(old: dict[str, float], step: dict[str, float], decay: float = WARM_KL_DECAY) -> dict[str, float]:
    """Each capability's running mean KL after a step with mean KLs `step` (capabilities it did not draw keep
    theirs; one seen the first time starts at its step's value)."""
    return {**old, **{c: decay * old[c] + (1 - decay) * v if c in old else v for c, v in step.items()}}


def _normalised(raw: dict[str, float]) -> dict[str, float]:
    """Shares summing to 1."""
    total = sum(raw.values())
    return {c: v / total for c, v in raw.items()}


def step_mix(cfg: DistillConfig, mix: dict[str, float], history: list[dict], routes: Routes) -> dict[str, float]:
    """The prompt mix of the next step: fixed, adapted to the last retention check, or scheduled by KL."""
    mix = adapted_mix(mix, history, cfg.adaptive_mix)
    return kl_scheduled_mix(mix, history, routes) if cfg.domain_balance == "d3" else mix


def _shared(value, world: int):
    """Rank 0's value on every rank: decisions (keep-best, stop) must not differ between ranks."""
    return value if world == 1 else rank0_value(value)


@dataclass
class _Run:
    """What the phases of one distillation share: the student and its update, the run's state, where it
    checkpoints, and the retention check that keeps the best student."""

    cfg: DistillConfig
    student: torch.nn.Module
    policy: torch.nn.Module  # the student's `StudentHidden`, or the DeepSpeed engine wrapping it
    opt: object
    backward: Callable | None  # the DeepSpeed engine's backward-and-step, or None (torch's)
    rng: random.Random  # the prompt RNG
    state: DistillState
    ckpt: Checkpointer
    ranks: Ranks
    sampler: Sampler
    evaluate_fn: Callable[[object], dict[str, float]] | None
    references: dict[str, float]
    log: Callable
    progress: Callable | None
    tracker: Tracker
    t0: float

    def save(self) -> None:
        self.ckpt.save(self.student, self.opt, self.state.__dict__, self.rng)

    def check(self, rec: dict) -> None:
        """A retention check on val (rank 0 scores; every rank takes its scores) into `rec`; keeps the best student."""
        self.sampler.settle()  # sampling ahead in this process and lm-eval would share torch's global RNG
        scores = _shared(self.evaluate_fn(self.student) if self.ranks.rank == 0 else None, self.ranks.world)
        rec.update(retention_record(scores, self.references))
        self.student.train()
        if rec.get("min_retention", -1.0) > self.state.best_min_retention:
            self.state.best_min_retention, self.state.best_step = rec["min_retention"], self.state.step
            self.state.best_model = {k: v.detach().clone() for k, v in self.student.state_dict().items()}

    def end_step(self, rec: dict) -> None:
        """The step's record into the history, the tracker, the log and the bars; a checkpoint when due."""
        state, cfg = self.state, self.cfg
        last = state.step == cfg.steps
        if self.evaluate_fn is not None and (last or (cfg.eval_every and state.step % cfg.eval_every == 0)):
            self.check(rec)
        state.elapsed = time.time() - self.t0
        state.history.append(rec)
        self.tracker.log(rec, state.step)
        kls = " ".join(f"{k[3:]}={v:.3f}" for k, v in rec.items() if k.startswith("kl/"))
        self.log(f"opd step {state.step}/{cfg.steps}: loss {rec['loss']:.4f} KL {kls}"
                 + (f" min retention {rec['min_retention']:.3f}" if "min_retention" in rec else ""))
        if self.progress:
            self.progress(state, rec)
        if last or state.step % cfg.checkpoint_every == 0:
            self.save()


def _teacher_cache(run: _Run, samples: dict[str, list[Sample]], warm_teachers: dict[str, Teacher],
                   pad_id: int) -> TeacherLogits | None:
    """The warm-start teachers' logits over all their samples (offpolicy.teacher_logits_cache) when they
    fit `warmstart_cache_mib`, else None (each step runs its teachers). Not checkpointed: a resumed run
    recomputes it from the checkpointed samples."""
    cfg = run.cfg
    model = next((t.model for t in warm_teachers.values() if t.model is not None), None)
    vocab = lm_head_weight(model).shape[0] if model is not None else cfg.warmstart_topk  # servers: K a token
    mib = cache_bytes(samples, vocab, cfg.warmstart_topk) / 2**20
    what = "logits" if cfg.warmstart_topk is None else f"top-{cfg.warmstart_topk} log-probs"
    if mib > cfg.warmstart_cache_mib:
        run.log(f"warm start: the teachers' {what} would take {mib:,.0f} MiB, over warmstart_cache_mib "
                f"{cfg.warmstart_cache_mib}: each step runs its teachers")
        return None
    t0 = time.time()
    cache = teacher_logits_cache(samples, warm_teachers, pad_id, cfg.layout, topk=cfg.warmstart_topk)
    n = sum(len(offsets) - 1 for _, offsets, _ in cache.values())
    run.log(f"warm start: the teachers scored their {n:,} distinct samples once ({mib:,.0f} MiB of {what}, "
            f"{time.time() - t0:.0f} s)")
    return cache


def _warm_start(run: _Run, teachers: dict[str, Teacher], routes: Routes, mix: dict[str, float], pad_id: int) -> None:
    """Off-policy distillation before OPD: supervised steps on verified teacher samples, or on all of
    them under verifier: none (see opd.distill.offpolicy), checkpointed every `checkpoint_every * 5`
    steps; `progress(state, None)` after each step. Ends with a retention check (with `evaluate_fn`)
    recorded as step 0, fresh Adam moments for OPD, and a checkpoint."""
    cfg, state, opt = run.cfg, run.state, run.opt
    warm_teachers = main_teachers(teachers, routes)
    if cfg.warmstart_loss == "kl":  # before any sampling
        require_models(warm_teachers, warm_teachers, cfg.warmstart_topk)
    # the live bar's note (opd.distill.bar), where the progress callback has one
    status = getattr(run.progress, "status", None) or (lambda _text: None)
    if state.warm_samples is None:
        verify = cfg.verifier != "none"
        sampling = lambda cap, i, n: status(f"teachers sampling: {cap} ({i + 1}/{n})")  # noqa: E731
        samples = verified_samples(teachers, routes, run.rng, prompts=cfg.warmstart_prompts,
                                   group=cfg.warmstart_group, temperature=cfg.warmstart_temperature,
                                   seed=cfg.seed + run.ranks.rank, verify=verify, prefill=cfg.layout,
                                   select=cfg.warmstart_select, on_capability=sampling)
        run.log(f"warm start: {'verified' if verify else 'unfiltered'} teacher samples"
                + (" (MBR: one per prompt) " if cfg.warmstart_select == "mbr" else " ")
                + " ".join(f"{c}={len(v)}" for c, v in samples.items()))
        if not any(samples.values()):
            raise OpdError(f"warm start: {'the verifier accepted none' if verify else 'no non-empty one'} of the "
                           f"teachers' {cfg.warmstart_group} samples "
                           f"of {cfg.warmstart_prompts} prompts per capability: raise warmstart_prompts or "
                           "warmstart_group, or set warmstart_steps: 0")
        state.warm_samples = pack_samples(samples)  # what each checkpoint saves (tensors, not 10^5 lists)
    else:  # resumed
        samples = unpack_samples(state.warm_samples)
    cache = None
    if cfg.warmstart_loss == "kl" and state.warm_step < cfg.warmstart_steps:
        status("teachers scoring their samples")
        cache = _teacher_cache(run, samples, warm_teachers, pad_id)
    status("")
    groups = {c: prompt_groups(v) for c, v in samples.items()} if cfg.warmstart_draws == "groups" else None
    run.policy.train()
    while state.warm_step < cfg.warmstart_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(state.warm_step, cfg.warmstart_steps - 1, cfg.warmstart_lr, 0, cfg.lr_min_ratio)
        shares = kl_shares(mix, state.warm_kl) if cfg.warmstart_balance == "d3" else mix
        draws = draw_sft(samples, shares, run.rng, cfg.warmstart_batch, cfg.warmstart_draws, groups)
        batch = [(c, samples[c][i]) for c, i in draws]
        if cfg.warmstart_loss == "kl":
            zt = cached_logits(cache, draws) if cache is not None else None
            per_seq, caps, n_tok = kd_sequence_losses(run.policy, batch, warm_teachers, pad_id, cfg.kernel_chunk,
                                                      cfg.layout, zt, cfg.warmstart_target_temperature,
                                                      cfg.warmstart_topk)
            loss = per_seq.mean()
            state.warm_kl = running_kl(state.warm_kl, capability_means(per_seq, caps))  # d3 reads it; logged
        else:
            loss, n_tok = sft_loss(run.policy, [pair for _, pair in batch], pad_id, cfg.kernel_chunk, cfg.layout)
        optimizer_step(loss, opt, run.policy.parameters(), cfg.grad_clip, run.backward)
        state.warm_step += 1
        state.warm_tokens += n_tok
        state.elapsed = time.time() - run.t0
        if run.progress:
            run.progress(state, None)
        if state.warm_step % 50 == 0 or state.warm_step == cfg.warmstart_steps:
            run.log(f"warm start step {state.warm_step}/{cfg.warmstart_steps}: loss {float(loss.detach()):.4f}"
                    + "".join(f" {c}={v:.4f}" for c, v in sorted(state.warm_kl.items())))
        if state.warm_step % (cfg.checkpoint_every * 5) == 0:
            run.save()
    rec = {"step": 0, "phase": "warmstart", "warm_tokens": state.warm_tokens, "gen_tokens": 0}
    if run.evaluate_fn is not None:
        run.check(rec)
        run.log(f"warm start done: min retention {rec['min_retention']:.3f}")
    state.history.append(rec)
    run.tracker.log(rec, 0)
    if run.backward is None:
        opt.state.clear()  # OPD starts with fresh Adam moments (the SFT gradients' scale differs)
    state.warm_samples = None  # done with: OPD's checkpoints need not carry them
    state.warm_done = True
    run.save()


def _batch_record(batch: OpdBatch) -> dict:
    """The batch's mean verifier reward per capability (none under verifier: none)."""
    rec = {}
    for cap in dict.fromkeys(batch.row_caps) if batch.rewards is not None else ():
        rows = [b for b, c in enumerate(batch.row_caps) if c == cap]
        rec[f"reward/{cap}"] = float(batch.rewards.reshape(-1)[rows].mean())
    return rec


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
    progress(state, rec): after each OPD step; rec None after a warm-start step and on resume. Its
    `status(text)` attribute, where it has one (opd.distill.bar), hears what the warm start does before
    its first step.
    """
    mix = prompt_mix(routes, cfg.mix, teacher_weights)
    require_routed("capability_weights", cfg.capability_weights or {}, routes)
    mixed = sorted(c for c, ts in routes.items() if len(ts) > 1)
    if cfg.estimator == "teacher_topk" and cfg.steps > 0 and mixed:
        raise OpdError(f"estimator teacher_topk: {', '.join(mixed)} route to several teachers, whose top-k tokens "
                       "differ: route each capability to one teacher, or use estimator 'full' or 'topk'")
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    ranks = Ranks.join(deepspeed=wrap is not None)
    rng = random.Random(f"opd|{cfg.seed}" + (f"|{ranks.rank}" if ranks.rank else ""))
    torch.manual_seed(cfg.seed + ranks.rank)
    ckpt = checkpointer(ckpt_path, cfg, ranks, log)
    restored = ckpt.restore(student, rng)
    # a checkpoint from before `warm_done`: its warm start ended if it had taken all its steps
    state = (DistillState(**{"warm_done": restored[0]["warm_step"] >= cfg.warmstart_steps, **restored[0]})
             if restored else DistillState())
    if restored:
        log(f"resuming distillation at step {state.step}")
        if progress:
            progress(state, None)  # a resumed run's bars start where it had got to
    policy, backward = StudentHidden(student), None
    if wrap is not None:
        policy, opt, backward = wrap(policy, opt)
    if restored:
        load_optimizer_state(opt, restored[1])
    sampler = Sampler(cfg, student, tokenizer, teachers, routes, ranks.rank, log)
    teachers = sampler.teachers  # where the teachers score: in process, or their Ray actors
    run = _Run(cfg, student, policy, opt, backward, rng, state, ckpt, ranks, sampler, evaluate_fn, references or {},
               log, progress, tracker or Tracker(), time.time() - state.elapsed)
    if cfg.warmstart_steps and not state.warm_done:
        _warm_start(run, teachers, routes, mix, tokenizer.pad_token_id)
    with sampler:
        while state.step < cfg.steps:
            drawn = sampler.next(state.step, step_mix(cfg, mix, state.history, routes), rng)
            t_update = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = step_lr(cfg, state.step)
            rec = {"step": state.step + 1, "lr": opt.param_groups[0]["lr"],
                   **opd_step(policy, opt, drawn.batch, cfg, teachers, backward, drawn.generator)}
            # where a step's seconds go: student sampling, teacher (and old-policy) scoring, the update
            rec.update({"time/sample": drawn.sample_s, "time/score": drawn.score_s,
                        "time/update": time.perf_counter() - t_update}, **_batch_record(drawn.batch))
            state.step += 1
            gen = drawn.batch.gen_tokens
            state.gen_tokens += gen if ranks.world == 1 else ranks_sum(gen)  # student tokens over all ranks
            rec["gen_tokens"] = state.gen_tokens
            if state.warm_tokens:
                rec["warm_tokens"] = state.warm_tokens  # teacher-sample tokens of the off-policy warm start
            run.end_step(rec)
            if stop is not None and _shared(stop(rec), ranks.world):
                break
    if ranks.world > 1:
        dist.barrier()  # every rank's last checkpoint is written before rank 0 removes them
    return state
