"""The GSPO loop: roll out groups, score them with the capability's verifier, update the policy.

One step = one rollout batch (prompts x group) followed by `updates_per_batch` minibatch updates
against the logprobs of the policy that sampled it. Resumable: a checkpoint (model, optimizer,
RNG states, prompt cursor, best-so-far) is written every `checkpoint_every` steps.

It takes its GSPO settings and its run settings (opd.expert.settings), not an expert spec: the
expert recipe (opd.expert.run) resolves a spec into both. The maths are in opd.rl.
"""

from __future__ import annotations

import copy
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opd.capabilities import get_capability, prompt_texts
from opd.capabilities.rewards import GuardedReward, get_reward
from opd.devices import model_device
from opd.expert.settings import GSPOConfig, GSPORun
from opd.io import atomic_torch_save, readable_checkpoints
from opd.rl.batch import group_rollouts, grouped_completion_logits, token_entropy, token_logprobs
from opd.rl.distributed import (
    common_step,
    init_distributed,
    load_optimizer_state,
    optimizer_step,
    rank_path,
    ranks_min,
    zero_checkpoint_globals,
)
from opd.rl.gspo_loss import group_advantages, gspo_loss, truncated_is_weights
from opd.rl.packed_logits import PackedLogits
from opd.rollout import SamplingParams, get_engine
from opd.tracking import Tracker


@dataclass
class RunState:
    step: int = 0
    elapsed: float = 0.0
    temperature: float = 1.0
    best_score: float = -1.0
    best_step: int = 0
    best_model: dict | None = None
    history: list[dict] = field(default_factory=list)


def prompt_rng(run: GSPORun, rank: int = 0) -> random.Random:
    """The RNG the loop draws its training prompts from: each step takes `prompts_per_step`
    `cap.sample(rng, "train", run.difficulty)` items in turn (more when it resamples)."""
    return random.Random(f"gspo|{run.capability}|{run.seed}" + (f"|{rank}" if rank else ""))


def _rollout_batch(engine, cap, rng, g: GSPOConfig, run: GSPORun, state: RunState, seed: int):
    """Sample groups until `min_informative` of them have mixed rewards (or resampling runs out)."""
    reward = GuardedReward(get_reward(run.reward), run.reward_timeout_s)
    params = SamplingParams(temperature=state.temperature,
                            max_new_tokens=g.max_new_tokens or cap.max_new_tokens + 1, seed=seed)
    kept, seen, gen_tokens = [], 0, 0
    for round_ in range(1 + g.max_resample):
        items = [cap.sample(rng, "train", run.difficulty) for _ in range(g.prompts_per_step)]
        groups = engine.generate(prompt_texts(items, getattr(engine, "tokenizer", None)), g.group_size,
                                 SamplingParams(**{**params.__dict__, "seed": seed * 31 + round_}))
        for it, group in zip(items, groups):
            rewards = [reward(r.text, it.answer, cap) for r in group]
            gen_tokens += sum(len(r.completion_ids) for r in group)
            seen += 1
            if not g.drop_zero_variance or max(rewards) > min(rewards):
                kept.append((group, rewards))
        if len(kept) >= g.min_informative * g.prompts_per_step:
            break
    informative = sum(max(r) > min(r) for _, r in kept)
    failures = {"reward_errors": reward.errors, "reward_timeouts": reward.timeouts}
    return kept[: g.prompts_per_step], informative / max(1, seen), gen_tokens, failures


def gspo_step(model, opt, ref_model, kept, g: GSPOConfig, pad_id: int, backward=None) -> dict:
    """Updates on one rollout batch; returns the stats GSPO practitioners watch. Every tensor is built
    on the model's device (a DeepSpeed engine's: it moved the module there)."""
    device = model_device(model)
    rewards = torch.tensor([rw for _, rw in kept], dtype=torch.float32, device=device)  # (P, G)
    # shuffled once (on the CPU generator, so a CPU and a GPU run draw the same order): minibatches are
    # consecutive rows
    if g.minibatch == "groups":  # whole groups in shuffled order: a minibatch holds each of its prompts' rows
        P, G = rewards.shape
        order = (torch.randperm(P)[:, None] * G + torch.arange(G)).reshape(-1).tolist()
    else:
        order = torch.randperm(rewards.numel()).tolist()
    adv = group_advantages(rewards).reshape(-1)[order]  # (B,)
    rollouts = [r for group, _ in kept for r in group]
    rollouts = [rollouts[i] for i in order]
    # A group's samples share their prompt, which each forward below runs once per group.
    batch = group_rollouts([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id, device)
    logits_of = grouped_completion_logits if g.layout == "grouped" else \
        PackedLogits([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    cmask, targets = batch.cmask, batch.completion_ids  # (B, Tc)
    engine_lp = torch.tensor([r.logprobs + [0.0] * (cmask.shape[1] - len(r.logprobs)) for r in rollouts],
                             device=device)  # (B, Tc)
    with torch.no_grad():
        ref_lp = token_logprobs(grouped_completion_logits(ref_model, batch), targets) \
            if ref_model is not None else None
    old_lp = None if g.recompute_old_logprobs else engine_lp
    is_w, engine_stats = None, {}
    stats: dict[str, list[float]] = {}
    for chunk in torch.arange(len(rollouts), device=device).chunk(g.updates_per_batch):
        if old_lp is None:
            # The policy has not moved since the rollout, so the first minibatch's pass, run on
            # through the other rows without gradient, is the trainer's recompute of every old logprob.
            logits = logits_of(model, batch, n_grad=len(chunk))  # (B, Tc, V)
            new_lp = token_logprobs(logits, targets)
            old_lp = new_lp.detach()
            logits, new_lp = logits[chunk], new_lp[chunk]
            # The trainer's old policy against the engine's: logged, and with tis_cap the TIS weight.
            is_w, engine_stats = truncated_is_weights(old_lp, engine_lp, cmask, g.tis_cap, g.level)
        else:
            logits = logits_of(model, batch, chunk)  # (b, Tc, V)
            new_lp = token_logprobs(logits, targets[chunk])
        loss, st = gspo_loss(new_lp, old_lp[chunk], adv[chunk], cmask[chunk], g.eps_low, g.eps_high,
                             level=g.level, kl_coef=g.kl_coef,
                             logp_ref=ref_lp[chunk] if ref_lp is not None else None,
                             is_weights=is_w[chunk] if is_w is not None else None)
        gn = optimizer_step(loss, opt, model.parameters(), g.grad_clip, backward)
        with torch.no_grad():
            ent = (token_entropy(logits) * cmask[chunk]).sum() / cmask[chunk].sum()
        for k, v in {**st, "loss": loss, "grad_norm": gn, "entropy": ent}.items():
            stats.setdefault(k, []).append(float(v.detach()) if torch.is_tensor(v) else float(v))
    out = {k: sum(v) / len(v) for k, v in stats.items()}
    mismatch = ((old_lp - engine_lp).abs() * cmask).sum() / cmask.sum()
    out.update(engine_stats, reward=float(rewards.mean()), logprob_mismatch=float(mismatch),
               trained_tokens=float(cmask.sum()) * g.updates_per_batch)
    return out


def _same_size_on_all_ranks(kept: list) -> list:
    """DeepSpeed needs the same number of backward calls on every rank: keep the smallest count
    of groups any rank kept (0 everywhere means every rank skips the update)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return kept
    return kept[: ranks_min(len(kept))]


def save_checkpoint(path: Path, model, opt, state: RunState, rng: random.Random, run: GSPORun) -> None:
    # "spec": the run's job under the name checkpoints written before the loop took settings gave it
    atomic_torch_save({"spec": run.job, "model": model.state_dict(),
                       "optim": opt.state_dict(), "state": state.__dict__, "rng": rng.getstate(),
                       "torch_rng": torch.get_rng_state()}, path, keep_previous=True)


def load_checkpoint(path: Path, model, rng: random.Random, run: GSPORun, log=print, world: int = 1
                    ) -> tuple[RunState, dict] | None:
    """Restore model and RNGs; the optimizer state is returned, to be loaded once the optimizer
    is final (a DeepSpeed ZeRO optimizer only exists after `wrap`). An unreadable checkpoint falls
    back to the previous one, then to a fresh start (`opd.io.load_checkpoint`). With `world` > 1
    ranks (collective: every rank calls it) the latest step that every rank holds, as OPD does: a
    run killed between two ranks' saves resumes every rank from the older one. A checkpoint of
    another job (`run.resumes`: an expert's changed spec) is passed over."""
    # a ZeRO optimizer's state holds a few DeepSpeed classes
    found = {c["state"]["step"]: c for c in reversed(list(readable_checkpoints(
        path, log, zero_checkpoint_globals() if run.deepspeed else None))) if run.resumes(c.get("spec"))}
    if world > 1:
        step = common_step(list(found))
        ck = found.get(step) if step is not None else None
    else:
        ck = next(iter(reversed(found.values())), None)  # the newest readable one
    if ck is None:
        return None
    model.load_state_dict(ck["model"])
    rng.setstate(ck["rng"])
    torch.set_rng_state(ck["torch_rng"])
    return RunState(**ck["state"]), ck["optim"]


def train(g: GSPOConfig, run: GSPORun, model, tokenizer, ckpt_path: Path, *, evaluate_fn, log=print,
          progress=None, wrap=None, tracker: Tracker | None = None) -> RunState:
    """Run GSPO with settings `g` until `run.steps` or `run.max_minutes`; returns the state holding
    the best model.

    `evaluate_fn(model) -> float` screens on validation; `wrap(model, opt) -> (model, opt, backward)`
    swaps in a DeepSpeed engine; `tracker` (opd.tracking) gets every history record;
    `progress(state, rec)` after each step, with rec None once on resume.
    """
    tracker = tracker or Tracker()
    cap = get_capability(run.capability)
    # fused: one kernel for every parameter instead of a dozen ops each (tiny models are all overhead)
    opt = torch.optim.AdamW(model.parameters(), lr=g.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    ref_model = copy.deepcopy(model).eval() if g.kl_coef > 0 else None
    # Each rank of a data-parallel run samples its own prompts and completions.
    rank = int(os.environ.get("RANK", "0")) if wrap is not None else 0
    rng = prompt_rng(run, rank)
    torch.manual_seed(run.seed + rank)
    world = int(os.environ.get("WORLD_SIZE", "1")) if wrap is not None else 1
    if world > 1:
        init_distributed()  # the ranks agree on a resume step before the engine exists
    loaded = load_checkpoint(rank_path(ckpt_path, rank), model, rng, run, log, world)
    state, optim_state = loaded if loaded else (None, None)
    if state is None:
        state = RunState(temperature=g.temperature)
        state.best_score = evaluate_fn(model)
        state.best_model = copy.deepcopy(model.state_dict())
        log(f"step 0: val {run.capability} = {state.best_score:.3f}")
        tracker.log({"val": state.best_score}, 0)
    else:
        log(f"resuming {run.name} at step {state.step} (best val {state.best_score:.3f} at step {state.best_step})")
        if progress:
            progress(state, None)  # a resumed run's bar starts where it had got to
    backward = None
    if wrap is not None:
        model, opt, backward = wrap(model, opt)
        if optim_state is not None:
            load_optimizer_state(opt, optim_state)
    elif optim_state is not None:
        opt.load_state_dict(optim_state)
    policy = getattr(model, "module", model)
    if ref_model is not None:  # a DeepSpeed engine may have moved the policy onto the local rank's GPU
        ref_model.to(model_device(model))
    engine = get_engine(run.engine, model=policy, tokenizer=tokenizer, **run.engine_args)
    t0 = time.time() - state.elapsed
    while state.step < run.steps and time.time() - t0 < run.max_minutes * 60:
        t_roll = time.time()
        kept, share, gen_tokens, failures = _rollout_batch(engine, cap, rng, g, run, state,
                                                           seed=run.seed * 100_003 + state.step + rank * 1_000_003)
        t_roll = time.time() - t_roll
        # Stalled groups carry no signal: raise temperature while informative groups are scarce.
        if share < g.min_informative:
            state.temperature = min(g.max_temperature, state.temperature * 1.1)
        elif share > 0.8 and state.temperature > g.temperature:
            state.temperature = max(g.temperature, state.temperature / 1.1)
        t_upd = time.time()
        if backward is not None:
            kept = _same_size_on_all_ranks(kept)
        st = gspo_step(model, opt, ref_model, kept, g, tokenizer.pad_token_id, backward) if kept else {}
        t_upd = time.time() - t_upd
        engine.sync_weights(policy)
        state.step += 1
        rec = {"step": state.step, "informative": share, "temperature": state.temperature,
               "groups": len(kept), "rollout_tok_s": gen_tokens / max(t_roll, 1e-9),
               "train_tok_s": st.get("trained_tokens", 0) / max(t_upd, 1e-9), **failures, **st}
        if state.step % run.eval_every == 0:
            rec["val"] = evaluate_fn(policy)
            if rec["val"] > state.best_score:
                state.best_score, state.best_step = rec["val"], state.step
                state.best_model = copy.deepcopy(policy.state_dict())
            log(f"step {state.step}: val {rec['val']:.3f} (best {state.best_score:.3f}@{state.best_step}) "
                f"reward {rec.get('reward', 0):.3f} informative {share:.2f} clip {rec.get('clip_fraction', 0):.2f} "
                f"ratio [{rec.get('ratio_min', 1):.4f}, {rec.get('ratio_max', 1):.4f}] T {state.temperature:.2f} "
                f"{state.elapsed / 60 if state.elapsed else (time.time() - t0) / 60:.1f} min")
        state.history.append(rec)
        tracker.log(rec, state.step)
        state.elapsed = time.time() - t0
        if progress:
            progress(state, rec)
        if state.step % run.checkpoint_every == 0:
            save_checkpoint(rank_path(ckpt_path, rank), policy, opt, state, rng, run)
    return state
