"""What bounds one OPD step at bench/bench_opd_trl.py's opd settings (one teacher, sort), serial on 1 torch
thread: per batch shape, the CPU seconds of the update (main process) and of the worker's batch (the
student samples, the teacher scores), student tokens per CPU second of each, and the share of the
update spent in matrix products (torch.profiler, aten::mm).

    python bench/profile_opd_update.py                          # 256 x 3 (the bench's), 128 x 6, 96 x 8
    python bench/profile_opd_update.py --shapes 256x3 --batches 4

The two processes overlap, so the slower of the two bounds opd's tokens per second on two idle cores.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.distill import DistillConfig, resolve_routes
from opd.distill.loop import StudentHidden, opd_step
from opd.distill.routing import prompt_mix
from opd.distill.run import load_teachers
from opd.distill.sampler import Sampler


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--experts", default="experts/lab10")
    ap.add_argument("--shapes", default="256x3,128x6,96x8", help="prompts x samples per batch")
    ap.add_argument("--batches", type=int, default=3, help="timed batches per shape (after one warm-up)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch threads: {torch.get_num_threads()}")
    tok = AutoTokenizer.from_pretrained(args.base)
    teachers, _ = load_teachers([f"{args.experts}/sort"], tok)
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    print("| prompts x samples | tokens / batch | update CPU s | worker CPU s | update tokens/CPU s | "
          "worker tokens/CPU s | update in aten::mm |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        P, G = (int(x) for x in shape.split("x"))
        cfg = DistillConfig(estimator="full", lr=2e-4, prompts_per_step=P, group_size=G, updates_per_batch=12,
                            layout="packed", compact_every=3, sample_ahead=False, steps=10**6, seed=0,
                            report_to="none")
        student = AutoModelForCausalLM.from_pretrained(args.base, dtype="float32").train()
        sampler = Sampler(cfg, student, tok, teachers, routes, log=lambda *_: None)
        mix, rng = prompt_mix(routes, cfg.mix, None), random.Random(0)
        batches, worker = [], []
        for step in range(args.batches + 1):
            c0 = time.process_time()
            b = sampler._produce(step, mix, rng).batch  # what the sampling worker calls
            b.lay_out_ahead(cfg.updates_per_batch, torch.Generator().manual_seed(step))
            worker.append(time.process_time() - c0)
            batches.append(b)
        policy = StudentHidden(student)
        opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
        opd_step(policy, opt, batches[0], cfg, sampler.teachers, None, torch.Generator().manual_seed(0))  # warm-up
        update = []
        for i, b in enumerate(batches[1:]):
            c0 = time.process_time()
            opd_step(policy, opt, b, cfg, sampler.teachers, None, torch.Generator().manual_seed(i + 1))
            update.append(time.process_time() - c0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opd_step(policy, opt, batches[1], cfg, sampler.teachers, None, torch.Generator().manual_seed(99))
        ev = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in ev)
        mm = sum(e.self_cpu_time_total for e in ev if e.key == "aten::mm")
        tokens = sum(b.gen_tokens for b in batches[1:]) / args.batches
        u, w = sum(update) / args.batches, sum(worker[1:]) / args.batches
        print(f"| {P} x {G} | {tokens:.0f} | {u:.3f} | {w:.3f} | {tokens / u:.0f} | {tokens / w:.0f} | "
              f"{mm / total:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
