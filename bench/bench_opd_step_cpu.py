"""CPU seconds of one OPD step's two processes at bench/bench_opd_trl.py's opd settings, this tree's code
against an earlier commit's, on the same batches: the update (main process) and the sampling worker
(the student samples, the teachers score), each serial on 1 torch thread.

    python bench/bench_opd_step_cpu.py --before 2ecd2c7                 # one teacher (sort)
    python bench/bench_opd_step_cpu.py --before 2ecd2c7 --teachers 10
    python bench/bench_opd_step_cpu.py --before 2ecd2c7 --base /work/main/runs/base --experts /work/main/experts/lab10

Each side runs in its own child process (the earlier commit's opd/ and kernels/ from `git archive`),
alternating before, after, after, before, ... for --repeats rounds; a child samples --batches batches
from the base student (seeded: both sides sample the same prompts) and times each `_produce` (the
worker's call, with the minibatch layouts it makes since #33), then times `opd_step` on each batch
after one untimed warm-up update. CPU time
(`time.process_time`), which holds steadier than wall time on a shared machine. Prints medians per
side and after / before ratios (below 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LAB10 = ["add", "sub", "mod", "rev", "sort", "count", "max", "shift", "dedup", "digsum"]
ROOT = Path(__file__).resolve().parent.parent


def child(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.distill import DistillConfig, resolve_routes
    from opd.distill.loop import StudentHidden, opd_step
    from opd.distill.routing import prompt_mix
    from opd.distill.run import load_teachers
    from opd.distill.sampler import Sampler

    torch.set_num_threads(1)
    caps = ["sort"] if args.teachers == 1 else LAB10
    tok = AutoTokenizer.from_pretrained(args.base)
    teachers, _ = load_teachers([str(Path(args.experts, c)) for c in caps], tok)
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    # bench/bench_opd_trl.py's opd settings (its defaults), sampled here without the worker process
    cfg = DistillConfig(estimator="full", lr=2e-4, prompts_per_step=256, group_size=3, updates_per_batch=12,
                        layout="packed", compact_every=3, sample_ahead=False, steps=10**6, seed=0, report_to="none")
    student = AutoModelForCausalLM.from_pretrained(args.base, dtype="float32").train()
    sampler = Sampler(cfg, student, tok, teachers, routes, log=lambda *_: None)
    mix, rng = prompt_mix(routes, cfg.mix, None), random.Random(0)
    produce = sampler._produce  # what the worker calls
    out = {"worker": [], "update": [], "tokens": [], "threads": torch.get_num_threads(),
           "opd": sys.modules["opd"].__file__}
    batches = []
    for step in range(args.batches + 1):
        c0 = time.process_time()
        batch = produce(step, mix, rng).batch
        if hasattr(batch, "lay_out_ahead"):  # the worker lays out the update's minibatches (since #33)
            batch.lay_out_ahead(cfg.updates_per_batch, torch.Generator().manual_seed(step))
        if step:  # the first call warms up
            out["worker"].append(time.process_time() - c0)
            batches.append(batch)
            out["tokens"].append(batch.gen_tokens)
    policy = StudentHidden(student)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    opd_step(policy, opt, batches[0], cfg, sampler.teachers, None, torch.Generator().manual_seed(1))  # warm-up
    for i, batch in enumerate(batches):
        c0 = time.process_time()
        opd_step(policy, opt, batch, cfg, sampler.teachers, None, torch.Generator().manual_seed(i + 1))
        out["update"].append(time.process_time() - c0)
    print("RESULT " + json.dumps(out), flush=True)


def tree_of(rev: str, into: Path) -> Path:
    """opd/ and kernels/ as of `rev`, unpacked under `into`."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "opd", "kernels"], capture_output=True, check=True)
    with tarfile.open(fileobj=__import__("io").BytesIO(tar.stdout)) as t:
        t.extractall(into, filter="data")
    return into


def run_side(code: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{code}:{code / 'kernels'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", "--base", args.base, "--experts", args.experts,
           "--teachers", str(args.teachers), "--batches", str(args.batches)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=code)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"bench_opd_step_cpu: the child for {code} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="HEAD", help="the commit to compare against (default HEAD: the "
                    "working tree's uncommitted changes)")
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--experts", default="experts/lab10")
    ap.add_argument("--teachers", type=int, choices=[1, 10], default=1)
    ap.add_argument("--batches", type=int, default=3, help="batches per child")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of (before, after) children")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.base, args.experts = str(Path(args.base).resolve()), str(Path(args.experts).resolve())
    if args.child:
        child(args)
        return 0
    res: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="opd-before-") as d:
        code = {"before": tree_of(args.before, Path(d)), "after": ROOT}
        for r in range(args.repeats):
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                res[side].append(run_side(code[side], args))
                x = res[side][-1]
                print(f"{side} ({args.before if side == 'before' else 'this tree'}): worker "
                      + " ".join(f"{v:.3f}" for v in x["worker"]) + " s, update "
                      + " ".join(f"{v:.3f}" for v in x["update"]) + f" s CPU per batch; tokens {x['tokens']}; "
                      f"load {os.getloadavg()[0]:.2f} ({x['opd']})", flush=True)
    med = {s: {k: statistics.median(v for x in rs for v in x[k]) for k in ("worker", "update")}
           for s, rs in res.items()}
    threads = res["after"][0]["threads"]
    print(f"{args.teachers} teacher(s), {threads} torch thread(s), {args.batches} batches x {args.repeats} rounds, "
          "median CPU s per batch of 256 x 3 (12 updates):")
    for k in ("update", "worker"):
        print(f"  {k:6s} before {med['before'][k]:.3f}  after {med['after'][k]:.3f}  after/before "
              f"{med['after'][k] / med['before'][k]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
