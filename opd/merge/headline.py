"""The answer a report leads with: what the final model kept of every expert, and each strategy's best.

Two measures per capability c, on the test split:
  retention  = model_c / expert_c
  gain kept  = (model_c - base_c) / (expert_c - base_c), defined only where the expert beats the base
               by at least `min_z` standard errors of the difference, sqrt(se_expert^2 + se_base^2)
               (below that the expert's gain is noise and the ratio means nothing).
Both are reported per capability and as the minimum over the capabilities whose expert beats the
base: a consolidation is as good as what it keeps of its weakest expert, and an expert that learnt
nothing has nothing to keep (its retention is shown, and the minimum over all capabilities with it).

Whether a shortfall is a loss or the test split's noise: `vs_expert_z` = (model_c - expert_c) / stderr of
the difference, sqrt(se_model^2 + se_expert^2). The two scores come from the same test items, so their
errors are positively correlated and this unpaired stderr is an upper bound: a capability at z <= -min_z
lost skill for certain; one above it may still have lost a little (on a 125-item split, a retention of
0.8 can sit within 1 stderr).
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.merge.interference import MIN_GAIN_Z, gain_z
from opd.merge.noise import Split, copy_minima


@dataclass(frozen=True)
class CapabilityRow:
    capability: str
    base: float
    expert: float
    model: float
    retention: float
    gain_kept: float | None  # None where the expert does not beat the base by min_z stderr
    expert_gain_z: float
    vs_expert_z: float  # (model - expert) / unpaired stderr of the difference: <= -min_z is a certain loss
    n: int | None = None  # the split's items, where the matrix records them


def gain_kept(model: float, base: float, expert: float) -> float:
    """(model - base) / (expert - base); the caller checks that expert - base is significant."""
    return (model - base) / (expert - base)


def capability_rows(cells: list[dict], candidate: str, expert_of: dict[str, str], min_z: float = MIN_GAIN_Z
                    ) -> list[CapabilityRow]:
    """Rows for `candidate` from interference-matrix records (one split). `expert_of[cap]` names the
    matrix row of that capability's expert ("expert <name>")."""
    at = {(c["candidate"], c["capability"]): c for c in cells}
    rows = []
    for cap, expert_row in expert_of.items():
        m, e, b = at.get((candidate, cap)), at.get((expert_row, cap)), at.get(("base", cap))
        if m is None or e is None or b is None:
            continue
        z = gain_z(e["score"], e["stderr"], b["score"], b["stderr"])
        rows.append(CapabilityRow(cap, b["score"], e["score"], m["score"], m["retention"],
                                  gain_kept(m["score"], b["score"], e["score"]) if z >= min_z else None, z,
                                  gain_z(m["score"], m["stderr"], e["score"], e["stderr"]), b.get("n")))
    return rows


def minima(rows: list[CapabilityRow], min_z: float = MIN_GAIN_Z) -> dict:
    """Over the capabilities whose expert beats the base (gain kept defined; all rows when none does):
    min and mean retention, the weakest capability and its `weakest_z` (vs_expert_z), min gain kept, and
    `losses`: the counted capabilities the model trails its expert on by >= `min_z` stderr (most certain
    first). Also the min retention over all rows (`min_retention_all`), which an expert that learnt
    nothing drags to noise."""
    if not rows:
        return {}
    counted = [r for r in rows if r.gain_kept is not None] or rows
    weakest = min(counted, key=lambda r: r.retention)
    weakest_all = min(rows, key=lambda r: r.retention)
    gains = [r for r in rows if r.gain_kept is not None]
    worst_gain = min(gains, key=lambda r: r.gain_kept) if gains else None
    losses = sorted((r for r in counted if r.vs_expert_z <= -min_z), key=lambda r: r.vs_expert_z)
    return {"min_retention": weakest.retention, "mean_retention": sum(r.retention for r in counted) / len(counted),
            "weakest": weakest.capability, "weakest_z": weakest.vs_expert_z,
            "losses": [(r.capability, r.vs_expert_z) for r in losses], "min_gain_kept": worst_gain.gain_kept if worst_gain else None,
            "weakest_gain": worst_gain.capability if worst_gain else None,
            "gain_capabilities": len(gains), "capabilities": len(rows),
            "min_retention_all": weakest_all.retention, "weakest_all": weakest_all.capability}


def strategy_rows(cells: list[dict], final: dict[str, dict], expert_of: dict[str, str], min_z: float = MIN_GAIN_Z
                  ) -> list[dict]:
    """The best re-scored candidate of every strategy (by min test retention), with its minima."""
    best: dict[str, dict] = {}
    for label, v in final.items():
        strategy = v["candidate"]["strategy"]
        stats = minima(capability_rows(cells, label, expert_of, min_z), min_z)
        if stats and (strategy not in best or stats["min_retention"] > best[strategy]["min_retention"]):
            best[strategy] = {"strategy": strategy, "candidate": label, **stats}
    return sorted(best.values(), key=lambda r: -r["min_retention"])


def missing_strategies(strategies: list[str], rescored: list[dict], trials: list[dict]) -> list[dict]:
    """The recipe's strategies with no candidate re-scored on test, each with the reason: none of its
    trials finished, or its best only reached the cheap val screen (with that screen's min retention)."""
    done = {r["strategy"] for r in rescored}
    out = []
    for name in strategies:
        if name in done:
            continue
        mine = [t for t in trials if t.get("candidate", {}).get("strategy") == name]
        if not mine:
            out.append({"strategy": name, "reason": "no trial finished (budget or per-strategy cap)"})
            continue
        full = [t for t in mine if t.get("stage") == "full"]
        best = max(mine, key=lambda t: t.get("min_retention", float("-inf")))
        reason = (f"scored on full val (best min retention {best['min_retention']:.2f}) but not in the final set"
                  if full else f"screened out: best min retention {best['min_retention']:.2f} on the val "
                  f"screen ({len(mine)} trial{'s' if len(mine) > 1 else ''}), below the promotion margin")
        out.append({"strategy": name, "reason": reason})
    return out


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _losses_md(s: dict) -> str:
    """One sentence: which counted capabilities the model certainly lost, and whether the weakest is one."""
    if not s:
        return ""
    lost = ", ".join(f"{c} ({z:+.1f})" for c, z in s["losses"])
    head = (f"**Lost for certain** (the model trails the expert by >= {MIN_GAIN_Z:g} stderr of the difference, "
            f"z in brackets): {lost}." if lost else
            f"**No capability is lost for certain**: none trails its expert by >= {MIN_GAIN_Z:g} stderr of the difference.")
    return (head + f" The weakest, {s['weakest']}, is at z {s['weakest_z']:+.1f}. The stderr is unpaired, an upper "
            "bound (the same test items score both), so a smaller shortfall may still be a loss; more test items "
            "settle it.")


def _copy_md(rows: list[CapabilityRow]) -> str:
    """One sentence: where a perfect copy of the experts lands on these splits (opd.merge.noise), when
    every counted capability's split size is known."""
    counted = [r for r in rows if r.gain_kept is not None]
    if not counted or any(r.n is None or r.expert <= 0 for r in counted):
        return ""
    c = copy_minima([Split(r.capability, r.n, r.base, r.expert) for r in counted])
    return (f"A student with exactly its experts' accuracy would score, on these test splits, a min retention of "
            f"{c['retention_median']:.2f} ({c['retention_lo']:.2f}-{c['retention_hi']:.2f}, 90% of draws) and a "
            f"min gain kept of {c['gain_kept_median']:.2f} ({c['gain_kept_lo']:.2f}-{c['gain_kept_hi']:.2f}): "
            "the split's noise alone, with items drawn independently (opd.merge.noise).")


def headline_md(candidate: str, rows: list[CapabilityRow], strategies: list[dict], stages: dict[str, float],
                model_path: str | None = None, missing: list[dict] | None = None) -> str:
    """The report's first section, as Markdown."""
    s = minima(rows)
    lines = [f"**Final model** `{candidate}`" + (f" (`{model_path}`)" if model_path else "") + ": on test, "
             f"**min retention {_f(s.get('min_retention'))}** ({s.get('weakest')}), mean {_f(s.get('mean_retention'))}; "
             f"**min gain kept {_f(s.get('min_gain_kept'))}** ({s.get('weakest_gain')}); both over the "
             f"{s.get('gain_capabilities', 0)} of {s.get('capabilities', 0)} capabilities whose expert beats the base "
             f"by >= {MIN_GAIN_Z:g} stderr" + ("." if s.get("gain_capabilities") == s.get("capabilities") else
             f"; over all {s.get('capabilities')}: min retention {_f(s.get('min_retention_all'))} "
             f"({s.get('weakest_all')})."), "", _losses_md(s), "", *([copy, ""] if (copy := _copy_md(rows)) else []),
             "| capability | base | expert | final model | retention | gain kept | expert gain (z) | vs expert (z) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.capability} | {r.base:.3f} | {r.expert:.3f} | {r.model:.3f} | {r.retention:.2f} | "
                     f"{_f(r.gain_kept)} | {r.expert_gain_z:.1f} | {r.vs_expert_z:+.1f} |")
    lines += [f"| **minimum** (expert beats base) | | | | **{_f(s.get('min_retention'))}** | "
              f"**{_f(s.get('min_gain_kept'))}** | | |", "",
              "Best candidate of every strategy (test):", "",
              "| strategy | candidate | min retention | mean retention | min gain kept | weakest capability "
              f"| lost for certain (>= {MIN_GAIN_Z:g} stderr) |",
              "|---|---|---|---|---|---|---|"]
    for st in strategies:
        lost = len(st.get("losses", []))
        lines.append(f"| {st['strategy']} | {st['candidate']} | {st['min_retention']:.2f} | {st['mean_retention']:.2f} "
                     f"| {_f(st['min_gain_kept'])} | {st['weakest']} | {lost} of {st['gain_capabilities'] or st['capabilities']} |")
    for m in missing or []:
        lines.append(f"| {m['strategy']} | — | — | — | — | not re-scored on test: {m['reason']} | |")
    if stages:
        lines += ["", "Minutes per stage: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
                  + f" (total {sum(stages.values()):.1f})."]
    return "\n".join(lines)
