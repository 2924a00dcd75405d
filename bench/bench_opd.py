"""Student tokens to a target score: on-policy distillation vs multi-task GSPO on verifier rewards.

Both runs start from the base and draw prompts from the experts' capabilities in the same mix. OPD
learns from its teachers' per-token log-probs (reverse KL); the control is the same loop with the
KL term off and group-normalised verifier rewards only (kl_weight=0, reward_weight=1: GSPO-token
with per-sequence advantages, which is GSPO). Each run stops once its mean val score over the
capabilities reaches the target; the cost counted is student tokens sampled.

    python bench/bench_opd.py --experts add,rev,count,sort [--base runs/base] [--target 0.8]
    python bench/bench_opd.py --experts sort,rev,shift,dedup --match-gspo --max-steps 300
    python bench/bench_opd.py --experts sort,rev,shift,dedup --match-gspo --estimator full --opd group_size=1
    python bench/bench_opd.py --fake        # pico fake experts: checks the wiring in seconds

The target defaults to --target-frac (0.9) of the mean of the experts' own val scores. With
--match-gspo, GSPO runs its full --max-steps first and the target is the best mean val it reached;
its cost is the tokens at the evaluation where it first reached that score, and OPD then runs until
it reaches the same score. Both runs are evaluated on the same grid (--eval-every steps).
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def run_to_target(cfg, base_dir: str, teachers, routes, caps, target: float, eval_limit: int, label: str):
    """Train from the base until the mean val score reaches `target`; returns (tokens, score, reached, s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.distill import distill
    from opd.evaluation.api import evaluate

    student = AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")
    tok = AutoTokenizer.from_pretrained(base_dir)
    best = {"score": -1.0, "tokens": 0}
    curve = []  # (student tokens, mean val) at every evaluation

    def screen(m):
        return {c: s.score for c, s in evaluate(m, tok, caps, "val", limit=eval_limit).items()}

    def stop(rec) -> bool:
        vals = [v for k, v in rec.items() if k.startswith("val/")]
        if vals:
            mean = sum(vals) / len(vals)
            curve.append((rec["gen_tokens"], mean))
            if mean > best["score"]:
                best.update(score=mean, tokens=rec["gen_tokens"])
            print(f"  {label}: step {rec['step']} tokens {rec['gen_tokens']} mean val {mean:.3f}", flush=True)
        return target is not None and best["score"] >= target

    t0 = time.time()
    state = distill(cfg, student, tok, teachers, routes, evaluate_fn=screen, log=lambda *_: None, stop=stop)
    reached = target is not None and best["score"] >= target
    # cost: tokens at the first evaluation that reached the target (or, without one, the best score)
    tokens = state.gen_tokens if target is not None else best["tokens"]
    return {"tokens": tokens, "best_mean_val": best["score"], "reached": reached or target is None,
            "seconds": time.time() - t0, "steps": state.step, "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="add,rev,count,sort", help="comma-separated expert names or paths")
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--fake", action="store_true", help="build pico fake experts in a temp dir (wiring check)")
    ap.add_argument("--target", type=float, help="mean val score both runs must reach")
    ap.add_argument("--target-frac", type=float, default=0.9, help="default target: this share of the "
                    "experts' mean own val score")
    ap.add_argument("--match-gspo", action="store_true", help="target: the best mean val GSPO reaches "
                    "in --max-steps (GSPO runs first, to the end)")
    ap.add_argument("--max-steps", type=int, default=2000, help="give up after this many steps (per run)")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-limit", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--opd", action="append", default=[], metavar="KEY=VALUE", help="an OPD-only setting "
                    "(a DistillConfig field), e.g. --opd group_size=1: OPD's per-token KL advantage needs no "
                    "group of samples, GSPO's group-normalised reward does")
    ap.add_argument("--reuse-gspo", metavar="JSON", help="with --match-gspo: take the GSPO run from an earlier "
                    "--out of this bench with the same base, experts and GSPO settings instead of rerunning it")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--estimator", choices=["sampled", "full"], default="sampled")
    ap.add_argument("--min-gain", type=float, default=0.02, help="no ratio unless the target beats the start "
                    "model's mean val by at least this much (a target at the start's score measures nothing)")
    ap.add_argument("--seed", type=int, default=0, help="both runs' sampling seed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.distill import DistillConfig, resolve_routes
    from opd.distill.run import load_teachers, teacher_references

    base, names = args.base, args.experts.split(",")
    if args.fake:
        from test_merge_fakes import build_fake_lab

        root = Path(tempfile.mkdtemp(prefix="opd-bench-"))
        atexit.register(shutil.rmtree, root, True)  # a fake lab: removed however the bench ends
        lab = build_fake_lab(root, tuple(names[:2]) if names else ("add", "rev"))
        base, names = str(lab["base"]), [str(p) for p in lab["experts"].values()]
        args.max_steps = min(args.max_steps, 2)
        args.eval_every, args.eval_limit = 1, 5
    teachers, manifests = load_teachers(names, AutoTokenizer.from_pretrained(base))
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    caps = list(routes)
    refs = teacher_references(routes, manifests)
    target = args.target if args.target is not None else args.target_frac * sum(refs.values()) / max(1, len(refs))
    common = dict(steps=args.max_steps, lr=args.lr, prompts_per_step=args.prompts, group_size=args.group,
                  eval_every=args.eval_every, eval_limit=args.eval_limit, estimator=args.estimator, seed=args.seed)
    print(f"torch threads {torch.get_num_threads()}; capabilities {caps}; teacher val scores {refs}; "
          f"target mean val {target:.3f}", flush=True)

    # Both runs start from the base: a target at or below its score is reached before any training.
    from opd.evaluation.api import evaluate
    from opd.io import state_dict_hash

    base_model = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    start_scores = evaluate(base_model, AutoTokenizer.from_pretrained(base), caps, "val", limit=args.eval_limit)
    start = sum(s.score for s in start_scores.values()) / len(caps)
    print(f"start (base) mean val {start:.3f}", flush=True)
    results = {}
    from opd.config import apply_overrides, parse_overrides

    opd_cfg = DistillConfig(**apply_overrides(dict(common), parse_overrides(args.opd)))
    gspo_cfg = DistillConfig(**common, kl_weight=0.0, reward_weight=1.0)
    fingerprint = {"base_hash": state_dict_hash(base_model), "teachers": {n: m["content_hash"] for n, m in manifests.items()},
                   "gspo": gspo_cfg.model_dump(mode="json")}
    runs = (("OPD", opd_cfg), ("GSPO", gspo_cfg))
    for label, cfg in (runs[::-1] if args.match_gspo else runs):
        if label == "GSPO" and args.reuse_gspo:
            r = _reused_gspo(args, fingerprint)
        else:
            r = run_to_target(cfg, base, teachers, routes, caps,
                              None if label == "GSPO" and args.match_gspo else target, args.eval_limit, label)
        results[label] = r
        if label == "GSPO" and args.match_gspo:
            target = r["best_mean_val"]
            print(f"GSPO: best mean val {target:.3f}, first reached at {r['tokens']} student tokens; "
                  f"target for OPD {target:.3f}", flush=True)
        else:
            print(f"{label}: {r['tokens']} student tokens, best mean val {r['best_mean_val']:.3f}, "
                  f"{'reached' if r['reached'] else 'did NOT reach'} the target, {r['seconds']:.0f} s", flush=True)
    opd, gspo = results["OPD"], results["GSPO"]
    ratio = gspo["tokens"] / max(1, opd["tokens"])
    # a run that missed the target only bounds the ratio
    bound = "" if opd["reached"] and gspo["reached"] else (" (lower bound: GSPO missed the target)"
                                                             if opd["reached"] else " (OPD missed the target)")
    if target < start + args.min_gain:
        ratio, bound = None, ""
        print(f"no ratio: the target {target:.3f} is not --min-gain {args.min_gain} above the start model's "
              f"{start:.3f}, so reaching it "
              f"measures nothing{' (GSPO never beat the base)' if args.match_gspo else ''}; "
              f"threads {torch.get_num_threads()}")
    else:
        print(f"tokens GSPO / OPD = {ratio:.1f}x{bound}; threads {torch.get_num_threads()}")
    if args.out:
        Path(args.out).write_text(json.dumps({"target": target, "start": start, "threads": torch.get_num_threads(),
                                              "ratio": ratio, "args": vars(args), "fingerprint": fingerprint,
                                              "opd_config": opd_cfg.model_dump(mode="json"), **results}, indent=2))


def _reused_gspo(args, fingerprint: dict) -> dict:
    """The GSPO result of an earlier run of this bench, refused unless it was the same GSPO run."""
    if not args.match_gspo:
        sys.exit(f"error: --reuse-gspo {args.reuse_gspo}: only with --match-gspo")
    try:
        old = json.loads(Path(args.reuse_gspo).read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"error: --reuse-gspo {args.reuse_gspo}: cannot read it ({e})")
    if old.get("fingerprint") != fingerprint or old["args"].get("match_gspo") is not True:
        sys.exit(f"error: --reuse-gspo {args.reuse_gspo}: its base, teachers or GSPO settings differ from this "
                 "run's; rerun without --reuse-gspo")
    print(f"GSPO: reused from {args.reuse_gspo}", flush=True)
    return old["GSPO"]


if __name__ == "__main__":
    main()
