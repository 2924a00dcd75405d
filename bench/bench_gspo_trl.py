"""GSPO throughput: opd's loop against TRL's `GRPOTrainer(importance_sampling_level="sequence")`.

    pip install "torch==2.13.0" "trl==1.16.*"   # benchmark-only dependency (the bench extra); keeps the CPU torch
    python bench/bench_gspo_trl.py [--base runs/base] [--capability count] [--steps 6] [--threads 1]

The GSPO settings (prompts per batch, group, updates per batch, lr, clip range, completion cap) are
the capability's shipped expert spec's (experts/<capability>.yaml: 16 prompts x 8, 4 updates, lr 1e-4,
clip 3e-4 / 4e-4), each overridable by its flag. opd's embedded engine samples with --engine-args
(default: compact_every 3, packed prefill: the same sampling distribution, without computing the rows
that have stopped or the prompts' padding; see opd.rollout.embedded); `--engine-args ''` is the engine's
defaults. Its update lays the rows out --layout (default packed: one forward without padding, each prompt
once; GSPOConfig.layout). Neither changes what is sampled or the loss (same values to float rounding).
Its minibatches are --minibatch (default groups: whole groups in shuffled order, GSPOConfig.minibatch;
TRL splits rows), so a minibatch runs each prompt once for all its samples: the same objective split
another way, whose learning the rewards and val scores below show.

Both trainers start from the same weights and see the same prompts in the same order (the stream
opd's loop draws from the capability's train split; TRL's dataset shuffling is off), group size,
completion length, learning rate, clip range and number of updates per rollout batch: opd's
`updates_per_batch` minibatches are TRL's `steps_per_generation`. opd keeps every group (no
zero-variance dropping, no resampling) so both generate exactly prompts x group completions per
rollout batch. Both train in fp32 without activation checkpointing (TRL's defaults would turn on
bf16 and gradient checkpointing). Without --base (or when it does not exist) a lab-like Qwen3 is
built with `opd.lab.model.build_model` and pre-trained on the capability for a few seconds, so
rewards start between 0 and 1 and the learning curves can move.

Each trainer runs --repeats times, alternating which goes first, since the machine may be shared.
Prints the torch thread count, completion tokens per second of each run, the ratio per repeat and
of the medians, the mean reward of each rollout batch for both, and (untimed) the greedy val score
of the start model and of both trained models.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load average {os.getloadavg()}"


def pretrained_lab_model(capability: str, hidden: int, layers: int, steps: int):
    from opd.lab.model import ModelShape
    from opd.lab.pico import pretrain_pico

    shape = ModelShape(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=2 * hidden, max_position_embeddings=64)
    return pretrain_pico(capability, steps, shape)


def opd_settings(args):
    """The GSPO loop's settings and run settings (no expert spec: the model is in memory)."""
    from opd.expert.settings import GSPOConfig, GSPORun

    gspo = GSPOConfig(prompts_per_step=args.prompts, group_size=args.group, updates_per_batch=args.updates,
                      lr=args.lr, eps_low=args.eps_low, eps_high=args.eps_high, max_new_tokens=args.max_new_tokens,
                      drop_zero_variance=False, min_informative=0.0, max_resample=0, layout=args.layout,
                      minibatch=args.minibatch)
    run = GSPORun(name=args.capability, capability=args.capability, steps=args.steps, seed=args.seed,
                  eval_every=10**6, checkpoint_every=10**6, max_minutes=10**6, engine_args=engine_args(args))
    return gspo, run


def engine_args(args) -> dict:
    """--engine-args 'compact_every=3,prefill=packed' as the embedded engine's keyword arguments."""
    out = {}
    for kv in filter(None, args.engine_args.split(",")):
        k, v = kv.split("=")
        out[k] = int(v) if v.isdigit() else v
    return out


def shipped(args) -> str:
    """Fill the GSPO settings not given on the command line from the capability's shipped expert spec."""
    from opd.expert.settings import GSPOConfig
    from opd.expert.spec import load_expert_spec

    path = Path(__file__).resolve().parents[1] / "experts" / f"{args.capability}.yaml"
    g = load_expert_spec(path).gspo if path.exists() else GSPOConfig()
    for flag, field in (("prompts", "prompts_per_step"), ("group", "group_size"), ("updates", "updates_per_batch"),
                        ("lr", "lr"), ("eps_low", "eps_low"), ("eps_high", "eps_high"),
                        ("max_new_tokens", "max_new_tokens")):
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(g, field))
    if args.max_new_tokens is None:  # the loop's own default: the capability's cap + 1 (its stop token)
        from opd.capabilities import get_capability

        args.max_new_tokens = get_capability(args.capability).max_new_tokens + 1
    return str(path.relative_to(path.parents[1])) if path.exists() else "GSPOConfig defaults"


def run_opd(model, tok, args) -> dict:
    """opd's own loop (`opd.expert.trainer.train`) with screening and checkpoints out of the way."""
    from opd.expert.trainer import train

    gspo, run = opd_settings(args)
    with tempfile.TemporaryDirectory() as d:
        t0, c0 = time.perf_counter(), time.process_time()
        state = train(gspo, run, model, tok, Path(d) / "state.pt", evaluate_fn=lambda m: 0.0, log=lambda *_: None)
        seconds = time.perf_counter() - t0
    # trained_tokens counts each completion token once per update pass over the batch
    tokens = sum(r["trained_tokens"] / args.updates for r in state.history)
    return {"seconds": seconds, "cpu": time.process_time() - c0, "tokens": tokens,
            "rewards": [r["reward"] for r in state.history]}


def run_trl(model, tok, args) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from opd.capabilities import get_capability
    from opd.capabilities.rewards import get_reward
    from opd.expert.trainer import prompt_rng

    cap = get_capability(args.capability)
    verifier = get_reward("verifier")
    # opd's prompt stream, in opd's order (TRL's shuffling is off): batch k holds the same prompts in both
    _, run = opd_settings(args)
    rng = prompt_rng(run)
    items = [cap.sample(rng, "train", run.difficulty) for _ in range(args.prompts * args.steps)]
    data = Dataset.from_list([{"prompt": it.prompt, "answer": it.answer} for it in items])
    tokens = []

    def reward(completions, answer, completion_ids, **_):
        # TRL passes the generated ids, each cut after its stop token ("\n" or <eos>) as opd's are.
        tokens.append(sum(len(ids) for ids in completion_ids))
        return [verifier(c, a, cap) for c, a in zip(completions, answer)]

    batch = args.prompts * args.group
    with tempfile.TemporaryDirectory() as d:
        config = GRPOConfig(
            # one log per rollout batch (its reward), no progress bar: TRL's own overheads kept small
            output_dir=d, use_cpu=True, report_to="none", save_strategy="no", logging_steps=args.updates,
            disable_tqdm=True,
            seed=args.seed, shuffle_dataset=False,
            learning_rate=args.lr, max_grad_norm=1.0, lr_scheduler_type="constant",
            # opd trains in fp32 without activation recomputation; TRL's defaults are bf16=True and
            # gradient_checkpointing=True (the latter costs TRL an extra forward pass per update)
            bf16=False, gradient_checkpointing=False,
            importance_sampling_level="sequence", loss_type="grpo", beta=0.0,
            epsilon=args.eps_low, epsilon_high=args.eps_high, scale_rewards="group",
            num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=1.0, top_k=0,
            # one rollout batch of prompts x group, split into `updates` optimizer steps (as opd's minibatches)
            per_device_train_batch_size=batch // args.updates, steps_per_generation=args.updates,
            gradient_accumulation_steps=1, max_steps=args.steps * args.updates,
            # stop where the lab's answers end (its generation_config lists "\n" and <eos>)
            generation_kwargs={"eos_token_id": model.generation_config.eos_token_id},
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                              processing_class=tok)
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    # TRL logs the reward once per generation, i.e. once per rollout batch
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"seconds": seconds, "cpu": cpu, "tokens": sum(tokens), "rewards": rewards}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="runs/base", help="HF model directory (default: a lab-like model built here)")
    ap.add_argument("--capability", default="count")
    ap.add_argument("--steps", type=int, default=6, help="rollout batches")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per rollout batch (default: the spec's)")
    ap.add_argument("--group", type=int, default=None, help="samples per prompt (default: the spec's)")
    ap.add_argument("--updates", type=int, default=None, help="optimizer steps per rollout batch (default: the spec's)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="completion cap (default: the spec's, else the capability's + 1 as opd's loop)")
    ap.add_argument("--lr", type=float, default=None, help="default: the spec's")
    ap.add_argument("--eps-low", type=float, default=None, help="default: the spec's")
    ap.add_argument("--eps-high", type=float, default=None, help="default: the spec's")
    ap.add_argument("--layout", choices=["grouped", "packed"], default="packed",
                    help="opd's update layout (GSPOConfig.layout): the same values and gradients to float rounding")
    ap.add_argument("--minibatch", choices=["rows", "groups"], default="groups",
                    help="opd's minibatch split (GSPOConfig.minibatch): 'groups' keeps a prompt's samples together")
    ap.add_argument("--engine-args", default="compact_every=3,prefill=packed",
                    help="opd's embedded engine options (k=v,...; '' for its defaults): same sampling distribution")
    ap.add_argument("--hidden", type=int, default=64, help="width of the built model (no --base)")
    ap.add_argument("--layers", type=int, default=2, help="blocks of the built model (no --base)")
    ap.add_argument("--pretrain-steps", type=int, default=120, help="SFT steps of the built model (no --base)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (on a loaded 2-core box, 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each trainer, alternating which goes first; the ratio is of median tok/s")
    ap.add_argument("--val", type=int, default=200,
                    help="score the start and both final models on this many val items (0 = skip)")
    args = ap.parse_args(argv)
    try:
        import trl
    except ImportError:
        print('bench_gspo_trl: TRL is not installed; it is a benchmark-only dependency:\n'
              '  pip install trl "torch==2.13.0"   (the pin keeps the CPU torch)', file=sys.stderr)
        return 2
    source_settings = shipped(args)
    if (args.prompts * args.group) % args.updates:
        ap.error("--prompts x --group must be divisible by --updates")

    torch.set_num_threads(args.threads)
    if Path(args.base, "config.json").exists():
        from opd.expert.build import load_base

        model, tok = load_base(args.base)
        source = args.base
    else:
        model, tok = pretrained_lab_model(args.capability, args.hidden, args.layers, args.pretrain_steps)
        source = f"built: hidden {args.hidden}, {args.layers} layers, {args.pretrain_steps} SFT steps"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; trl {trl.__version__}; model {source} "
          f"({n_params / 1e6:.2f}M params); {args.capability}: {args.steps} batches x {args.prompts} prompts x "
          f"{args.group} samples, <= {args.max_new_tokens} new tokens, {args.updates} updates per batch, lr "
          f"{args.lr:g}, clip {args.eps_low:g} / {args.eps_high:g} (from {source_settings}); {uptime()}")
    print(f"settings that differ: opd's engine samples with {engine_args(args) or 'its defaults'} (TRL: "
          "transformers generate on left-padded prompts, every row to the longest answer); opd's update layout "
          f"{args.layout} (TRL: one right-padded row per completion), minibatches of {args.minibatch} (TRL: rows); "
          "opd keeps every group "
          "(no zero-variance dropping or resampling, as TRL)")

    runs: dict[str, list[dict]] = {"opd": [], "trl": []}
    trained = {}
    for rep in range(args.repeats):
        # alternate who goes first, so a change in the shared machine's load hits both alike
        order = (("opd", run_opd), ("trl", run_trl)) if rep % 2 == 0 else (("trl", run_trl), ("opd", run_opd))
        for name, run in order:
            torch.manual_seed(args.seed)
            trained[name] = copy.deepcopy(model)
            runs[name].append(r := run(trained[name], tok, args))
            print(f"{name}: {r['seconds']:.1f} s ({r['cpu']:.1f} s CPU), {r['tokens']:.0f} completion tokens, "
                  f"{r['tokens'] / r['seconds']:.0f} tok/s, {r['seconds'] / args.steps:.2f} s per batch; load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
    tok_s = {name: [r["tokens"] / r["seconds"] for r in rs] for name, rs in runs.items()}
    ratios = [o / t for o, t in zip(tok_s["opd"], tok_s["trl"])]
    print("opd / trl throughput per repeat: " + " ".join(f"{x:.2f}x" for x in ratios))
    print(f"opd / trl throughput: {statistics.median(tok_s['opd']) / statistics.median(tok_s['trl']):.2f}x "
          f"(median tok/s: opd {statistics.median(tok_s['opd']):.0f}, trl {statistics.median(tok_s['trl']):.0f})")
    cpu_ratio = (sum(r["tokens"] for r in runs["opd"]) / sum(r["cpu"] for r in runs["opd"])) / (
        sum(r["tokens"] for r in runs["trl"]) / sum(r["cpu"] for r in runs["trl"]))
    print(f"opd / trl per CPU second (both one process; steadier than wall time on a shared machine): {cpu_ratio:.2f}x")
    print("reward per rollout batch:")
    for name, rs in runs.items():
        print(f"  {name}: " + " ".join(f"{x:.2f}" for x in rs[-1]["rewards"]))
    if args.val:
        from opd.evaluation.api import evaluate

        # Untimed: the same greedy lm-eval task for the start model and both final models.
        score = {name: evaluate(m, tok, [args.capability], "val", limit=args.val, use_cache=False)[args.capability]
                 for name, m in (("start", model), *trained.items())}
        print(f"val {args.capability} (first {args.val} items, greedy): "
              + ", ".join(f"{name} {sc.score:.3f} +- {sc.stderr:.3f}" for name, sc in score.items()))
    print(uptime())
    print(f"ratio: {statistics.median(tok_s['opd']) / statistics.median(tok_s['trl']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
