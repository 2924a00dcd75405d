"""The GSPO loop: roll out groups, score them with the capability's verifier, update the policy.

One step = one rollout batch (prompts x group) followed by `updates_per_batch` minibatch updates
against the logprobs of the policy that sampled it. Resumable: a checkpoint (model, optimizer,
RNG states, prompt cursor, best-so-far) is written every `checkpoint_every` steps.

It takes its GSPO settings and its run settings (opd.expert.settings), not an expert spec: the
expert recipe (opd.expert.run) resolves a spec into both. The maths are in opd.rl.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from opd.capabilities import get_capability, prompt_texts
from opd.capabilities.reward_model import load_reward_model
from opd.capabilities.rewards import GuardedReward, get_reward
from opd.devices import model_device
from opd.expert.settings import GSPOConfig, GSPORun
from opd.rl.batch import group_rollouts, grouped_completion_logits, token_entropy, token_logprobs
from opd.rl.checkpoint import Checkpointer, Ranks
from opd.rl.distributed import load_optimizer_state, optimizer_step, ranks_min
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


def _rollout_batch(engine, cap, rng, g: GSPOConfig, run: GSPORun, state: RunState, seed: int, reward_model=None):
    """Sample groups until `min_informative` of them have mixed rewards (or resampling runs out).
    `reward_model` (opd.capabilities.reward_model.RewardModel): each group is scored by it in one batch
    instead of by `run.reward`, and the hidden rule's score of the same samples is logged beside it."""
    reward = GuardedReward(get_reward(run.reward), run.reward_timeout_s) if reward_model is None else None
    learned: dict[str, list[float]] = {"rm_reward": [], "rule_reward": []}
    params = SamplingParams(temperature=state.temperature,
                            max_new_tokens=g.max_new_tokens or cap.max_new_tokens + 1, seed=seed)
    kept, seen, gen_tokens = [], 0, 0
    for round_ in range(1 + g.max_resample):
        items = [cap.sample(rng, "train", run.difficulty) for _ in range(g.prompts_per_step)]
        groups = engine.generate(prompt_texts(items, getattr(engine, "tokenizer", None)), g.group_size,
                                 SamplingParams(**{**params.__dict__, "seed": seed * 31 + round_}))
        for it, group in zip(items, groups):
            if reward_model is None:
                rewards = [reward(r.text, it.answer, cap) for r in group]
            else:
                rewards = reward_model.score([it.prompt] * len(group), [r.text for r in group])
                learned["rm_reward"] += rewards
                # logged only, never trained on: how far the reward model's score and the rule part
                learned["rule_reward"] += [cap.verify(r.text, it.answer) for r in group]
            gen_tokens += sum(len(r.completion_ids) for r in group)
            seen += 1
            if not g.drop_zero_variance or max(rewards) > min(rewards):
                kept.append((group, rewards))
        if len(kept) >= g.min_informative * g.prompts_per_step:
            break
    informative = sum(max(r) > min(r) for _, r in kept)
    failures = {"reward_errors": reward.errors, "reward_timeouts": reward.timeouts} if reward is not None else \
        {k: sum(v) / max(1, len(v)) for k, v in learned.items()}
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
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return kept
    return kept[: ranks_min(len(kept))]


def out_of_patience(step: int, best_step: int, eval_every: int, patience: int | None) -> bool:
    """Whether the last `patience` screenings up to `step` all came after the kept checkpoint at
    `best_step` (screenings fall on every `eval_every`-th step; the kept one is step 0 or one of them)."""
    return patience is not None and step // eval_every - best_step // eval_every >= patience


def checkpointer(path: Path, run: GSPORun, ranks: Ranks = Ranks(), log=print) -> Checkpointer:
    """The run's checkpoint (opd.rl.checkpoint). Its identity is the run's job, under "spec" (the name
    checkpoints written before the loop took settings gave it); a checkpoint of another job
    (`run.resumes`: an expert's changed spec) is passed over, as is one of other ranks. One written
    before ranks were recorded resumes under any."""
    return Checkpointer(path, ranks, run.job, "spec", resumes=run.resumes, log=log)


def train(g: GSPOConfig, run: GSPORun, model, tokenizer, ckpt_path: Path, *, evaluate_fn, log=print,
          progress=None, wrap=None, tracker: Tracker | None = None, extra_eval_fn=None) -> RunState:
    """Run GSPO with settings `g` until `run.steps` or `run.max_minutes`; returns the state holding
    the best model.

    `evaluate_fn(model) -> float` screens on validation; `wrap(model, opt) -> (model, opt, backward)`
    swaps in a DeepSpeed engine; `tracker` (opd.tracking) gets every history record;
    `progress(state, rec)` after each step, with rec None once on resume; `extra_eval_fn(model) -> dict`
    adds logged-only numbers at each screening (a learned reward's score on val); the best model is
    still the one `evaluate_fn` picks.
    """
    tracker = tracker or Tracker()
    cap = get_capability(run.capability)
    reward_model = load_reward_model(run.reward_model, cap.name, tokenizer) if run.reward == "reward_model" else None
    # fused: one kernel for every parameter instead of a dozen ops each (tiny models are all overhead)
    opt = torch.optim.AdamW(model.parameters(), lr=g.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    ref_model = copy.deepcopy(model).eval() if g.kl_coef > 0 else None
    # Each rank of a data-parallel run samples its own prompts and completions; the ranks agree on a
    # resume step before the engine exists.
    ranks = Ranks.join(deepspeed=wrap is not None)
    rng = prompt_rng(run, ranks.rank)
    torch.manual_seed(run.seed + ranks.rank)
    ckpt = checkpointer(ckpt_path, run, ranks, log)
    restored = ckpt.restore(model, rng)
    state, optim_state = (RunState(**restored[0]), restored[1]) if restored else (None, None)
    if state is None:
        state = RunState(temperature=g.temperature)
        state.best_score = evaluate_fn(model)
        state.best_model = copy.deepcopy(model.state_dict())
        log(f"step 0: val {run.capability} = {state.best_score:.3f}")
        first = {"val": state.best_score, **(extra_eval_fn(model) if extra_eval_fn else {})}
        if extra_eval_fn:
            state.history.append({"step": 0, **first})
        tracker.log(first, 0)
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

    def stopped(st: RunState) -> bool:
        return out_of_patience(st.step, st.best_step, run.eval_every, run.patience)

    while state.step < run.steps and time.time() - t0 < run.max_minutes * 60 and not stopped(state):
        t_roll = time.time()
        kept, share, gen_tokens, failures = _rollout_batch(engine, cap, rng, g, run, state,
                                                           seed=run.seed * 100_003 + state.step + ranks.rank * 1_000_003,
                                                           reward_model=reward_model)
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
            if extra_eval_fn:
                rec.update(extra_eval_fn(policy))
            if rec["val"] > state.best_score:
                state.best_score, state.best_step = rec["val"], state.step
                state.best_model = copy.deepcopy(policy.state_dict())
            log(f"step {state.step}: val {rec['val']:.3f} (best {state.best_score:.3f}@{state.best_step}) "
                f"reward {rec.get('reward', 0):.3f} informative {share:.2f} clip {rec.get('clip_fraction', 0):.2f} "
                f"ratio [{rec.get('ratio_min', 1):.4f}, {rec.get('ratio_max', 1):.4f}] T {state.temperature:.2f} "
                f"{state.elapsed / 60 if state.elapsed else (time.time() - t0) / 60:.1f} min")
            if stopped(state):
                log(f"stopping at step {state.step}: {run.patience} screenings without a better checkpoint "
                    f"than step {state.best_step} (patience)")
        state.history.append(rec)
        tracker.log(rec, state.step)
        state.elapsed = time.time() - t0
        if progress:
            progress(state, rec)
        if state.step % run.checkpoint_every == 0:
            ckpt.save(policy, opt, state.__dict__, rng)
    return state
