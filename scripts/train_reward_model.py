"""Fit the reward model of a learned-reward capability on its hidden rule's preference pairs.

    python scripts/train_reward_model.py --capability anagram [--base runs/base] [--out DIR] [key=value ...]

The reward model uses the base's tokenizer and is written to runs/reward_models/<capability>/ (or
--out) with a manifest holding its held-out accuracy and its tokenizer's content hash. Settings
(opd.capabilities.reward_model.RewardModelSettings) are key=value words: pairs=1500 steps=300
spurious=0.8 seed=0 shape.hidden_size=64 ...
"""

from __future__ import annotations

import argparse
import sys

from opd.config import apply_overrides, parse_overrides
from opd.errors import OpdError, cli_main


@cli_main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python scripts/train_reward_model.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capability", required=True, help="a learned-reward capability (anagram, mirror)")
    ap.add_argument("--base", default="runs/base", help="model directory whose tokenizer the reward model uses")
    ap.add_argument("--out", default=None, help="output directory (default: runs/reward_models/<capability>)")
    ap.add_argument("settings", nargs="*", help="key=value settings, e.g. pairs=800 steps=200")
    args = ap.parse_args(argv)

    import pydantic
    from transformers import AutoTokenizer

    from opd.capabilities.reward_model import (
        KIND,
        RewardModelSettings,
        default_dir,
        learned_reward_capability,
    )
    from opd.errors import format_validation_error
    from opd.paths import check_output, require_model_dir
    from opd.rl.reward_fit import train_reward_model

    learned_reward_capability(args.capability)
    try:
        settings = RewardModelSettings.model_validate(
            apply_overrides({"capability": args.capability}, parse_overrides(args.settings)))
    except pydantic.ValidationError as e:
        raise OpdError(format_validation_error("command line", e)) from None
    out = check_output(args.out or default_dir(args.capability), "--out", kind=KIND)
    base = require_model_dir(args.base, "--base", "point --base at the lab base (runs/base) or the model "
                             "directory whose tokenizer the policy uses")
    tok = AutoTokenizer.from_pretrained(base)
    m = train_reward_model(settings, tok, out, log=lambda s: print(s, file=sys.stderr), base_dir=base)
    h = m["heldout"]
    kinds = ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in h["by_kind"].items())
    print(f"wrote {out}: held-out accuracy {h['accuracy']:.3f} on {h['n']} pairs ({kinds}); "
          f"train accuracy {m['train_accuracy']:.3f}; {m['train']['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
