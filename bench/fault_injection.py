"""Kill expert training with SIGKILL at random (seeded) moments and check that every rerun resumes.

    python bench/fault_injection.py [--kills 20] [--seed 0] [--steps 8] [--base DIR]

One uninterrupted run is the reference. Then episodes: start `scripts/train_expert.py`, SIGKILL it
after a random delay, check the artifacts on disk, rerun the same command, until it finishes; new
episodes (fresh output) start until `--kills` kills happened in total. After every kill:
  - the output directory is absent or whole (its manifest.json parses and its weights load);
  - the checkpoint, when there is one, loads.
After every episode: the expert has the reference's number of steps, version 1 and a test score
within noise of the reference's. Without --base a pico Qwen3 is pre-trained on `count` for a few
seconds (as tests/conftest.py does). tests/test_fault_injection.py runs a short version in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def build_pico_base(out: Path) -> Path:
    """A hidden-32, 2-layer Qwen3 trained on `count` for 120 steps: a base that scores above 0."""
    import torch

    from opd.lab.pico import build_trained_pico

    torch.set_num_threads(1)
    return build_trained_pico(out)


def write_spec(path: Path, base: Path, steps: int) -> Path:
    body = {"capability": "count", "base": str(base), "steps": steps, "eval_every": 2, "eval_limit": 20,
            "checkpoint_every": 1, "threads": 1, "score_capabilities": ["count"],
            "gspo": {"prompts_per_step": 4, "group_size": 4, "updates_per_batch": 2, "lr": 1e-3,
                     "eps_low": 0.2, "eps_high": 0.28, "min_informative": 0.0}}
    path.write_text(yaml.safe_dump(body))
    return path


@dataclass
class Trainer:
    """One expert output and the command that (re)trains it."""

    spec: Path
    out: Path
    env: dict = field(default_factory=lambda: {**os.environ, "OMP_NUM_THREADS": "1"})

    @property
    def ckpt(self) -> Path:
        return self.out.parent / f".{self.out.name}.ckpt" / "state.pt"

    def start(self) -> subprocess.Popen:
        cmd = [sys.executable, str(ROOT / "scripts/train_expert.py"), str(self.spec), "--out", str(self.out)]
        return subprocess.Popen(cmd, cwd=self.out.parent, env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

    def run(self, kill_after: float | None = None) -> tuple[bool, float, str]:
        """(killed, seconds, stderr tail): SIGKILL after `kill_after` s unless it ends first."""
        t0 = time.time()
        proc = self.start()
        try:
            _, err = proc.communicate(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            return True, time.time() - t0, ""
        if proc.returncode != 0:
            raise RuntimeError(f"train_expert.py exited {proc.returncode}:\n{err[-3000:]}")
        return False, time.time() - t0, err[-3000:]

    def checkpoint_step(self) -> int | None:
        import torch

        return torch.load(self.ckpt, weights_only=False)["state"]["step"] if self.ckpt.exists() else None


def check_artifacts(t: Trainer) -> list[str]:
    """What is wrong on disk after a kill (empty: nothing); loading is the check, not file presence."""
    from transformers import AutoModelForCausalLM

    problems = []
    if t.out.exists():
        try:
            json.loads((t.out / "manifest.json").read_text())
            AutoModelForCausalLM.from_pretrained(t.out)
        except Exception as e:
            problems.append(f"{t.out} is not whole: {type(e).__name__}: {e}")
    try:
        t.checkpoint_step()
    except Exception as e:
        problems.append(f"{t.ckpt} does not load: {type(e).__name__}: {e}")
    return problems


def leftovers(t: Trainer) -> list[str]:
    """Temporary or backup directories beside the output (atomic_dir's, left by a kill mid-write)."""
    return sorted(p.name for p in t.out.parent.iterdir() if p.name.startswith(f".{t.out.name}.")
                  and not p.name.endswith(".ckpt"))


def summary(out: Path) -> dict:
    m = json.loads((out / "manifest.json").read_text())
    return {"steps": m["train"]["steps"], "version": m["version"], "test": m["metrics"]["test"]["count"]["score"],
            "n": m["metrics"]["test"]["count"]["n"], "hash": m["content_hash"],
            "rewards": [round(r.get("reward", float("nan")), 3) for r in m["train"]["history"]]}


def kill_episode(t: Trainer, rng: random.Random, window: tuple[float, float], max_kills: int,
                 log=print) -> dict:
    """Kill `t` up to `max_kills` times at delays drawn from `window`, then let it finish."""
    kills, problems, resumed_at, ckpt_steps = 0, [], [], []
    while True:
        delay = rng.uniform(*window) if kills < max_kills else None
        killed, seconds, err = t.run(kill_after=delay)
        if not killed:
            if "resuming" in err:
                resumed_at.append(int(err.split("resuming count at step ")[1].split()[0]))
            break
        kills += 1
        step = t.checkpoint_step()
        ckpt_steps.append(step)
        found = check_artifacts(t)
        problems += found
        log(f"  kill {kills} after {seconds:.1f} s: checkpoint step {step}, output "
            f"{'whole' if t.out.exists() and not found else 'absent' if not t.out.exists() else 'BROKEN'}"
            f"{', leftovers ' + str(leftovers(t)) if leftovers(t) else ''}")
    return {"kills": kills, "problems": problems + check_artifacts(t), "leftovers": leftovers(t),
            "resumed_at": resumed_at, "ckpt_steps": ckpt_steps, **summary(t.out)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs in total, over as many episodes as needed")
    ap.add_argument("--per-episode", type=int, default=5, help="most kills before a run is let finish")
    ap.add_argument("--steps", type=int, default=8, help="GSPO steps of each expert")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill delays")
    ap.add_argument("--base", default=None, help="base model directory (default: a pico base built here)")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="opd-faults-"))
    base = Path(args.base) if args.base else build_pico_base(work / "base")
    spec = write_spec(work / "count.yaml", base, args.steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPD_CACHE": str(work / "cache")}
    ref_t = Trainer(spec, work / "ref" / "count", env)
    ref_t.out.parent.mkdir()
    _, ref_s, _ = ref_t.run()
    ref = summary(ref_t.out)
    print(f"reference: {ref_s:.1f} s, {ref['steps']} steps, test score {ref['test']:.3f} (n={ref['n']}), "
          f"hash {ref['hash']}")
    rng = random.Random(args.seed)
    # From process start to well past the end of training: kills land in start-up, rollouts,
    # updates, validation, checkpointing, the final scoring and the write of the expert.
    window = (0.5, ref_s)
    episodes, total = [], 0
    while total < args.kills:
        t = Trainer(spec, work / f"ep{len(episodes)}" / "count", env)
        t.out.parent.mkdir()
        print(f"episode {len(episodes)}:")
        ep = kill_episode(t, rng, window, min(args.per_episode, args.kills - total))
        total += ep["kills"]
        episodes.append(ep)
        print(f"  done after {ep['kills']} kills: {ep['steps']} steps, version {ep['version']}, test "
              f"{ep['test']:.3f}, same weights as reference: {ep['hash'] == ref['hash']}"
              f"{'; PROBLEMS ' + str(ep['problems']) if ep['problems'] else ''}")
    bad = [e for e in episodes if e["problems"] or e["steps"] != ref["steps"] or e["version"] != 1]
    # A test score is a mean over n items: differences under ~2 standard errors are noise.
    se = (ref["test"] * (1 - ref["test"]) / ref["n"]) ** 0.5
    far = [e for e in episodes if abs(e["test"] - ref["test"]) > max(2 * se, 1e-9) * 2 ** 0.5]
    print(f"\n{total} kills in {len(episodes)} episodes; identical weights {sum(e['hash'] == ref['hash'] for e in episodes)}"
          f"/{len(episodes)}; wrong steps/version or broken artifacts: {len(bad)}; test scores outside noise: "
          f"{len(far)}; episodes with leftover temp dirs: {sum(bool(e['leftovers']) for e in episodes)}")
    return 1 if bad or far else 0


if __name__ == "__main__":
    sys.exit(main())
