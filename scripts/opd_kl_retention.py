"""Per capability, the student's reverse KL to its teachers against its val retention over an OPD run.

    python scripts/opd_kl_retention.py runs/distill/lab12_ablations/opd400_from_base [more runs ...] [--plot out.png]

Reads each run's `history.json` (kl/<teacher> every step, retention/<capability> at every val check)
and `manifest.json` (its routes: capability -> {teacher: weight}). Prints, per run, a table with each
capability's KL over the first `--window` steps and over the `--window` steps before each check, its
retention at each check, and two rank correlations: across capabilities (final KL against final
retention: is the capability the student is furthest from also the one it loses?) and within each
capability over the checks (does retention rise as its KL falls?). `--plot` draws KL against retention,
one trajectory per capability.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scipy.stats import spearmanr  # scipy comes with mergekit

from opd.distill.routing import capability_kl as routed_kl
from opd.errors import OpdError, cli_main


def _load(run: Path) -> tuple[list[dict], dict[str, dict[str, float]]]:
    hist, man = run / "history.json", run / "manifest.json"
    if not hist.is_file():
        raise OpdError(f"{hist}: no history.json; pass the output directory of a finished `python -m opd.distill` run")
    history = json.loads(hist.read_text())
    routes = json.loads(man.read_text()).get("routes", {}) if man.is_file() else {}
    return history, routes


def capability_kl(rec: dict, cap: str, routes: dict[str, dict[str, float]]) -> float | None:
    """The capability's teacher-weighted KL in one step's record (teacher = capability without routes)."""
    return routed_kl(rec, routes.get(cap) or {cap: 1.0})


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (nan where either side is constant or has < 3 points)."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return float("nan")
    return float(spearmanr(xs, ys).statistic)


def trajectories(history: list[dict], routes: dict, window: int) -> dict[str, list[tuple[int, float, float]]]:
    """capability -> [(step, KL over the `window` OPD steps up to the check, retention at the check)]."""
    steps = [r for r in history if r.get("step", 0) > 0 and any(k.startswith("kl/") for k in r)]
    caps = sorted({k.removeprefix("retention/") for r in history for k in r if k.startswith("retention/")})
    out: dict[str, list[tuple[int, float, float]]] = {c: [] for c in caps}
    for chk in (r for r in history if "min_retention" in r and r.get("step", 0) > 0):
        win = [r for r in steps if chk["step"] - window < r["step"] <= chk["step"]]
        for c in caps:
            kls = [v for v in (capability_kl(r, c, routes) for r in win) if v is not None]
            out[c].append((chk["step"], _mean(kls), chk.get(f"retention/{c}", float("nan"))))
    return out


def report(run: Path, window: int) -> tuple[str, dict]:
    history, routes = _load(run)
    traj = trajectories(history, routes, window)
    first = [r for r in history if r.get("step", 0) > 0 and any(k.startswith("kl/") for k in r)][:window]
    if not first or not any(traj.values()):
        raise OpdError(f"{run / 'history.json'}: no OPD steps with kl/<teacher> and no val checks; "
                       "run with eval_every > 0 and a teacher reference (retention needs both)")
    checks = [s for s, _, _ in next(iter(traj.values()))]
    lines = [f"### {run.name}", "",
             f"KL: the capability's mean reverse KL to its teachers over {window} OPD steps (the first {window}, "
             f"then the {window} up to each val check); retention at each check (steps {', '.join(map(str, checks))}).", "",
             "| capability | KL first | KL at last check | KL drop | retention at checks | best | last | "
             "rank corr. KL vs retention over checks |", "|---|---|---|---|---|---|---|---|"]
    finals = []
    for c, pts in sorted(traj.items(), key=lambda kv: kv[1][-1][2]):
        k0 = _mean([v for v in (capability_kl(r, c, routes) for r in first) if v is not None])
        kl_last, ret = pts[-1][1], [p[2] for p in pts]
        finals.append((kl_last, ret[-1]))
        rho = spearman([p[1] for p in pts], ret)
        lines.append(f"| {c} | {k0:.3f} | {kl_last:.3f} | {1 - kl_last / k0:.0%} | "
                     f"{' / '.join(f'{x:.2f}' for x in ret)} | {max(ret):.2f} | {ret[-1]:.2f} | {rho:+.2f} |")
    mins = [min(p[i][2] for p in traj.values()) for i in range(len(checks))]
    rho_across = spearman([f[0] for f in finals], [f[1] for f in finals])
    lines += ["", f"Min retention at the checks: {' / '.join(f'{m:.2f}' for m in mins)}. Across capabilities, "
              f"rank correlation of the last KL with the last retention: {rho_across:+.2f}.", ""]
    return "\n".join(lines), traj


def plot(trajs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(trajs), figsize=(6 * len(trajs), 4.5), squeeze=False)
    for ax, (name, traj) in zip(axes[0], trajs.items()):
        for c, pts in sorted(traj.items()):
            line, = ax.plot([p[1] for p in pts], [p[2] for p in pts], marker=".", label=c)
            ax.annotate(c, (pts[-1][1], pts[-1][2]), fontsize=7, color=line.get_color())
        ax.set_xscale("log")
        ax.set_xlabel("reverse KL to the teacher (mean over the steps before the check)")
        ax.set_ylabel("val retention")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


@cli_main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="output directories of finished opd.distill runs")
    ap.add_argument("--window", type=int, default=10, help="OPD steps averaged for each KL (default 10)")
    ap.add_argument("--plot", type=Path, help="write KL-against-retention trajectories to this PNG")
    a = ap.parse_args(argv)
    trajs = {}
    for run in a.runs:
        text, trajs[run.name] = report(run, a.window)
        print(text)
    if a.plot:
        plot(trajs, a.plot)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
