"""The packed token layout against the padded one, on the warm start's supervised step: CPU time per
step for the same 64-sequence batches of lab prompts and their reference answers, in one process.

    python bench/bench_packed_layout.py                  # the lab base in runs/base
    python bench/bench_packed_layout.py --base runs/base --steps 40

The two layouts alternate over the same batches (two rounds), so drift in the machine's load hits
both; CPU time (time.process_time) is printed beside wall time. The last line is `ratio: N.NN`,
padded / packed CPU seconds per step.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

LAB10 = ["add", "sub", "mod", "rev", "sort", "count", "max", "shift", "dedup", "digsum"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--steps", type=int, default=40, help="batches per layout and round")
    ap.add_argument("--batch", type=int, default=64, help="sequences per step (the warm start's default)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not os.path.isdir(args.base):
        print(f"error: --base {args.base}: no model there; build it with `python scripts/build_base.py` "
              "or pass another directory", file=sys.stderr)
        sys.exit(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.capabilities import get_capability
    from opd.distill.loop import StudentHidden
    from opd.distill.offpolicy import sft_loss

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype="float32")
    policy, opt = StudentHidden(model), torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(0)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos

    def pair():
        it = get_capability(rng.choice(LAB10)).sample(rng, "train")
        enc = tok([it.prompt, str(it.answer)], add_special_tokens=False).input_ids
        return enc[0], enc[1] + [eos]

    batches = [[pair() for _ in range(args.batch)] for _ in range(args.steps)]
    n_tok = sum(len(c) for b in batches for _, c in b)
    print(f"torch threads {torch.get_num_threads()}; {args.steps} steps x {args.batch} sequences, {n_tok} completion "
          f"tokens per pass; load average {os.getloadavg()[0]:.2f}", flush=True)
    cpu = {"padded": 0.0, "packed": 0.0}
    for rnd in range(2):
        for layout in cpu:
            t, c = time.perf_counter(), time.process_time()
            for b in batches:
                loss, _ = sft_loss(policy, b, tok.pad_token_id, layout=layout)
                loss.backward()
                opt.step()
                opt.zero_grad()
            dc, dt = time.process_time() - c, time.perf_counter() - t
            cpu[layout] += dc
            print(f"round {rnd + 1} {layout:6s}: {dc / args.steps * 1000:6.1f} ms CPU, {dt / args.steps * 1000:6.1f} ms "
                  "wall per step", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"ratio: {cpu['padded'] / cpu['packed']:.2f}")


if __name__ == "__main__":
    main()
