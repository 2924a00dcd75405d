"""Cost of scoring one merge candidate: the naive CLI loop vs opd's in-process path.

Naive: `mergekit-yaml` writes the candidate to disk, then the `lm_eval` CLI loads it and runs
`opd_<cap>_val` (two processes per candidate). opd: mergekit's tensor functions in memory, then
lm-eval in the same process on a model object that is reused. Same recipe, same candidates.

    python bench/bench_merge_candidate.py [--candidates 2] [--base runs/base --experts add rev]

Without --base it builds fake pico experts (scores are then ~0: the timing is the point).
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def naive(cfg: dict, seed: int, caps: list[str], tmp: Path, batch_size: int) -> tuple[float, dict, dict]:
    t0 = time.perf_counter()
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    subprocess.run(["mergekit-yaml", str(tmp / "c.yaml"), str(tmp / "m"), "--random-seed", str(seed)],
                   check=True, capture_output=True)
    subprocess.run(["lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={tmp / 'm'}", "dtype=float32",
                    "--include_path", str(REPO / "evals"), "--tasks", *[f"opd_{c}_val" for c in caps],
                    "--device", "cpu", "--batch_size", str(batch_size), "--output_path", str(tmp / "res"),
                    "--log_samples"],
                   check=True, capture_output=True, cwd=REPO)
    res = json.loads(next((tmp / "res").rglob("results_*.json")).read_text())["results"]
    seconds = time.perf_counter() - t0
    outputs = {}
    for c in caps:
        for line in next((tmp / "res").rglob(f"samples_opd_{c}_val_*.jsonl")).read_text().splitlines():
            d = json.loads(line)
            outputs[c, d["doc_id"]] = d["filtered_resps"]
    return seconds, {c: res[f"opd_{c}_val"]["score,none"] for c in caps}, outputs


def in_process_outputs(model, tokenizer, caps: list[str], batch_size: int) -> dict:
    """Each item's filtered generation, scored the way opd.evaluation.api does (not timed)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device="cpu")
    out = lm_eval.simple_evaluate(model=lm, tasks=[f"opd_{c}_val" for c in caps], log_samples=True,
                                  task_manager=TaskManager(include_path=str(REPO / "evals"), include_defaults=False))
    return {(c, d["doc_id"]): d["filtered_resps"] for c in caps for d in out["samples"][f"opd_{c}_val"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", type=int, default=2)
    ap.add_argument("--base")
    ap.add_argument("--experts", nargs="*", default=["add", "rev"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import optuna

    from opd.merge.recipe import MergeRecipe, load_inputs
    from opd.merge.search import Scorer, suggest
    from opd.weights.merge import merge_candidate, mergekit_config

    work = Path(tempfile.mkdtemp(prefix="opd-bench-merge-"))
    atexit.register(shutil.rmtree, work, True)  # the fake lab and the search's out: removed however it ends
    if args.base:
        base, experts = args.base, args.experts
    else:
        from test_merge_fakes import build_fake_lab

        lab = build_fake_lab(work / "lab", tuple(args.experts))
        base, experts = str(lab["base"]), [str(p) for p in lab["experts"].values()]
    recipe = MergeRecipe(name="bench", base=base, experts=experts, out=str(work / "out"),
                         strategies={"ties": {"density": (0.3, 1.0), "weight": (0.5, 1.0)}},
                         eval_batch_size=args.batch_size)
    inputs = load_inputs(recipe)
    caps = inputs.capabilities
    paths = {e: str(Path(p).resolve()) for e, p in inputs.expert_paths.items()}
    scorer = Scorer(inputs, recipe.eval_batch_size)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    print(f"torch threads: {torch.get_num_threads()}; capabilities {caps}; {args.candidates} candidates")

    rows = []
    for _ in range(args.candidates):
        cand = suggest(study.ask(), recipe, list(paths))
        with tempfile.TemporaryDirectory() as tmp:
            t_naive, s_naive, o_naive = naive(mergekit_config(cand, str(Path(base).resolve()), paths), cand.seed, caps,
                                     Path(tmp), args.batch_size)
        t0 = time.perf_counter()
        sd = merge_candidate(cand, str(inputs.base_path), paths, inputs.base_sd, inputs.expert_sds)
        scorer.model.load_state_dict(sd, strict=False)
        from opd.evaluation.api import evaluate

        s_opd = {c: s.score for c, s in evaluate(scorer.model, inputs.tokenizer, caps, "val",
                                                 batch_size=args.batch_size, use_cache=False).items()}
        t_opd = time.perf_counter() - t0
        same_text = in_process_outputs(scorer.model, inputs.tokenizer, caps, args.batch_size) == o_naive
        rows.append((t_naive, t_opd, s_naive == s_opd and same_text))
        print(f"{cand.label()}\n  naive {t_naive:6.2f} s  {s_naive}\n  opd   {t_opd:6.2f} s  {s_opd}"
              f"\n  scores identical: {s_naive == s_opd}; every generation identical ({len(o_naive)} items): "
              f"{same_text}")
    tn = sum(r[0] for r in rows) / len(rows)
    to = sum(r[1] for r in rows) / len(rows)
    print(f"per candidate: naive {tn:.2f} s, opd in-process {to:.2f} s, ratio {tn / to:.1f}x; "
          f"threads {torch.get_num_threads()}; scores and generations identical: {all(r[2] for r in rows)}")


if __name__ == "__main__":
    main()
