"""The first sort of a search's task vectors: float32 descending (what the sort cache did first) against
the int32 bit-pattern sort it does now (opd.weights.sort_cache.SortedMagnitudes), same values checked.

    python bench/bench_sort_cache.py [--base runs/base --experts experts/lab10/sort experts/lab10/rev ...]

Without --base it builds fake pico experts. Prints both times, their ratio and the torch thread count.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def deltas(base: str, experts: list[str], out: Path) -> list[torch.Tensor]:
    """|expert - base| of every tensor of every expert, flat float32, as the cache receives them; the
    experts loaded and checked as a merge search loads them (names or paths)."""
    from opd.merge.recipe import MergeRecipe, load_inputs

    inputs = load_inputs(MergeRecipe(name="bench", base=base, experts=experts, out=str(out),
                                     strategies={"ties": {"density": 0.5}}))
    return [(sd[k] - inputs.base_sd[k]).abs().reshape(-1).float().contiguous()
            for sd in inputs.expert_sds.values() for k in inputs.base_sd]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base")
    ap.add_argument("--experts", nargs="*", default=["add", "rev"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from opd.weights.sort_cache import SortedMagnitudes

    work = Path(tempfile.mkdtemp(prefix="opd-bench-sort-"))
    atexit.register(shutil.rmtree, work, True)  # the fake lab: removed however the bench ends
    if args.base:
        base, experts = args.base, args.experts
    else:
        from test_merge_fakes import build_fake_lab

        lab = build_fake_lab(work / "lab", tuple(args.experts))
        base, experts = str(lab["base"]), [str(p) for p in lab["experts"].values()]
    ws = deltas(base, experts, work / "out")
    times = {"float32 descending": [], "int32 bits (cache)": []}
    for _ in range(args.repeats):  # alternating, the best of each kept
        t = time.perf_counter()
        want = [torch.sort(w, descending=True).values for w in ws]
        times["float32 descending"].append(time.perf_counter() - t)
        cache = SortedMagnitudes()
        t = time.perf_counter()
        got = [cache.get(w) for w in ws]
        times["int32 bits (cache)"].append(time.perf_counter() - t)
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            raise SystemExit("the int32 sort gave other values than the float32 sort")
    f, i = min(times["float32 descending"]), min(times["int32 bits (cache)"])
    print(f"torch threads: {torch.get_num_threads()}; {len(ws)} task-vector tensors, "
          f"{sum(w.numel() for w in ws):,} values; best of {args.repeats}")
    print(f"float32 descending sort {f:.3f} s; int32 bit-pattern sort (with the cache's hashing) {i:.3f} s; "
          f"identical values: True")
    print(f"ratio: {f / i:.2f}")


if __name__ == "__main__":
    main()
