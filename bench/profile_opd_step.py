"""Serial milliseconds of one tuned OPD step's three phases on the lab10 teachers: the student's
sampling, the teachers' scoring, the update (no sampling ahead, so each phase is timed alone).

    python bench/profile_opd_step.py                      # 64 prompts x 3, 3 updates, fp32
    python bench/profile_opd_step.py --prompts 48 --group 4 --compact-every 0 --prefill padded

Medians over --steps steps after 3 warm-up steps, 1 torch thread (printed).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

LAB10 = ["add", "sub", "mod", "rev", "sort", "count", "max", "shift", "dedup", "digsum"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--experts", default=",".join(f"experts/lab10/{n}" for n in LAB10))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=3)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--compact-every", type=int, default=3, help="0: one generate call to the end")
    ap.add_argument("--prefill", choices=["packed", "padded"], default="packed")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="sampling and scoring")
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.distill import DistillConfig, resolve_routes
    from opd.distill.batch import build_batch, sample_batch
    from opd.distill.loop import StudentHidden, opd_step
    from opd.distill.run import load_teachers
    from opd.distill.sampler import sampler_copy
    from opd.distill.teacher_bank import TeacherBank
    from opd.rollout import get_engine

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.base)
    teachers, _ = load_teachers(args.experts.split(","), tok)
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    cfg = DistillConfig(estimator="full", lr=1.6e-4, prompts_per_step=args.prompts, group_size=args.group,
                        updates_per_batch=args.updates, layout="packed")
    student = AutoModelForCausalLM.from_pretrained(args.base, dtype="float32").train()
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    dtype = getattr(torch, args.dtype)
    sampler = sampler_copy(student, dtype)
    engine = get_engine("embedded", model=sampler, tokenizer=tok, compact_every=args.compact_every or None,
                        prefill=args.prefill)
    bank = TeacherBank(teachers, sorted({t for ts in routes.values() for t in ts}),
                       dtype if dtype != torch.float32 else None)
    policy, rng = StudentHidden(student), random.Random(0)
    mix = {c: 1 / len(routes) for c in routes}
    ms: dict[str, list[float]] = {"sample": [], "score": [], "update": []}
    tokens = []
    for step in range(args.steps + 3):
        sampler.load_state_dict(student.state_dict())
        t0 = time.perf_counter()
        items, groups = sample_batch(engine, routes, mix, rng, prompts=args.prompts, group=args.group,
                                     temperature=1.0, max_new_tokens=None, seed=step)
        t1 = time.perf_counter()
        batch = build_batch(sampler, items, groups, teachers, routes, tok.pad_token_id, cfg.kernel_chunk, bank,
                            old_lp=False, layout="packed")
        t2 = time.perf_counter()
        opd_step(policy, opt, batch, cfg, teachers, None, torch.Generator().manual_seed(step))
        t3 = time.perf_counter()
        if step >= 3:
            for k, v in zip(ms, (t1 - t0, t2 - t1, t3 - t2)):
                ms[k].append(v * 1000)
            tokens.append(batch.gen_tokens)
    print(f"threads {torch.get_num_threads()}; {args.prompts} x {args.group}, {args.updates} updates, "
          f"compact_every {args.compact_every or None}, {args.prefill} prefill, {args.dtype}: "
          + ", ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in ms.items())
          + f" (median of {args.steps}); {statistics.mean(tokens):.0f} student tokens a step")


if __name__ == "__main__":
    main()
