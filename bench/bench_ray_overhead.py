"""Ray's overhead per expert, on the pico lab (not lab10): the lab's experts stage on the local process
pool (2 jobs) against Ray tasks on a local cluster on this machine (a head with no CPUs and two
1-CPU worker nodes, ray.cluster_utils). It also checks that both give bit-identical experts.

    python bench/bench_ray_overhead.py [--experts count,max] [--steps 6] [--reps 2]

Prints the load average, the cluster's start-up time, and each repetition's wall time per engine.
The overhead per expert is the difference in wall time: with 2 experts at a time in both engines,
each expert waits that much longer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="count,max")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from opd.lab.pico import build_trained_pico
    from opd.lab.pipeline import run_lab

    root = Path(tempfile.mkdtemp(prefix="opd-ray-bench-"))
    os.environ["OPD_OUTPUT_ROOTS"] = str(root)
    os.chdir(root)
    experts = args.experts.split(",")
    base = build_trained_pico(root / "base", "count", steps=60)
    overrides = {"steps": args.steps, "max_minutes": 30, "eval_every": 2, "eval_limit": 20, "checkpoint_every": 2,
                 "threads": 1, "gspo.prompts_per_step": 4, "gspo.group_size": 4, "gspo.updates_per_batch": 1,
                 "gspo.lr": 0.003, "gspo.eps_low": 0.2, "gspo.eps_high": 0.28, "gspo.min_informative": 0.0}

    def recipe(tag: str, **train) -> str:
        doc = {"name": tag, "base": str(base), "experts": [str(root / tag / e) for e in experts],
               "strategies": {"linear": {"weight": 1.0}}, "out": str(root / tag / "merge"),
               "train": {"overrides": overrides, **train}}
        p = root / f"{tag}.yaml"
        p.write_text(yaml.safe_dump(doc))
        return str(p)

    t = time.time()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    c.wait_for_nodes()
    start = time.time() - t
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {len(experts)} pico experts x "
          f"{args.steps} GSPO steps, 2 at a time; Ray cluster up in {start:.1f} s", flush=True)
    times: dict[str, list[float]] = {"local": [], "ray": []}
    for rep in range(args.reps):
        for engine in (("local", "ray") if rep % 2 == 0 else ("ray", "local")):
            tag = f"{engine}{rep}"
            path = recipe(tag, jobs=2) if engine == "local" else recipe(tag, cluster={"engine": "ray",
                                                                                      "address": c.address})
            t = time.time()
            run_lab(path, ["experts"])
            times[engine].append(time.time() - t)
            print(f"rep {rep} {engine}: {times[engine][-1]:.1f} s", flush=True)
        hashes = {tag: [json.loads((root / f"{tag}{rep}" / e / "manifest.json").read_text())["content_hash"]
                        for e in experts] for tag in ("local", "ray")}
        assert hashes["local"] == hashes["ray"], hashes
    ray.shutdown()
    c.shutdown()
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    print(f"experts stage: local pool {mean['local']:.1f} s, Ray {mean['ray']:.1f} s (mean of {args.reps}); "
          f"overhead per expert {mean['ray'] - mean['local']:+.1f} s; experts bit-identical")


if __name__ == "__main__":
    main()
