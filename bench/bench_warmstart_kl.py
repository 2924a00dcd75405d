"""The KL warm start's step (`distill.warmstart_loss: kl`) with the teachers' logits cached once
(`offpolicy.teacher_logits_cache`, the default within `warmstart_cache_mib`) against the same step
running its pairs' teachers (`warmstart_cache_mib: 0`), and the NLL step as the floor, on the same
draws of the same teacher samples, in one process.

    python bench/bench_warmstart_kl.py                                   # runs/base, experts/lab10 (twelve)
    python bench/bench_warmstart_kl.py --threads 1 --batch 128 --steps 40

Each expert samples --prompts training prompts x 4 at temperature 0.3 (the lab12 recipe's warm-start
settings, fewer prompts); the cache is built once and timed; then the three step kinds run in turn,
round-robin, --steps times each (the first two of each untimed) on the base student. Prints median wall
ms per step, the ratios against the in-step teachers, and the cache's seconds per 1,000 samples (the
lab12 recipe draws 12 x 4096 x 4 samples).

A fourth kind trains on the teachers' top --topk log-probs a token and a tail bucket
(`distill.warmstart_topk`, a cache of 8 x K bytes a token; what an SGLang teacher returns). A fifth runs the cached-teacher KL step under bf16 autocast (fp32 weights, gradients and
optimizer): whether mixed precision would buy this CPU's warm start
any time (where the CPU has AVX512-BF16 or AMX; elsewhere oneDNN's bf16 products are slower than fp32,
see opd.distill.precision). The bench prints whether the CPU reports avx512_bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import time

LAB12 = ["add", "sub", "mod", "rev", "sort", "count", "max", "shift", "dedup", "digsum", "anagram", "mirror"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--experts", default="experts/lab10")
    ap.add_argument("--prompts", type=int, default=512, help="training prompts per capability its teacher samples")
    ap.add_argument("--batch", type=int, default=64, help="pairs per step (the recipe's warmstart_batch)")
    ap.add_argument("--steps", type=int, default=24, help="steps per kind (the first two untimed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--topk", type=int, default=8, help="K of the top-k kind (distill.warmstart_topk)")
    ap.add_argument("--profile", action="store_true", help="then torch.profiler over 5 cached-KL steps: the ops' "
                    "share of CPU time")
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from opd.distill import resolve_routes
    from opd.distill.loop import StudentHidden
    from opd.distill.offpolicy import (
        cached_logits,
        draw_sft,
        kd_loss,
        main_teachers,
        sft_loss,
        teacher_logits_cache,
        verified_samples,
    )
    from opd.distill.run import load_teachers

    torch.set_num_threads(args.threads)
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    print(f"torch threads: {torch.get_num_threads()}; CPU avx512_bf16: {'avx512_bf16' in flags}, "
          f"amx_bf16: {'amx_bf16' in flags}")
    from opd.distill.precision import _seconds

    width = AutoConfig.from_pretrained(args.base).hidden_size
    f32, b16 = (_seconds(dt, width, torch.device("cpu")) for dt in (torch.float32, torch.bfloat16))
    print(f"one (256 x {width}) @ ({width} x {4 * width}) product: {1e3 * f32:.3f} ms fp32, {1e3 * b16:.3f} ms bf16 "
          f"({f32 / b16:.2f}x)")
    tok = AutoTokenizer.from_pretrained(args.base)
    teachers, _ = load_teachers([f"{args.experts}/{c}" for c in LAB12], tok)
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    pad = tok.pad_token_id
    samples = verified_samples(teachers, routes, random.Random(0), prompts=args.prompts, group=4, temperature=0.3,
                               seed=0, verify=False, prefill="packed")
    warm = main_teachers(teachers, routes)
    n_samples = sum(len(v) for v in samples.values())
    t0 = time.perf_counter()
    cache = teacher_logits_cache(samples, warm, pad, "packed")
    cache_s = time.perf_counter() - t0
    mib = sum(f.numel() * 4 for f, *_ in cache.values()) / 2**20
    n_distinct = sum(len(offsets) - 1 for _, offsets, _ in cache.values())
    print(f"cache: {n_samples} samples ({n_distinct} distinct, each scored once), {mib:.0f} MiB, {cache_s:.1f} s "
          f"({1000 * cache_s / n_samples:.2f} s per 1,000 samples)")

    t0 = time.perf_counter()
    top_cache = teacher_logits_cache(samples, warm, pad, "packed", topk=args.topk)
    print(f"top-{args.topk} cache: {sum(t.ids.numel() * 8 for t, *_ in top_cache.values()) / 2**20:.1f} MiB, "
          f"{time.perf_counter() - t0:.1f} s")

    student = AutoModelForCausalLM.from_pretrained(args.base, dtype="float32").train()
    policy = StudentHidden(student)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4, fused=True)
    mix, rng = {c: 1.0 for c in routes}, random.Random(1)

    def step(kind: str) -> float:
        draws = draw_sft(samples, mix, rng, args.batch)
        batch = [(c, samples[c][i]) for c, i in draws]
        t = time.perf_counter()
        if kind == "nll":
            loss, _ = sft_loss(policy, [p for _, p in batch], pad, 1024, "packed")
        else:
            topk = args.topk if "top-" in kind else None
            zt = cached_logits(top_cache if topk else cache, draws) if "cached" in kind else None
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if "bf16" in kind else contextlib.nullcontext()
            with autocast:  # the products in bf16 (weights, grads and Adam stay fp32)
                loss, _ = kd_loss(policy, batch, warm, pad, 1024, "packed", zt, topk=topk)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t

    kinds = ["kl, in-step teachers", "kl, cached teachers", "nll", f"kl, cached teachers' top-{args.topk}",
             "kl, cached teachers, bf16 autocast"]
    times = {k: [] for k in kinds}
    for i in range(args.steps):
        for k in kinds:
            dt = step(k)
            if i >= 2:
                times[k].append(dt)
    base = statistics.median(times[kinds[0]])
    print(f"| step ({args.batch} pairs) | ms / step | / in-step teachers |")
    print("|---|---|---|")
    for k in kinds:
        m = statistics.median(times[k])
        print(f"| {k} | {1000 * m:.0f} | {m / base:.2f} |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step("kl, cached teachers")
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        print("cached-KL step, share of self CPU time: "
              + ", ".join(f"{e.key} {e.self_cpu_time_total / total:.0%}" for e in ops[:5]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
