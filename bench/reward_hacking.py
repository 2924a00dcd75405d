"""Reward hacking on a learned-reward capability, shown two ways (docs/results/reward-models.md).

    python bench/reward_hacking.py curve runs/experts/anagram
        the expert's screening curve from its manifest: the rule's val score (lm-eval), the reward
        model's score of the same greedy val answers, and both scores of each step's training samples
    python bench/reward_hacking.py samples --base runs/base [--capability anagram] [--steps 40] [--kl-coef 0]
        GSPO on the capability's reward model (its shipped spec's settings with `gspo.kl_coef` set to
        --kl-coef, no screening), then the greedy answers to the first 12 val prompts before and after,
        with the rule's and the RM's scores
    python bench/reward_hacking.py score runs/reward_models/anagram w:gcfea= gcfea gcfe gcfeaa ...
        a reward model's score of each answer to one prompt, beside the hidden rule's
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def curve(expert: Path) -> None:
    m = json.loads((expert / "manifest.json").read_text())
    print("| step | rule val (lm-eval) | RM val (greedy) | RM, training samples | rule, training samples |")
    print("|---:|---:|---:|---:|---:|")
    for h in m["train"]["history"]:
        if "val" in h:
            cells = [f"{h[k]:.3f}" if k in h else "-" for k in ("rm_val", "rm_reward", "rule_reward")]
            print(f"| {h['step']} | {h['val']:.3f} | " + " | ".join(cells) + " |")
    t = m["train"]
    print(f"\nkept step {t['best_step']} (val screening {t['best_val_screen']:.3f}), {t['steps']} steps, "
          f"{t['seconds'] / 60:.1f} min")
    for split in ("val", "test"):
        e = m["metrics"][split][m["capability"]]
        print(f"{split}: {e['score']:.3f} ± {e['stderr']:.3f} (n {e['n']})")
    print("reward model:", m.get("reward_model"))


def samples(base: str, capability: str, steps: int, kl_coef: float) -> None:
    import torch

    from opd.capabilities import get_capability
    from opd.capabilities.reward_model import default_dir, load_reward_model
    from opd.evaluation.heldout import heldout_items
    from opd.expert.build import load_base
    from opd.expert.spec import load_expert_spec
    from opd.expert.trainer import train
    from opd.rollout import SamplingParams, get_engine

    torch.set_num_threads(1)
    spec = load_expert_spec(f"experts/{capability}.yaml", base=base, steps=str(steps), eval_every="100000",
                            **{"gspo.kl_coef": str(kl_coef)})
    model, tok = load_base(base)
    cap = get_capability(capability)
    rm = load_reward_model(spec.reward_model_dir or default_dir(capability), capability, tok)
    items = heldout_items(capability, "val")[:12]
    prompts = [it["prompt"] for it in items]

    def show(label: str) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=cap.max_new_tokens + 2)
        texts = [g[0].text.split("\n")[0] for g in get_engine("embedded", model=model, tokenizer=tok).generate(
            prompts, 1, params)]
        rule = [cap.verify(t, it["answer"]) for t, it in zip(texts, items)]
        got = rm.score(prompts, texts)
        print(f"\n{label}: rule {sum(rule) / len(rule):.2f}, RM {sum(got) / len(got):.2f}")
        print("| prompt | answer | rule | RM |\n|---|---|---:|---:|")
        for p, t, r, s in zip(prompts, texts, rule, got):
            print(f"| `{p}` | `{t}` | {r:.0f} | {s:.2f} |")

    show("base")
    with tempfile.TemporaryDirectory() as d:
        state = train(spec.gspo, spec.run_settings(), model, tok, Path(d) / "state.pt", evaluate_fn=lambda m: 0.0,
                      log=lambda *a: None)
    show(f"after {state.step} GSPO steps on the reward model")


def score(rm_dir: Path, prompt: str, answers: list[str]) -> None:
    from transformers import AutoTokenizer

    from opd.capabilities import get_capability
    from opd.capabilities.reward_model import load_reward_model

    capability = json.loads((rm_dir / "manifest.json").read_text())["capability"]
    cap = get_capability(capability)
    rm = load_reward_model(rm_dir, capability, AutoTokenizer.from_pretrained(rm_dir))
    reference = prompt[2:-1] if capability == "anagram" else prompt[2:-1][::-1]
    print("| answer | the rule | RM score |\n|---|---:|---:|")
    for a, s in zip(answers, rm.score([prompt] * len(answers), answers)):
        print(f"| `{a}` | {cap.verify(a, reference):.0f} | {s:.3f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("curve")
    c.add_argument("expert", type=Path)
    s = sub.add_parser("samples")
    s.add_argument("--base", default="runs/base")
    s.add_argument("--capability", default="anagram")
    s.add_argument("--steps", type=int, default=40)
    s.add_argument("--kl-coef", type=float, default=0.0, help="the KL penalty (0: none, as in the hacking run)")
    r = sub.add_parser("score")
    r.add_argument("reward_model", type=Path)
    r.add_argument("prompt")
    r.add_argument("answers", nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "curve":
        curve(args.expert)
    elif args.cmd == "score":
        score(args.reward_model, args.prompt, args.answers)
    else:
        samples(args.base, args.capability, args.steps, args.kl_coef)


if __name__ == "__main__":
    sys.exit(main())
