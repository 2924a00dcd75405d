"""How accurate would a no-verifier warm start's targets be? Per capability, the accuracy of its expert's
greedy answer, of one sample, and of the MBR pick of G samples (opd.distill.offpolicy.mbr_pick, what
`warmstart_select: mbr` trains on), on training-split prompts, at each temperature.

    python scripts/mbr_targets.py --experts experts/lab10 --caps digsum,sub,dedup,add,count,rev

The verifier is read here only to measure the targets; a `verifier: none` consolidation never calls it.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.capabilities import get_capability, prompt_texts
from opd.distill.offpolicy import mbr_pick
from opd.rollout import SamplingParams
from opd.rollout.embedded import EmbeddedEngine


def accuracy(cap, items, groups, pick) -> float:
    """Share of prompts whose picked sample the capability's verifier accepts."""
    return sum(cap.verify(pick(g).text, it.answer) for it, g in zip(items, groups)) / len(items)


def mbr(group):
    """The sample `warmstart_select: mbr` keeps of one prompt's group."""
    done = [r for r in group if r.completion_ids] or group
    chosen = mbr_pick([tuple(r.completion_ids) for r in done])
    return next(r for r in done if tuple(r.completion_ids) == chosen)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="experts/lab10", help="directory with one expert per capability")
    ap.add_argument("--base", default="runs/base", help="the tokenizer's model")
    ap.add_argument("--caps", default="digsum,sub,dedup,add,count,rev")
    ap.add_argument("--items", type=int, default=400, help="training prompts per capability")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt for the MBR pick")
    ap.add_argument("--temperatures", default="0.3,0.7,1.0")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    tok = AutoTokenizer.from_pretrained(args.base)
    temps = [float(t) for t in args.temperatures.split(",")]
    print("| capability | greedy | " + " | ".join(f"T={t} one sample | T={t} MBR of {args.group}" for t in temps) + " |")
    print("|---|---|" + "---|---|" * len(temps))
    for cap in args.caps.split(","):
        c = get_capability(cap)
        model = AutoModelForCausalLM.from_pretrained(Path(args.experts, cap), dtype="float32").eval()
        engine = EmbeddedEngine(model, tok, 256, 3, "packed")
        rng = random.Random(1)
        items = [c.sample(rng, "train") for _ in range(args.items)]
        texts = prompt_texts(items, tok)

        cap_len = c.max_new_tokens + 1
        row = [accuracy(c, items, engine.generate(texts, 1, SamplingParams(temperature=0.0, max_new_tokens=cap_len, seed=1)),
                   lambda g: g[0])]
        for t in temps:
            groups = engine.generate(texts, args.group, SamplingParams(temperature=t, max_new_tokens=cap_len, seed=2))
            row += [accuracy(c, items, groups, lambda g: g[0]), accuracy(c, items, groups, mbr)]
        print(f"| {cap} | " + " | ".join(f"{x:.3f}" for x in row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
