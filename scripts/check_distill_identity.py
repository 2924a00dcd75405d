"""Record OPD runs on pico models and compare two recordings exactly: a refactor of the distillation
loop must leave every loss and the student's final weights bit-identical.

    python scripts/check_distill_identity.py record before.json     # on the old code
    python scripts/check_distill_identity.py record after.json      # on the new code
    python scripts/check_distill_identity.py compare before.json after.json

Each case trains a pico student (opd.lab.pico.PICO, random weights, seed 0) from three perturbed
copies as teachers, with a checkpoint file and a val check whose score is a fixed function of the
weights (so keep-best acts), on one torch thread. `default` is 50 steps of the default settings
(the sampled estimator); the others are shorter and cover the full and top-k estimators (stacked and
per-teacher), the reward term, capability weights, the warm start, sampling ahead, and a run stopped and resumed
from its checkpoint. Recorded per
case: the final student's `state_dict_hash`, the kept step, and every history record less its
wall-clock fields (`time/*`), floats as their exact `repr`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

CASES: dict[str, dict] = {
    "default": {"steps": 50},
    "full-stacked-reward": {"steps": 12, "estimator": "full", "reward_weight": 0.5,
                            "capability_weights": {"count": 2.0}},
    "sampled-reward-packed": {"steps": 8, "reward_weight": 0.5, "layout": "packed", "updates_per_batch": 2,
                              "capability_weights": {"rev": 3.0}, "lr_schedule": "cosine"},
    "full-loop": {"steps": 8, "estimator": "full", "teacher_forward": "loop", "updates_per_batch": 2},
    "topk-stacked": {"steps": 8, "estimator": "topk", "topk": 8},
    "topk-loop-packed": {"steps": 8, "estimator": "topk", "topk": 8, "teacher_forward": "loop", "layout": "packed"},
    "ahead-thread-warm": {"steps": 10, "sample_ahead": True, "sample_worker": "thread", "warmstart_steps": 4,
                          "warmstart_prompts": 8, "warmstart_batch": 8, "verifier": "none", "checkpoint_every": 2},
    "ahead-process-bf16": {"steps": 8, "sample_ahead": True, "sample_worker": "process",
                           "inference_dtype": "bfloat16", "eval_every": 4},
    # stopped after step 20's checkpoint, then rerun: resumes there (the result matches `default`'s run)
    "default-resumed": {"steps": 50, "stop_at": 20},
    "ahead-thread-resumed": {"steps": 10, "sample_ahead": True, "sample_worker": "thread", "checkpoint_every": 2,
                             "stop_at": 6},
}
COMMON = {"prompts_per_step": 4, "group_size": 2, "eval_every": 10, "checkpoint_every": 10, "report_to": "none",
          "seed": 0}


def run_case(name: str, settings: dict, work: Path) -> dict:
    from opd.distill import DistillConfig, distill, embedded_teacher, resolve_routes
    from opd.io import state_dict_hash
    from opd.lab.model import build_model
    from opd.lab.pico import PICO
    from opd.lab.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    student = build_model(PICO, tok, seed=0)
    torch.manual_seed(1)
    teachers = {}
    for i, cap in enumerate(["count", "rev", "sort"]):
        m = copy.deepcopy(student)
        for p in m.parameters():
            p.data += 0.05 * torch.randn_like(p)
        teachers[f"t{i}"] = embedded_teacher(f"t{i}", cap, m, tok)
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    caps = sorted(routes)
    anchor = {k: v.detach().clone() for k, v in teachers["t0"].model.state_dict().items()}

    def evaluate(model) -> dict[str, float]:
        # a fixed function of the weights: closeness to t0, varied per capability so retention differs
        sd = model.state_dict()
        d = sum(float((sd[k].float() - anchor[k]).pow(2).sum()) for k in anchor)
        return {c: 1.0 / (1.0 + d * (i + 1)) for i, c in enumerate(caps)}

    settings = dict(settings)
    stop_at = settings.pop("stop_at", None)
    cfg = DistillConfig(**{**COMMON, **settings})
    init = copy.deepcopy(student.state_dict())
    kw = {"evaluate_fn": evaluate, "references": dict.fromkeys(caps, 1.0), "log": lambda *_: None}
    if stop_at is not None:  # the first run stops after step `stop_at`; the rerun below resumes
        distill(cfg, student, tok, teachers, routes, work / name / "state.pt", stop=lambda r: r["step"] == stop_at,
                **kw)
        student.load_state_dict(init)  # what a rerun loads: the checkpoint, not this process's weights
    state = distill(cfg, student, tok, teachers, routes, work / name / "state.pt", **kw)
    final_hash = state_dict_hash(student)
    if state.best_model is not None and state.best_step != state.step:
        student.load_state_dict(state.best_model)
    history = [{k: repr(v) if isinstance(v, float) else v for k, v in r.items() if not k.startswith("time/")}
               for r in state.history]
    return {"final_hash": final_hash, "kept_hash": state_dict_hash(student), "kept_step": state.best_step,
            "steps": state.step, "gen_tokens": state.gen_tokens, "losses": [r.get("loss") for r in history],
            "history": history}


def record(out: Path, only: list[str] | None) -> None:
    import opd

    torch.set_num_threads(1)
    result = {"opd": opd.__file__, "cases": {}}
    with tempfile.TemporaryDirectory() as d:
        for name, settings in CASES.items():
            if only and name not in only:
                continue
            result["cases"][name] = r = run_case(name, settings, Path(d))
            print(f"{name}: final {r['final_hash']} kept {r['kept_hash']}@{r['kept_step']} "
                  f"last loss {r['losses'][-1]}", flush=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def compare(a: Path, b: Path) -> int:
    ra, rb = json.loads(a.read_text())["cases"], json.loads(b.read_text())["cases"]
    bad = 0
    for name in sorted(set(ra) | set(rb)):
        ca, cb = ra.get(name), rb.get(name)
        if ca is None or cb is None:
            print(f"{name}: only in {'the first' if cb is None else 'the second'}")
            bad += 1
            continue
        diff = [k for k in ca if ca[k] != cb.get(k)]
        print(f"{name}: {'identical' if not diff else 'DIFFERS in ' + ', '.join(diff)} (final {ca['final_hash']} / "
              f"{cb['final_hash']})")
        bad += bool(diff)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--only", nargs="*", help="case names (default: all)")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.out, args.only)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
