"""A warm-start checkpoint's save and load with its samples as Python lists (how they were kept until
now) against the same samples packed into tensors (`offpolicy.pack_samples`, what the loop keeps), in
one process, on a model the size of the lab's base with its AdamW state.

    python bench/bench_warm_checkpoint.py                       # the lab12 recipe's 12 x 16,384 pairs
    python bench/bench_warm_checkpoint.py --pairs 4096 --repeats 5

The samples are random token ids of the lab's lengths (prompts of 8, completions of 4): pickling cost
depends on the count of items, not their values. Each save goes through `opd.io.atomic_torch_save` with
the previous version kept, as the loop's checkpoints do (60 saves in the lab12 recipe's 3,000-step warm
start). Prints median seconds and the packed / lists ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--capabilities", type=int, default=12)
    ap.add_argument("--pairs", type=int, default=16384, help="samples per capability")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from opd.distill.offpolicy import pack_samples, unpack_samples
    from opd.io import atomic_torch_save

    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    model = AutoModelForCausalLM.from_pretrained(args.base)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()  # AdamW moments, as a checkpoint carries them
    rng = random.Random(0)
    samples = {f"cap{c}": [([rng.randrange(60) for _ in range(8)], [rng.randrange(60) for _ in range(4)])
                           for _ in range(args.pairs)] for c in range(args.capabilities)}
    t = time.perf_counter()
    packed = pack_samples(samples)
    pack_s = time.perf_counter() - t
    assert unpack_samples(packed) == samples
    kinds = {"lists": samples, "packed": packed}
    save, load = {k: [] for k in kinds}, {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.repeats):
            for kind, warm in kinds.items():
                path = Path(d) / f"{kind}.pt"
                ck = {"model": model.state_dict(), "optim": opt.state_dict(),
                      "state": {"step": 0, "warm_samples": warm}, "rng": rng.getstate()}
                t = time.perf_counter()
                atomic_torch_save(ck, path, keep_previous=True)
                save[kind].append(time.perf_counter() - t)
                t = time.perf_counter()
                torch.load(path, weights_only=True)
                load[kind].append(time.perf_counter() - t)
    n = args.capabilities * args.pairs
    print(f"{n:,} pairs; packing them once: {pack_s:.2f} s")
    print("| checkpoint | save s | load s |")
    print("|---|---|---|")
    for kind in kinds:
        print(f"| samples as {kind} | {statistics.median(save[kind]):.3f} | {statistics.median(load[kind]):.3f} |")
    print(f"| packed / lists | {statistics.median(save['packed']) / statistics.median(save['lists']):.3f} | "
          f"{statistics.median(load['packed']) / statistics.median(load['lists']):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
