"""Cost of scoring one merge candidate: the naive CLI loop vs opd's in-process path.

Naive: `mergekit-yaml` writes the candidate to disk, then the `lm_eval` CLI loads it and runs
`opd_<cap>_val` (two processes per candidate). opd: mergekit's tensor functions in memory, then
lm-eval in the same process on a model object that is reused, with lm-eval task objects built once
per search, and mergekit's magnitude sparsification reading each task vector's sort from
opd.weights.sort_cache (the first candidate sorts, the next ones reuse it). Same recipe, same
candidates; scores and every generation must match.

    python bench/bench_merge_candidate.py [--candidates 2] [--base runs/base --experts add rev]

Without --base it builds fake pico experts (scores are then ~0: the timing is the point).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
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


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def naive(cfg: dict, seed: int, caps: list[str], tmp: Path, batch_size: int) -> tuple[float, float, dict, dict]:
    # the same torch thread count as the in-process path (torch reads it at start from OMP_NUM_THREADS)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    t0, cpu0 = time.perf_counter(), children_cpu()
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    subprocess.run(["mergekit-yaml", str(tmp / "c.yaml"), str(tmp / "m"), "--random-seed", str(seed)],
                   check=True, capture_output=True, env=env)
    subprocess.run(["lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={tmp / 'm'}", "dtype=float32",
                    "--include_path", str(REPO / "evals"), "--tasks", *[f"opd_{c}_val" for c in caps],
                    "--device", "cpu", "--batch_size", str(batch_size), "--output_path", str(tmp / "res"),
                    "--log_samples"],
                   check=True, capture_output=True, cwd=REPO, env=env)
    res = json.loads(next((tmp / "res").rglob("results_*.json")).read_text())["results"]
    seconds, cpu = time.perf_counter() - t0, children_cpu() - cpu0
    outputs = {}
    for c in caps:
        for line in next((tmp / "res").rglob(f"samples_opd_{c}_val_*.jsonl")).read_text().splitlines():
            d = json.loads(line)
            outputs[c, d["doc_id"]] = d["filtered_resps"]
    return seconds, cpu, {c: res[f"opd_{c}_val"]["score,none"] for c in caps}, outputs


def in_process_outputs(caps: list[str]) -> dict:
    """Each item's filtered generation from the latest in-process scoring: the timed run's own outputs,
    kept on the Instances of the lm-eval tasks that opd reuses across candidates."""
    from opd.evaluation.api import lm_eval_tasks

    tasks = lm_eval_tasks(caps, "val")
    return {(c, i.doc_id): [i.filtered_resps["none"]] for c in caps for i in tasks[f"opd_{c}_val"].instances}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", type=int, default=2)
    ap.add_argument("--base")
    ap.add_argument("--experts", nargs="*", default=["add", "rev"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=200, help="both paths (the recipe default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import optuna

    from opd.merge.recipe import MergeRecipe, load_inputs
    from opd.merge.references import Scorer
    from opd.merge.space import suggest
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
    from opd.evaluation.api import evaluate

    def score_in_process() -> dict[str, float]:
        return {c: s.score for c, s in evaluate(scorer.model, inputs.tokenizer, caps, "val",
                                                batch_size=args.batch_size, use_cache=False).items()}

    # Once per search, before any candidate: the search scores the base and the experts first, and
    # that first scoring builds the lm-eval tasks every candidate then reuses.
    t0 = time.perf_counter()
    score_in_process()
    print(f"torch threads: {torch.get_num_threads()}; capabilities {caps}; {args.candidates} candidates; "
          f"load average {os.getloadavg()[0]:.2f}; once per search (tasks built, base scored): "
          f"{time.perf_counter() - t0:.2f} s")

    rows = []
    for _ in range(args.candidates):
        cand = suggest(study.ask(), recipe, list(paths))
        with tempfile.TemporaryDirectory() as tmp:
            t_naive, cpu_naive, s_naive, o_naive = naive(mergekit_config(cand, str(Path(base).resolve()), paths),
                                                         cand.seed, caps, Path(tmp), args.batch_size)
        t0, cpu0 = time.perf_counter(), time.process_time() + children_cpu()  # with any subprocess it starts
        sd = merge_candidate(cand, str(inputs.base_path), paths, inputs.base_sd, inputs.expert_sds)
        scorer.model.load_state_dict(sd, strict=False)
        t_merge = time.perf_counter() - t0
        s_opd = score_in_process()
        t_opd, cpu_opd = time.perf_counter() - t0, time.process_time() + children_cpu() - cpu0
        o_opd = in_process_outputs(caps)
        same = s_naive == s_opd and o_opd == o_naive
        rows.append((t_naive, t_opd, t_merge, cpu_naive, cpu_opd, same))
        print(f"{cand.label()}\n  naive {t_naive:6.2f} s (cpu {cpu_naive:6.2f} s)  {s_naive}"
              f"\n  opd   {t_opd:6.2f} s (cpu {cpu_opd:6.2f} s)  {s_opd}  (merge {t_merge:.2f} s, "
              f"score {t_opd - t_merge:.2f} s)\n  scores identical: {s_naive == s_opd}; every generation "
              f"identical ({len(o_naive)} items, {len(o_opd)} in-process): {o_opd == o_naive}")
    from opd.weights.sort_cache import CACHE

    print(f"task-vector magnitudes sorted {CACHE.misses} times, sort reused {CACHE.hits} times")
    tn, to, tm, cn, co = (sum(r[i] for r in rows) / len(rows) for i in range(5))
    ok = all(r[5] for r in rows)
    print(f"per candidate: naive {tn:.2f} s, opd in-process {to:.2f} s (merge {tm:.2f} s, score {to - tm:.2f} s), "
          f"ratio {tn / to:.1f}x (cpu time {cn:.2f} s vs {co:.2f} s, {cn / co:.1f}x); "
          f"threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}; "
          f"scores and generations identical: {ok}")
    if not ok:
        raise SystemExit("the in-process path scored or generated differently from the naive one")


if __name__ == "__main__":
    main()
