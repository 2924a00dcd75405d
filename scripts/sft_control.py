"""Control for an RL expert: the same minutes of supervised training from the same base.

    python scripts/sft_control.py experts/count.yaml [--minutes M] [--lr 3e-4]

Trains the base on the expert's capability (train split, reference answers) for M minutes
(default: the expert's recorded training time), keeps the best checkpoint by the same validation
screen, and prints test scores next to the base's and the expert's, so a table can show what RL adds.
Writes runs/controls/<name>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

from opd.errors import OpdError, cli_main


@cli_main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)

    import torch

    from opd.evaluation.api import evaluate
    from opd.expert.build import default_out, load_base
    from opd.expert.spec import load_expert_spec
    from opd.io import atomic_write_json
    from opd.lab.data import MixtureStream, encode_sft

    spec = load_expert_spec(args.spec)
    torch.set_num_threads(spec.threads)
    out = default_out(spec)
    expert = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").exists() else None
    minutes = args.minutes or (expert["train"]["seconds"] / 60 if expert else None)
    if minutes is None:
        raise OpdError(f"{out}: no trained expert to match; pass --minutes")
    model, tok = load_base(spec.base)
    caps = list(expert["metrics"]["test"]) if expert else [spec.capability]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    stream = MixtureStream({spec.capability: 1.0}, seed=spec.seed)
    best = (evaluate(model, tok, [spec.capability], "val", limit=spec.eval_limit)[spec.capability].score,
            copy.deepcopy(model.state_dict()), 0)
    t0, step = time.time(), 0
    while time.time() - t0 < minutes * 60:
        model.train()
        loss = model(**encode_sft(tok, stream.next_batch(args.batch))).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 20 == 0:
            s = evaluate(model, tok, [spec.capability], "val", limit=spec.eval_limit)[spec.capability].score
            if s > best[0]:
                best = (s, copy.deepcopy(model.state_dict()), step)
    model.load_state_dict(best[1])
    scores = {c: s.score for c, s in evaluate(model, tok, caps, "test").items()}
    result = {"capability": spec.capability, "minutes": minutes, "steps": step, "best_step": best[2],
              "lr": args.lr, "batch": args.batch, "test": scores}
    atomic_write_json(Path("runs/controls") / f"{spec.expert_name}.json", result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
