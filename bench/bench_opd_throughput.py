"""OPD student tokens per second: today's per-teacher loop against the stacked-teacher loop, on the same
teachers, prompts and base, in one process.

    python bench/bench_opd_throughput.py                       # the ten lab10 experts (runs/base, experts/lab10)
    python bench/bench_opd_throughput.py --tokens 60000 --grid 15000
    python bench/bench_opd_throughput.py --quick               # pico teachers built here, < 3 minutes

Three runs from the base, each until it has sampled --tokens student tokens:
  loop     today's loop: teacher_forward=loop (one engine.score per teacher, then one more forward per
           teacher for the full estimator's hidden states), the lab10 recipe's batch (20 prompts x 4), 1 thread;
  stacked  the same settings with every teacher in one vmapped forward (the code change alone);
  tuned    stacked on the packed layout (opd.rl.packing: no padding, a group's prompt laid out once, each
           teacher one forward on its own packed rows), with --prompts x --group rows per step, --updates
           minibatch updates per step and --threads.
Throughput counts training wall time only: the retention checks on the grid (every --grid student
tokens, --eval-limit val items per capability, the same grid for every run) are timed and excluded.
The min retention at each grid point is printed so that a faster loop that learns less per token shows.
The last line is `ratio: N.NN`, tuned / loop student tokens per second.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
LAB10 = ["add", "sub", "mod", "rev", "sort", "count", "max", "shift", "dedup", "digsum"]


def run(label: str, cfg, threads: int, base: str, teachers, routes, caps, refs, tokens: int, grid: int,
        eval_limit: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.distill import distill
    from opd.distill.loop import retention_record
    from opd.evaluation.api import evaluate

    torch.set_num_threads(threads)
    student = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    tok = AutoTokenizer.from_pretrained(base)
    curve, spent = [], {"eval": 0.0, "eval_cpu": 0.0, "next": grid}

    def progress(state, rec):
        if state.gen_tokens >= spent["next"]:
            t, c = time.time(), time.process_time()
            scores = {c: s.score for c, s in evaluate(student, tok, caps, "val", limit=eval_limit).items()}
            student.train()
            spent["eval"] += time.time() - t
            spent["eval_cpu"] += time.process_time() - c
            curve.append((spent["next"], state.gen_tokens, retention_record(scores, refs)["min_retention"]))
            spent["next"] += grid

    t0, c0 = time.time(), time.process_time()
    state = distill(cfg, student, tok, teachers, routes, log=lambda *_: None, progress=progress,
                    stop=lambda rec: rec["gen_tokens"] >= tokens)
    train_s = time.time() - t0 - spent["eval"]
    cpu_s = time.process_time() - c0 - spent["eval_cpu"]
    tps = state.gen_tokens / train_s
    phases = {p: sum(r.get(f"time/{p}", 0.0) for r in state.history) for p in ("sample", "score", "update")}
    total = sum(phases.values()) or 1.0
    print(f"{label:8s} threads {threads}  {state.step} steps  {state.gen_tokens} student tokens in {train_s:.1f} s "
          f"training ({cpu_s:.1f} s CPU over {threads} thread(s)) -> {tps:.0f} tokens/s;  min val retention on the grid: "
          + ", ".join(f"{g}:{r:.2f}" for g, _, r in curve), flush=True)
    print(f"{'':8s} step time: " + ", ".join(f"{p} {v / total:.0%}" for p, v in phases.items())
          + " (student sampling / teacher and old-policy scoring / update)", flush=True)
    return {"tps": tps, "cpu_tps": state.gen_tokens / cpu_s, "curve": curve, "steps": state.step,
            "tokens": state.gen_tokens, "seconds": train_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--experts", default=",".join(f"experts/lab10/{n}" for n in LAB10))
    ap.add_argument("--quick", action="store_true", help="ten pico teachers built in a temp dir (< 3 minutes)")
    ap.add_argument("--tokens", type=int, default=40_000, help="student tokens per run")
    ap.add_argument("--grid", type=int, default=10_000, help="student tokens between retention checks")
    ap.add_argument("--eval-limit", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=64, help="tuned run: prompts per step")
    ap.add_argument("--group", type=int, default=4, help="tuned run: samples per prompt")
    ap.add_argument("--updates", type=int, default=4, help="tuned run: minibatch updates per step")
    ap.add_argument("--layout", choices=["packed", "padded"], default="packed", help="tuned run: token layout")
    ap.add_argument("--threads", type=int, default=2, help="tuned run: torch threads")
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()

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
    print(f"{len(teachers)} teachers; capabilities {caps}; {args.tokens} student tokens per run, retention grid "
          f"every {args.grid}", flush=True)
    today = dict(estimator="full", lr=args.lr, prompts_per_step=20, group_size=4, updates_per_batch=2,
                 steps=10**6, seed=0)
    results = {
        "loop": run("loop", DistillConfig(**today, teacher_forward="loop"), 1, base, teachers, routes, caps, refs,
                    args.tokens, args.grid, args.eval_limit),
        "stacked": run("stacked", DistillConfig(**today), 1, base, teachers, routes, caps, refs, args.tokens,
                       args.grid, args.eval_limit),
        "tuned": run("tuned", DistillConfig(**{**today, "prompts_per_step": args.prompts, "group_size": args.group,
                                               "updates_per_batch": args.updates, "layout": args.layout}),
                     args.threads, base, teachers, routes, caps, refs, args.tokens, args.grid, args.eval_limit),
    }
    loop = results["loop"]
    for label in ("stacked", "tuned"):
        r = results[label]
        pairs = list(zip(loop["curve"], r["curve"]))
        worse = [g for (g, _, a), (_, _, b) in pairs if b < a - 0.05]
        print(f"{label} / loop: {r['tps'] / loop['tps']:.2f}x student tokens/s; min retention on the grid "
              + (f"lower by > 0.05 at {worse}" if worse else "within 0.05 or better at every point"), flush=True)
    print(f"threads: loop 1, stacked 1, tuned {args.threads}; tuned: {args.prompts} prompts x {args.group}, "
          f"{args.updates} updates per step, {args.layout} layout")
    print(f"ratio: {results['tuned']['tps'] / loop['tps']:.2f}")


if __name__ == "__main__":
    main()
