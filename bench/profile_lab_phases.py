"""Where an expert's or a distillation run's seconds go, by phase, timed around the functions that
do the work (wall seconds, serial; the run itself is the shipped code, unchanged).

    python bench/profile_lab_phases.py expert experts/count.yaml steps=60            # shipped settings
    python bench/profile_lab_phases.py expert experts/count.yaml steps=60 gspo.layout=packed \\
        gspo.minibatch=groups engine_args.compact_every=3 engine_args.prefill=packed  # lab10.yaml's
    python bench/profile_lab_phases.py distill merge_recipes/distill/<run>.yaml [key=value ...]

expert: rollouts (`_rollout_batch`), updates (`gspo_step`), val screens (the expert recipe's
`evaluate`; with an empty cache also the base's test scores), the whole GSPO loop, and everything
(loading, the final lm-eval scoring of the expert), into
runs/profile/<name>/ (--fresh: trained anew each time). distill: the warm start's teacher sampling
(`verified_samples`), its supervised forwards (`sft_loss`), every optimizer step (`optimizer_step`:
the backward passes and AdamW, the OPD steps' included), checkpoints and retention checks, the warm
start in all, and everything. Prints the torch thread count the run sets (its spec's `threads`).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

ACC: dict[str, float] = {}


def timed(owner, name: str, key: str | None = None) -> None:
    """Replace owner.name by a wrapper adding its wall seconds to ACC[key or name]."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def wrapper(*a, **k):
        t = time.time()
        try:
            return f(*a, **k)
        finally:
            ACC[key or name] = ACC.get(key or name, 0.0) + time.time() - t
    setattr(owner, name, wrapper)


def expert(spec_path: str, overrides: list[str]) -> None:
    import opd.expert.run as run
    import opd.expert.trainer as trainer
    from opd.expert.spec import load_expert_spec

    timed(trainer, "_rollout_batch", "rollouts")
    timed(trainer, "gspo_step", "updates")
    timed(run, "evaluate", "val screens")  # and the base's test scores, when not cached yet
    timed(run, "train", "GSPO loop")
    spec = load_expert_spec(spec_path, **dict(o.split("=", 1) for o in overrides))
    print(f"torch threads: {spec.threads}", flush=True)
    run.run_expert(spec, out=Path("runs/profile") / spec.expert_name, fresh=True)


def distill(run_path: str, overrides: list[str]) -> None:
    import opd.distill.loop as loop
    from opd.distill.__main__ import main as distill_main

    for name in ("verified_samples", "sft_loss", "optimizer_step", "_warm_start"):
        timed(loop, name)
    timed(loop._Run, "save", "checkpoints")
    timed(loop._Run, "check", "retention checks")
    distill_main([run_path, *overrides, "--fresh"])


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("expert", "distill"):
        print(__doc__, file=sys.stderr)
        return 2
    t = time.time()
    try:
        (expert if sys.argv[1] == "expert" else distill)(sys.argv[2], sys.argv[3:])
    finally:
        ACC["everything"] = time.time() - t
        print("seconds by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in ACC.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
