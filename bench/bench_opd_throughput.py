"""OPD student tokens per second: today's per-teacher loop against the stacked-teacher loop, on the same
teachers, prompts and base, in one process.

    python bench/bench_opd_throughput.py                       # the ten lab10 experts (runs/base, experts/lab10)
    python bench/bench_opd_throughput.py --runs loop,tuned --tokens 160000 --grid 40000 --eval-limit 200 --seeds 3
    python bench/bench_opd_throughput.py --quick               # pico teachers built here, < 3 minutes

Three runs from the base, each until it has sampled --tokens student tokens:
  loop     today's loop: teacher_forward=loop (one engine.score per teacher, then one more forward per
           teacher for the full estimator's hidden states), the lab10 recipe's batch when the bench was
           written (20 prompts x 4, 2 updates per step, lr --lr), 1 thread;
  stacked  the same settings with every teacher in one vmapped forward (the code change alone);
  tuned    stacked on the packed layout (opd.rl.packing: no padding, a group's prompt laid out once, each
           teacher one forward on its own packed rows), with --prompts x --group rows per step, --updates
           minibatch updates per step at --tuned-lr and --threads per process. By default (--sample-ahead 1)
           a worker samples and scores the next batch during each update (DistillConfig.sample_ahead, each
           batch one update behind): a forked process (--sample-worker process, DistillConfig.sample_worker;
           the sampler's weights in shared memory, so the two use both cores without sharing one GIL) or a
           thread of this process (--sample-worker thread). The student samples in generate calls of
           --compact-every tokens (3), the rows that have stopped leaving the batch between calls, after
           a packed prompt prefill (DistillConfig.compact_every, layout). With --inference-dtype auto (the
           default) the student samples and the teachers score in bf16 where this machine multiplies
           faster in it (AVX512-BF16, AMX), in fp32 where it does not (AVX2 alone); the update stays fp32
           (DistillConfig.inference_dtype). With --ranks N it runs data-parallel under DeepSpeed ZeRO-2 on N
           CPU ranks (torchrun, gloo), each rank sampling --prompts / N of the step's prompts, gradients
           averaged.
Throughput counts the steps' own wall time (sampling, scoring, update: each step's time/* record); the
retention checks on the grid (every --grid student tokens, --eval-limit val items per capability, the same
grid for every run) and a DeepSpeed engine's start-up are excluded.
The min (and mean) retention over the capabilities at each grid point is printed so that a faster loop
that learns less per token shows. With --seeds N every run repeats with seeds 0..N-1, loop and tuned
interleaved so both meet the same load; then tokens/s pools the seeds and the grid averages them, and
each seed's own ratio is printed too (its spread shows how far this machine's noise moves the ratio).
The last line is `ratio: N.NN`, tuned / loop student tokens per second.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
LAB10 = ["add", "sub", "mod", "rev", "sort", "count", "max", "shift", "dedup", "digsum"]


def cpu_seconds() -> float:
    """CPU seconds of this process and of its ended children (a sample-ahead worker process)."""
    import resource

    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def run(label: str, cfg, threads: int, base: str, teachers, routes, caps, refs, tokens: int, grid: int,
        eval_limit: int, wrap=None) -> dict:
    """One run from the base until `tokens` student tokens. Under `wrap` (DeepSpeed, several ranks) rank 0
    alone runs the retention checks and prints; the others wait for it in the next collective."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.distill import distill
    from opd.distill.loop import retention_record
    from opd.evaluation.api import evaluate

    torch.set_num_threads(threads)
    student = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    tok = AutoTokenizer.from_pretrained(base)
    curve, spent = [], {"eval": 0.0, "eval_cpu": 0.0, "next": grid}
    rank = int(os.environ.get("RANK", "0")) if wrap is not None else 0

    def progress(state, rec):
        if rank == 0 and state.gen_tokens >= spent["next"]:
            t, c = time.time(), time.process_time()
            scores = {c: s.score for c, s in evaluate(student, tok, caps, "val", limit=eval_limit).items()}
            student.train()
            spent["eval"] += time.time() - t
            spent["eval_cpu"] += time.process_time() - c
            rec = retention_record(scores, refs)
            ret = [v for k, v in rec.items() if k.startswith("retention/")]
            curve.append((spent["next"], state.gen_tokens, rec["min_retention"], sum(ret) / len(ret)))
            spent["next"] += grid

    t0, c0 = time.time(), cpu_seconds()
    state = distill(cfg, student, tok, teachers, routes, log=lambda *_: None, progress=progress,
                    stop=lambda rec: rec["gen_tokens"] >= tokens, wrap=wrap)
    cpu_s = cpu_seconds() - c0 - spent["eval_cpu"]  # with a sampling worker's, once it has ended
    phases = {p: sum(r.get(f"time/{p}", 0.0) for r in state.history) for p in ("sample", "score", "update")}
    # the steps' own seconds: the same measure for every run, without a DeepSpeed engine's start-up
    # (it may build a C++ op) or the checks on the grid
    train_s = sum(phases.values())
    tps = state.gen_tokens / train_s
    wall_s = time.time() - t0 - spent["eval"]
    out = {"tps": tps, "cpu_tps": state.gen_tokens / cpu_s, "curve": curve, "steps": state.step,
           "tokens": state.gen_tokens, "seconds": train_s}
    if rank:
        return out
    ranks = f" x {os.environ['WORLD_SIZE']} ranks" if wrap is not None else ""
    on = " on rank 0" if ranks else ""
    print(f"{label:8s} seed {cfg.seed} threads {threads}{ranks}  {state.step} steps  {state.gen_tokens} student tokens in "
          f"{train_s:.1f} s of steps ({wall_s:.1f} s wall without the checks; {cpu_s:.1f} s CPU over {threads} "
          f"thread(s){' and a sampling process' if cfg.sample_ahead and cfg.sample_worker == 'process' else ''}{on}) -> {tps:.0f} tokens/s;  min (mean) val retention on the grid: "
          + ", ".join(f"{g}:{r:.2f} ({m:.2f})" for g, _, r, m in curve), flush=True)
    print(f"{'':8s} step time: " + ", ".join(f"{p} {v / train_s:.0%}" for p, v in phases.items())
          + " (student sampling / teacher and old-policy scoring / update)", flush=True)
    return out


def pooled(results: list[dict]) -> dict:
    """One run's figures over several seeds: tokens/s as all tokens over all step seconds, and each grid
    point's min and mean retention averaged."""
    curve = [(pts[0][0], *(sum(p[i] for p in pts) / len(pts) for i in (1, 2, 3)))
             for pts in zip(*(r["curve"] for r in results))]  # pts: one grid point's (grid, tokens, min, mean) per seed
    return {"tps": sum(r["tokens"] for r in results) / sum(r["seconds"] for r in results), "curve": curve}


def tuned_config(args, today: dict, ranks: int):
    from opd.distill import DistillConfig

    return DistillConfig(**{**today, "lr": args.tuned_lr, "prompts_per_step": args.prompts // ranks, "group_size": args.group,
                            "updates_per_batch": args.updates, "layout": args.layout,
                            "sample_ahead": args.sample_ahead, "sample_worker": args.sample_worker,
                            "inference_dtype": args.inference_dtype, "compact_every": args.compact_every or None})


def tuned_ranks(args, base: str, names: list[str], seed: int) -> dict:
    """The tuned run on --ranks CPU ranks: this script again under torchrun, one process a rank, rank 0
    writing its result to a JSON file."""
    out = Path(tempfile.mkdtemp(prefix="opd-bench-ranks-")) / "tuned.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks)]
    cmd = [*torchrun, __file__, "--worker-out", str(out), "--base", base, "--experts", ",".join(names),
           f"--seed-of-rank={seed}",
           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("tokens", "grid", "eval_limit", "prompts", "group", "updates", "layout", "threads", "lr",
                      "ranks", "sample_ahead", "sample_worker", "inference_dtype", "tuned_lr", "compact_every"))]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(cmd, check=True, env=env)
    result = json.loads(out.read_text())
    shutil.rmtree(out.parent, True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--experts", default=",".join(f"experts/lab10/{n}" for n in LAB10))
    ap.add_argument("--quick", action="store_true", help="ten pico teachers built in a temp dir (< 3 minutes)")
    ap.add_argument("--tokens", type=int, default=40_000, help="student tokens per run")
    ap.add_argument("--grid", type=int, default=10_000, help="student tokens between retention checks")
    ap.add_argument("--eval-limit", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=128, help="tuned run: prompts per step (with 3 samples and 6 "
                    "updates, 64 rows per update; the loop's 20 x 4 in 2 updates is 40). Sampling twice the prompts "
                    "per step (128 x 3 in 6 updates, not 64 x 3 in 3) keeps each update's rows and lr and halves the "
                    "sampler's and teachers' per-call overheads per token")
    ap.add_argument("--group", type=int, default=3, help="tuned run: samples per prompt")
    ap.add_argument("--updates", type=int, default=6, help="tuned run: minibatch updates per step")
    ap.add_argument("--layout", choices=["packed", "padded"], default="packed", help="tuned run: token layout")
    ap.add_argument("--threads", type=int, default=1, help="tuned run: torch threads per process")
    ap.add_argument("--ranks", type=int, default=1, help="tuned run: data-parallel CPU ranks (DeepSpeed ZeRO-2, "
                    "torchrun); --prompts must divide by it")
    ap.add_argument("--runs", default="loop,stacked,tuned",
                    help="which runs (comma-separated); the ratios need the loop")
    ap.add_argument("--sample-ahead", type=int, choices=[0, 1], default=1,
                    help="tuned run: 1 samples and scores the next batch in a worker (--sample-worker) during the update")
    ap.add_argument("--sample-worker", choices=["thread", "process"], default="process",
                    help="tuned run: where --sample-ahead samples (DistillConfig.sample_worker): a thread, or a forked "
                    "process that does not share the GIL with the update")
    ap.add_argument("--inference-dtype", choices=["float32", "bfloat16", "auto"], default="auto",
                    help="tuned run: dtype the student samples in and the stacked teachers score in (the update "
                    "stays fp32); auto: bfloat16 where this machine multiplies faster in it (AVX512-BF16, AMX, GPUs), "
                    "float32 where it does not (AVX2 alone: bf16 tens of times slower)")
    ap.add_argument("--compact-every", type=int, default=3,
                    help="tuned run: sample in generate calls of this many tokens, dropping the rows that have "
                    "stopped between calls (DistillConfig.compact_every; 0: one call, every row to the longest answer)")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)  # set by --ranks: a rank of the tuned run
    ap.add_argument("--lr", type=float, default=1e-4, help="the loop's and the stacked run's lr")
    ap.add_argument("--tuned-lr", type=float, default=1.6e-4,
                    help="tuned run's lr (default: the loop's 1e-4 x 64 / 40, its rows per update over the loop's, so "
                    "both move the student about as far per student token)")
    ap.add_argument("--seeds", type=int, default=1, help="repeat each run with seeds 0..N-1, loop and tuned "
                    "interleaved (so both meet the same load); tokens/s and the grid are then averaged")
    ap.add_argument("--seed-of-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ranks < 1 or args.prompts % args.ranks:
        ap.error(f"--ranks {args.ranks}: must be >= 1 and divide --prompts {args.prompts}")
    wanted = args.runs.split(",")
    if not wanted or set(wanted) - {"loop", "stacked", "tuned"}:
        ap.error(f"--runs {args.runs}: a comma-separated subset of loop,stacked,tuned")

    from transformers import AutoTokenizer

    from opd.distill import DistillConfig, resolve_routes
    from opd.distill.run import load_teachers, teacher_references

    base, names = args.base, args.experts.split(",")
    if args.quick:
        from opd.lab.pico import build_fake_lab, build_trained_pico

        root = Path(tempfile.mkdtemp(prefix="opd-bench-"))
        atexit.register(shutil.rmtree, root, True)  # a fake lab: removed however the bench ends
        lab = build_fake_lab(root, tuple(LAB10), base=build_trained_pico(root / "pico", "count", steps=60))
        base, names = str(lab["base"]), [str(p) for p in lab["experts"].values()]
        args.tokens, args.grid, args.eval_limit = min(args.tokens, 4000), min(args.grid, 2000), 5
    torch.set_num_threads(1)
    teachers, manifests = load_teachers(names, AutoTokenizer.from_pretrained(base))
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    caps = list(routes)
    refs = teacher_references(routes, manifests)
    today = dict(estimator="full", lr=args.lr, prompts_per_step=20, group_size=4, updates_per_batch=2,
                 steps=10**6, seed=args.seed_of_rank)
    if args.worker_out:  # one rank of tuned_ranks
        from opd.rl.distributed import deepspeed_wrap

        cfg = tuned_config(args, today, args.ranks)
        r = run("tuned", cfg, args.threads, base, teachers, routes, caps, refs, args.tokens, args.grid,
                args.eval_limit, wrap=deepspeed_wrap(cfg.grad_clip))
        if os.environ["RANK"] == "0":
            Path(args.worker_out).write_text(json.dumps(r))
        return
    print(f"{len(teachers)} teachers; capabilities {caps}; {args.tokens} student tokens per run, retention grid "
          f"every {args.grid}; load average {os.getloadavg()[0]:.2f}", flush=True)
    def runs(seed: int) -> dict:
        same = dict(today, seed=seed)
        return {
            "loop": lambda: run("loop", DistillConfig(**same, teacher_forward="loop"), 1, base, teachers, routes,
                                caps, refs, args.tokens, args.grid, args.eval_limit),
            "stacked": lambda: run("stacked", DistillConfig(**same), 1, base, teachers, routes, caps, refs,
                                   args.tokens, args.grid, args.eval_limit),
            "tuned": lambda: (tuned_ranks(args, base, names, seed) if args.ranks > 1 else
                              run("tuned", tuned_config(args, same, 1), args.threads, base, teachers, routes, caps,
                                  refs, args.tokens, args.grid, args.eval_limit)),
        }

    labels = [label for label in ("loop", "stacked", "tuned") if label in wanted]
    per_seed = [{label: todo() for label, todo in runs(seed).items() if label in labels} for seed in range(args.seeds)]
    results = {label: pooled([r[label] for r in per_seed]) for label in labels}
    if args.seeds > 1:
        for label, r in results.items():
            print(f"{label:8s} over {args.seeds} seeds: {r['tps']:.0f} tokens/s; mean over seeds of the min (mean) val "
                  "retention on the grid: " + ", ".join(f"{g}:{a:.2f} ({m:.2f})" for g, _, a, m in r["curve"]),
                  flush=True)
    loop = results.get("loop")
    for label in ("stacked", "tuned"):
        if loop is None or label not in results:
            continue
        r = results[label]
        pairs = list(zip(loop["curve"], r["curve"]))
        worse = [g for (g, _, a, _), (_, _, b, _) in pairs if b < a - 0.05]
        each = "" if args.seeds == 1 else " (per seed: " + ", ".join(
            f"{s[label]['tps'] / s['loop']['tps']:.2f}x" for s in per_seed) + ")"
        print(f"{label} / loop: {r['tps'] / loop['tps']:.2f}x student tokens/s{each}; min retention on the grid "
              + (f"lower by > 0.05 at {worse}" if worse else "within 0.05 or better at every point"), flush=True)
    inference = args.inference_dtype
    if inference == "auto":  # what the loop resolved it to (cached per machine)
        from opd.distill.precision import resolve_inference_dtype

        picked = resolve_inference_dtype("auto", next(iter(teachers.values())).model)
        inference = f"auto ({str(picked).removeprefix('torch.')} on this machine)"
    print(f"threads: loop 1, stacked 1, tuned {args.threads} x {args.ranks} rank(s); tuned: {args.prompts} prompts x "
          f"{args.group}, {args.updates} updates per step at lr {args.tuned_lr:g} (loop {args.lr:g}), {args.layout} layout"
          f"{f', sampling ahead in a {args.sample_worker}' if args.sample_ahead else ''}, {inference} sampling and teacher scoring; "
          f"load average "
          f"{os.getloadavg()[0]:.2f}")
    if loop is not None and "tuned" in results:
        print(f"ratio: {results['tuned']['tps'] / loop['tps']:.2f}")


if __name__ == "__main__":
    main()
