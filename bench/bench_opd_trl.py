"""On-policy distillation throughput: opd's OPD against TRL 1.16's `DistillationTrainer`, at equal or
better quality per student token.

    pip install "torch==2.13.0" "trl==1.16.*"      # benchmark-only dependency (the bench extra)
    python bench/bench_opd_trl.py                  # runs/base + experts/lab10: one teacher (sort), then ten
    python bench/bench_opd_trl.py --teachers 1 --tokens 20000 --seeds 2
    python bench/bench_opd_trl.py --quick          # pico base + ten pico teachers built here, < 4 minutes

Both sides start from the same student (the base) with the same teachers, the same capabilities' train
prompts, reverse KL on the student's own samples (TRL: `beta=1.0`; TRL 1.16's `DistillationTrainer` has no
`lmbda`: it always samples on-policy), the same completion cap and fp32 weights, on the same CPU cores
(this process's affinity, printed).
They run interleaved (opd, TRL, TRL, opd, ...) for --seeds seeds, each until it has sampled --tokens
student tokens. Timing: the wall time of each run's steps after its first (start-up, a trainer's first
step and a sampling worker's fork left out; for TRL's per-teacher runs, each run's first step), without
the quality snapshots: around every --grid student tokens the run copies the student's weights
(milliseconds), and the copies are scored afterwards, untimed, with the same lm-eval task (greedy,
--eval-limit val items per capability) for both sides, interpolated to the grid point.

TRL side (as a TRL user runs it): `DistillationConfig(beta=1.0, ...)`, --trl-prompts prompts per step
(one completion each), one optimizer step per generated batch, lr --trl-lr, bf16 and gradient
checkpointing off (TRL's defaults turn them on; fp32 is the lab's dtype and checkpointing only costs an
extra forward), --trl-threads torch threads (default 1, its fastest here). TRL 1.16's `DistillationTrainer` takes one `teacher_model`; per-
prompt teacher routing exists only in the experimental `AsyncDistillationTrainer`, with teachers behind
servers (`teacher_server_urls`). So with ten teachers TRL runs one `DistillationTrainer` per teacher on its
capability's prompts, the same student carried from one to the next, in --trl-rounds rounds of ten
runs (each run --tokens / (10 x rounds) tokens). Trainer construction is not timed.

opd side: `opd.distill.distill` in this process with the settings printed under "opd settings"; the
ones that differ from TRL's are listed. The quality table compares the two at each grid point, and the
last line is `ratio: N.NN`, opd / TRL student tokens per second (pooled over seeds; the smallest over
the teacher counts run). The same settings for opd with one teacher and ten.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAB10 = ["add", "sub", "mod", "rev", "sort", "count", "max", "shift", "dedup", "digsum"]


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="float32")


class Steps:
    """Called after every training step with the student tokens so far. At each grid point g of student
    tokens it keeps the student's weights after the last step below g and after the first step at or
    above it (scored later, untimed, and interpolated to g: a side with large steps is not credited with
    the tokens it overshoots by). Times the steps after a run's first (its start-up: a trainer's first
    step, a sampling worker's fork), without the copies."""

    def __init__(self, model, grid: int):
        self.model, self.grid, self.next = model, grid, grid
        self.prev = (0, self.weights())
        self.points: list[tuple[int, tuple, tuple]] = []  # (g, (tokens, weights) before, (tokens, weights) after)
        self.seconds, self.tokens, self.last = 0.0, 0, None
        self.cpu, self.last_cpu = 0.0, None  # this process's CPU seconds over the same steps

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def start(self, tokens: int) -> None:
        """A run (of several, for TRL's per-teacher runs) begins: its first step is not timed."""
        self.last = self.last_cpu = None
        self.base = tokens

    def __call__(self, tokens: int) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self.last is not None:
            self.seconds += now - self.last
            self.cpu += cpu - self.last_cpu
            self.tokens += tokens - self.base
        self.base = tokens
        after = (tokens, self.weights())
        while tokens >= self.next:
            self.points.append((self.next, self.prev, after))
            self.next += self.grid
        self.prev = after
        self.last, self.last_cpu = time.perf_counter(), time.process_time()


# ---- TRL ------------------------------------------------------------------------------------------


def trl_prompts(cap: str, n: int, seed: int) -> list[str]:
    from opd.capabilities import get_capability

    c, rng = get_capability(cap), random.Random(f"trl|{cap}|{seed}")
    return [c.render(c.sample(rng, "train").prompt, None) for _ in range(n)]


def run_trl(student, tok, teacher_paths: dict[str, str], args, seed: int, max_new: int) -> dict:
    """TRL's `DistillationTrainer`, one per teacher (each on its capability's prompts) in rounds; the
    same student object throughout. Returns seconds of training, student tokens and grid snapshots."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    torch.set_num_threads(args.trl_threads)
    caps = list(teacher_paths)
    teachers = {c: load_model(p) for c, p in teacher_paths.items()}
    steps = Steps(student, args.grid)
    count = {"tokens": 0}
    runs = [(r, c) for r in range(args.trl_rounds if len(caps) > 1 else 1) for c in caps]
    per_run = math.ceil(args.tokens / len(runs))

    class Grid(TrainerCallback):
        def __init__(self, until):
            self.until = until

        def on_step_end(self, _args, state, control, **_):
            steps(count["tokens"])
            if count["tokens"] >= self.until and state.global_step >= 2:  # >= 1 timed step a run
                control.should_training_stop = True

    with tempfile.TemporaryDirectory() as d:
        for i, (rnd, cap) in enumerate(runs):
            until = min(args.tokens, (i + 1) * per_run)
            # enough prompts for the run at >= 1 token per completion; the callback stops it on tokens
            n_prompts = args.trl_prompts * (per_run // args.trl_prompts + 2)
            data = Dataset.from_list([{"prompt": p} for p in trl_prompts(cap, n_prompts, seed * 1000 + rnd)])
            config = DistillationConfig(
                output_dir=d, use_cpu=True, report_to="none", save_strategy="no", logging_steps=10**6,
                seed=seed + i, beta=1.0, learning_rate=args.trl_lr, lr_scheduler_type="constant",
                max_grad_norm=1.0, per_device_train_batch_size=args.trl_prompts, gradient_accumulation_steps=1,
                max_steps=n_prompts // args.trl_prompts, max_completion_length=max_new, temperature=1.0, top_k=0,
                # fp32 as the lab's models and opd; no activation recomputation (TRL's defaults are
                # bf16=True and gradient_checkpointing=True; the latter only adds a forward per update)
                bf16=False, gradient_checkpointing=False, warmup_steps=0, weight_decay=0.0, disable_tqdm=True,
                # stop where the lab's answers end: its generation_config lists "\n" and <eos>
                generation_kwargs={"eos_token_id": student.generation_config.eos_token_id},
            )
            trainer = DistillationTrainer(model=student, teacher_model=teachers[cap], args=config,
                                          train_dataset=data, processing_class=tok, callbacks=[Grid(until)])
            generate = trainer._generate_and_score_completions

            def counted(inputs, generate=generate):  # student tokens: the completion mask TRL trains on
                out = generate(inputs)
                count["tokens"] += int(out["completion_mask"].sum())
                return out

            trainer._generate_and_score_completions = counted
            steps.start(count["tokens"])
            trainer.train()
            del trainer
    return {"seconds": steps.seconds, "cpu": steps.cpu, "tokens": steps.tokens, "all_tokens": count["tokens"],
            "points": steps.points}


# ---- opd ------------------------------------------------------------------------------------------


def opd_config(args, seed: int):
    from opd.distill import DistillConfig

    return DistillConfig(
        estimator=args.estimator, topk=args.topk, lr=args.lr, prompts_per_step=args.prompts, group_size=args.group,
        updates_per_batch=args.updates, layout=args.layout, compact_every=args.compact_every or None,
        sample_ahead=args.sample_ahead != "off", sample_worker="process" if args.sample_ahead == "off"
        else args.sample_ahead, steps=10**6, seed=seed, checkpoint_every=10**6, report_to="none",
        max_new_tokens=args.max_new_tokens)


def run_opd(student, tok, teacher_paths: dict[str, str], args, seed: int, max_new: int) -> dict:
    from opd.distill import distill, resolve_routes
    from opd.distill.run import load_teachers

    torch.set_num_threads(args.opd_threads)
    teachers, _ = load_teachers(list(teacher_paths.values()), tok)
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    steps = Steps(student, args.grid)
    steps.start(0)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    state = distill(opd_config(args, seed), student, tok, teachers, routes, log=lambda *_: None,
                    progress=lambda st, rec: steps(st.gen_tokens) if rec is not None else None,
                    stop=lambda rec: rec["gen_tokens"] >= args.tokens and rec["step"] >= 3)  # >= 2 timed steps
    phases = {p: sum(r.get(f"time/{p}", 0.0) for r in state.history) for p in ("sample", "score", "update")}
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)  # the sampling process, once it has ended: all its run
    worker_cpu = ended.ru_utime + ended.ru_stime - children.ru_utime - children.ru_stime
    return {"seconds": steps.seconds, "cpu": steps.cpu + worker_cpu, "tokens": steps.tokens, "all_tokens": state.gen_tokens,
            "points": steps.points,
            "phases": phases, "steps": state.step}


# ---- quality --------------------------------------------------------------------------------------


def score_points(base: str, tok, points, caps, limit: int) -> list[tuple[int, float]]:
    """(g, mean val score over `caps`) at each grid point g: lm-eval, greedy, the first `limit` val items of
    each capability, scored on the weights before and after g and interpolated linearly in tokens."""
    from opd.evaluation.api import evaluate

    model, done = load_model(base), {}

    def score(tokens, weights):
        if tokens not in done:  # consecutive grid points share a snapshot
            model.load_state_dict(weights)
            scores = evaluate(model, tok, caps, "val", limit=limit, use_cache=False)
            done[tokens] = sum(s.score for s in scores.values()) / len(caps)
        return done[tokens]

    out = []
    for g, (t0, w0), (t1, w1) in points:
        s0, s1 = score(t0, w0), score(t1, w1)
        out.append((g, s0 + (s1 - s0) * (g - t0) / max(1, t1 - t0)))
    return out


def lab_paths(args) -> tuple[str, dict[str, str]]:
    """The base and one expert directory per capability: the lab's, or (--quick) a pico lab built here."""
    if not args.quick:
        experts = {c: str(Path(args.experts, c)) for c in LAB10}
        missing = [p for p in [args.base, *experts.values()] if not Path(p, "config.json").exists()]
        if missing:
            sys.exit(f"bench_opd_trl: no model at {missing[0]}: build the lab first "
                     "(python scripts/lab.py --recipe merge_recipes/lab10.yaml) or pass --base/--experts, or --quick")
        return args.base, experts
    from opd.lab.pico import build_fake_lab, build_trained_pico

    root = Path(tempfile.mkdtemp(prefix="opd-bench-trl-"))
    atexit.register(shutil.rmtree, root, True)
    lab = build_fake_lab(root, tuple(LAB10), base=build_trained_pico(root / "pico", "sort", steps=60))
    return str(lab["base"]), {c: str(p) for c, p in lab["experts"].items()}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load average {os.getloadavg()}"


def compare(n_teachers: int, base: str, experts: dict[str, str], tok, args) -> float:
    """One teacher count: interleaved runs over the seeds, the quality table; returns opd / TRL tokens/s."""
    from opd.capabilities import get_capability

    caps = ["sort"] if n_teachers == 1 else LAB10[:n_teachers]
    paths = {c: experts[c] for c in caps}
    max_new = args.max_new_tokens or max(get_capability(c).max_new_tokens for c in caps) + 1
    sides = {n: f for n, f in (("opd", run_opd), ("trl", run_trl)) if n in args.sides}
    results: dict[str, list[dict]] = {n: [] for n in sides}
    print(f"\n== {n_teachers} teacher(s): {', '.join(caps)}; {args.tokens} student tokens per run, grid every "
          f"{args.grid}; <= {max_new} new tokens; {uptime()}", flush=True)
    for seed in range(args.seeds):
        order = ("opd", "trl") if seed % 2 == 0 else ("trl", "opd")  # A B B A: both meet the same load
        for name in (n for n in order if n in sides):
            r = sides[name](load_model(base), tok, paths, args, seed, max_new)
            results[name].append(r)
            extra = ""
            if name == "opd":
                s = sum(r["phases"].values()) or 1.0
                extra = f" ({r['steps']} steps; " + ", ".join(f"{p} {v / s:.0%}" for p, v in r["phases"].items()) + ")"
            print(f"{name} seed {seed}: {r['tokens']} student tokens in {r['seconds']:.1f} s -> "
                  f"{r['tokens'] / r['seconds']:.0f} tokens/s ({r['cpu']:.1f} s CPU{' with the sampling process' if name == 'opd' else ''}){extra}; load {os.getloadavg()[0]:.2f}", flush=True)
    tps = {n: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for n, rs in results.items()}
    cpu_tps = {n: sum(r["tokens"] for r in rs) / sum(r["cpu"] for r in rs) for n, rs in results.items()}
    if len(sides) < 2:  # a one-sided run (tuning one side): its quality, no ratio
        for n, rs in results.items():
            for r in rs:
                print(f"{n}: " + ", ".join(f"{t}:{v:.3f}" for t, v in score_points(base, tok, r["points"], caps,
                                                                                   args.eval_limit)))
        return float("nan")
    print(f"tokens/s over {args.seeds} seeds: opd {tps['opd']:.0f}, trl {tps['trl']:.0f}; per seed: "
          + ", ".join(f"{o['tokens'] / o['seconds'] / (t['tokens'] / t['seconds']):.2f}x"
                      for o, t in zip(results["opd"], results["trl"]))
          + f"; per CPU second (work done, not parallelism; steadier on a shared machine): opd {cpu_tps['opd']:.0f}, "
          f"trl {cpu_tps['trl']:.0f}, {cpu_tps['opd'] / cpu_tps['trl']:.2f}x", flush=True)
    # quality per student token, untimed: mean over seeds of the mean val score at each grid point
    curves = {n: [score_points(base, tok, r["points"], caps, args.eval_limit) for r in rs] for n, rs in results.items()}
    start_w = (0, load_model(base).state_dict())
    start = score_points(base, tok, [(0, start_w, start_w)], caps, args.eval_limit)[0][1]
    n_points = min(len(c) for cs in curves.values() for c in cs)
    # binomial stderr of a difference of two seed-averaged means over eval_limit x caps items
    se = math.sqrt(2 * 0.25 / (args.eval_limit * len(caps) * args.seeds))
    print(f"val score (mean over {len(caps)} capabilities, first {args.eval_limit} val items each, greedy; start "
          f"{start:.3f}) against student tokens; noise (1 stderr of the difference) ~{se:.3f}:")
    print(f"  {'tokens':>8s} {'opd':>6s} {'trl':>6s}")
    worse = []
    for i in range(n_points):
        g = (i + 1) * args.grid
        o = sum(c[i][1] for c in curves["opd"]) / args.seeds
        t = sum(c[i][1] for c in curves["trl"]) / args.seeds
        if o < t - 2 * se:
            worse.append(g)
        print(f"  {g:>8d} {o:6.3f} {t:6.3f}")
    print("quality per student token: " + (f"opd LOWER than TRL by > 2 stderr at {worse}" if worse else
                                           "opd equal (within 2 stderr) or better at every grid point"))
    ratio = tps["opd"] / tps["trl"]
    print(f"{n_teachers} teacher(s): opd / trl {ratio:.2f}x", flush=True)
    return ratio


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--experts", default="experts/lab10", help="directory of the lab10 experts (one per capability)")
    ap.add_argument("--quick", action="store_true", help="a pico lab built here; few tokens (< 4 minutes)")
    ap.add_argument("--teachers", default="1,10", help="teacher counts to run (comma-separated): 1 (sort) and/or 10")
    ap.add_argument("--tokens", type=int, default=24_000, help="student tokens per run")
    ap.add_argument("--grid", type=int, default=6_000, help="student tokens between quality snapshots")
    ap.add_argument("--eval-limit", type=int, default=100, help="val items per capability at each grid point")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="completion cap of both sides (default opd's: the largest capability's + 1)")
    ap.add_argument("--sides", default="opd,trl", help=argparse.SUPPRESS)  # one side alone: tuning it
    ap.add_argument("--cores", default=None, help="CPU cores both sides run on, e.g. 0,1 (default: this process's)")
    # TRL
    ap.add_argument("--trl-prompts", type=int, default=64, help="TRL: prompts per step (one completion each)")
    ap.add_argument("--trl-lr", type=float, default=1e-4)
    ap.add_argument("--trl-threads", type=int, default=1, help="TRL: torch threads (1: TRL's fastest on this "
                    "machine's tiny models; 2 threads on 2 loaded cores ran ~8x slower)")
    ap.add_argument("--trl-rounds", type=int, default=1, help="ten teachers: rounds of ten per-teacher runs")
    # opd
    ap.add_argument("--prompts", type=int, default=256, help="opd: prompts per step")
    ap.add_argument("--group", type=int, default=3, help="opd: samples per prompt")
    ap.add_argument("--updates", type=int, default=12, help="opd: minibatch updates per step (256 x 3 in 12: 64 "
                    "rows, ~380 student tokens per update, as TRL's 64 x 1 per update)")
    ap.add_argument("--lr", type=float, default=2e-4, help="opd: lr")
    ap.add_argument("--estimator", choices=["full", "topk", "sampled"], default="full")
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--layout", choices=["packed", "padded"], default="packed")
    ap.add_argument("--compact-every", type=int, default=3)
    ap.add_argument("--sample-ahead", choices=["process", "thread", "off"], default="process",
                    help="opd: where the next batch is sampled during the update (off: not ahead)")
    ap.add_argument("--opd-threads", type=int, default=None,
                    help="opd: torch threads per process (default: the cores, halved with a sampling process)")
    args = ap.parse_args(argv)
    try:
        import trl
    except ImportError:
        print('bench_opd_trl: TRL is not installed; it is a benchmark-only dependency:\n'
              '  pip install "torch==2.13.0" "trl==1.16.*"   (the pin keeps the CPU torch)', file=sys.stderr)
        return 2
    if args.quick:
        args.tokens, args.grid, args.eval_limit = min(args.tokens, 3000), min(args.grid, 1500), min(args.eval_limit, 10)
        args.prompts, args.trl_prompts = min(args.prompts, 16), min(args.trl_prompts, 16)
        args.updates = min(args.updates, 2)
    if args.cores:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    cores = sorted(os.sched_getaffinity(0))
    args.opd_threads = args.opd_threads or max(1, len(cores) // (2 if args.sample_ahead == "process" else 1))
    counts = [int(n) for n in args.teachers.split(",")]
    if set(counts) - {1, 10}:
        ap.error("--teachers: 1 and/or 10")

    import transformers
    from transformers import AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    base, experts = lab_paths(args)
    tok = AutoTokenizer.from_pretrained(base)
    student = load_model(base)
    print(f"torch {torch.__version__}; trl {trl.__version__}; cores {cores}: trl {args.trl_threads} thread(s), opd "
          f"{args.opd_threads} thread(s) per process{' + a sampling process' if args.sample_ahead == 'process' else ''}; "
          f"student {base} ({sum(p.numel() for p in student.parameters()) / 1e6:.2f}M params); {uptime()}")
    print(f"trl settings: {args.trl_prompts} prompts x 1 per step, 1 update per step, lr {args.trl_lr:g}, "
          "full-vocabulary reverse KL (beta 1.0) over each batch's tokens, padded batches, sample then train")
    print(f"opd settings: {args.prompts} prompts x {args.group} per step, {args.updates} updates per step, lr "
          f"{args.lr:g}, {args.estimator} reverse KL{f' (k {args.topk})' if args.topk else ''}, {args.layout} layout, "
          f"compaction every {args.compact_every} tokens, sample-ahead {args.sample_ahead}")
    print("settings that differ: batch shape (prompts x samples per step), updates per step and lr; "
          f"layout {args.layout}; sample-ahead {args.sample_ahead} (each batch one update behind); "
          "the loss is averaged per sequence (TRL: per token)")
    ratios = [compare(n, base, experts, tok, args) for n in counts]
    print(f"{uptime()}")
    print(f"ratio: {min(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
