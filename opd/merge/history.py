"""A run directory across expert versions: one study per set of input weights, earlier runs kept.

Rerunning a recipe after an expert was retrained (its content_hash changed) opens a new study,
named by the inputs' hashes, in the same storage. The run directory's outputs of the earlier
study (results.json, report, best/, opd/) move to `history/<study>/`; the new study starts from
the earlier run's best settings (`warm_params`), and its report opens with what changed
(`what_changed`). Scores of unchanged models come from the evaluation cache (content hash).

Layout: `<out>/current.json` = {"study": <this study>, "previous": <the one before, or null>}.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from opd.io import atomic_write_json
from opd.merge.recipe import Choices, LayerRange, MergeRecipe
from opd.merge.strategies import RUNS_DIR

# Outputs of one study; everything else in the run directory (study.db) is shared.
STUDY_OUTPUTS = ("results.json", "report.md", "report.html", "retention_heatmap.png", "pareto_front.png",
                 "strategy_best.png", "search_history.png", "opd_kl.png", "best", RUNS_DIR)


def inputs_key(base_hash: str, expert_hashes: dict[str, str]) -> str:
    """Short hash of the base's and the experts' content hashes (expert order does not matter)."""
    doc = json.dumps({"base": base_hash, "experts": dict(sorted(expert_hashes.items()))}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:12]


def study_name(recipe: MergeRecipe, base_hash: str, expert_hashes: dict[str, str]) -> str:
    return f"{recipe.name}-{inputs_key(base_hash, expert_hashes)}"


def switch_study(out: Path, study: str, legacy_study: str) -> str | None:
    """Make `study` the run directory's current one; returns the study before it (or None).

    When the current study changes, its outputs move to history/<old study>/ (a run killed half-way
    through moving finishes the move on its rerun). `legacy_study` names the study of a run
    directory written before current.json existed.
    """
    marker = out / "current.json"
    if marker.exists():
        cur = json.loads(marker.read_text())
    elif any((out / f).exists() for f in ("results.json", RUNS_DIR)):
        cur = {"study": legacy_study, "previous": None}
    else:
        cur = {"study": study, "previous": None}
    if cur["study"] == study:
        atomic_write_json(marker, cur)
        return cur["previous"]
    dest = out / "history" / cur["study"]
    dest.mkdir(parents=True, exist_ok=True)
    for name in STUDY_OUTPUTS:
        if (out / name).exists():
            if (dest / name).is_dir():  # a copy left by an interrupted switch
                shutil.rmtree(dest / name)
            elif (dest / name).exists():
                (dest / name).unlink()
            (out / name).rename(dest / name)
    atomic_write_json(marker, {"study": study, "previous": cur["study"]})
    return cur["study"]


def previous_results(out: Path, previous: str | None) -> dict | None:
    path = out / "history" / str(previous) / "results.json"
    return json.loads(path.read_text()) if previous and path.exists() else None


def _in_space(recipe: MergeRecipe, experts: list[str], key: str, value) -> bool:
    """Whether a parameter `<strategy>.<param>[.<expert>][@<layer group>]` with this value is searched
    by `recipe`."""
    key, _, group = key.partition("@")
    strategy, param, *expert = key.split(".")
    spec = recipe.strategies.get(strategy, {}).get(param)
    if expert and expert[0] not in experts:
        return False
    if isinstance(spec, LayerRange):  # a block group the recipe no longer has is ignored by Optuna
        return bool(group) and spec.range[0] <= value <= spec.range[1]
    if group:
        return False
    if isinstance(spec, tuple):
        return spec[0] <= value <= spec[1]
    return isinstance(spec, Choices) and value in spec.choices


def warm_params(prev: dict, recipe: MergeRecipe, experts: list[str], limit: int) -> list[tuple[int, dict]]:
    """The earlier run's final candidates (Pareto set best first, then each strategy's best) as
    Optuna params for `study.enqueue_trial`: [(earlier trial number, params)], at most `limit`.

    Strategies the recipe no longer has are left out; a value outside the current range is left
    for the sampler to draw.
    """
    by_number = {t["number"]: t for t in prev.get("trials", [])}
    out, seen = [], set()
    for final in prev.get("final", {}).values():
        t = by_number.get(final["trial"])
        strategy = final["candidate"]["strategy"]
        if t is None or "params" not in t or strategy not in recipe.strategies:
            continue
        # a capped study names the strategy choice 'strategy[a|b]'; a fresh one 'strategy'
        params = {k: v for k, v in t["params"].items() if not k.startswith("strategy")}
        params = {k: v for k, v in params.items() if _in_space(recipe, experts, k, v)}
        if len(recipe.strategies) > 1:
            params["strategy"] = strategy
        key = json.dumps(params, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append((t["number"], params))
    return out[:limit]


def what_changed(prev: dict, summary: dict) -> dict:
    """Which inputs changed since the earlier run and, per capability, its best vs this run's best
    (test split scores and retention of the model each run chose on val)."""
    old, new = prev["inputs"]["experts"], summary["inputs"]["experts"]
    experts = []
    for name in sorted(set(old) | set(new)):
        o, n = old.get(name), new.get(name)
        if o and n and o["content_hash"] == n["content_hash"]:
            continue
        experts.append({"name": name, "change": "changed" if o and n else "added" if n else "removed",
                        "old": {k: o.get(k) for k in ("content_hash", "version")} if o else None,
                        "new": {k: n.get(k) for k in ("content_hash", "version")} if n else None})

    def best_cells(s: dict) -> dict:
        return {c["capability"]: c for c in s["matrix"]["test"] if c["candidate"] == s["best"]}

    def expert_cells(s: dict) -> dict:  # the owning expert's own score, per capability
        from opd.merge.report import expert_rows  # lazy: cycle: opd.merge.report imports opd.merge.history

        rows = expert_rows(s)
        return {c["capability"]: c for c in s["matrix"]["test"] if rows.get(c["capability"]) == c["candidate"]}

    pb, nb, pe, ne = best_cells(prev), best_cells(summary), expert_cells(prev), expert_cells(summary)
    caps = []
    for cap in dict.fromkeys([*nb, *pb]):
        row = {"capability": cap}
        for side, cells, exp in (("previous", pb, pe), ("new", nb, ne)):
            c = cells.get(cap)
            row[side] = {"score": c["score"], "retention": c["retention"],
                         "expert_score": exp[cap]["score"] if cap in exp else None} if c else None
        caps.append(row)
    base_changed = prev["inputs"]["base"]["content_hash"] != summary["inputs"]["base"]["content_hash"]
    return {"previous_study": prev.get("study", prev["recipe"]["name"]), "previous_best": prev["best"],
            "new_best": summary["best"], "base_changed": base_changed, "experts": experts, "capabilities": caps}


def what_changed_md(wc: dict) -> str:
    """The report's opening section as markdown."""
    def ver(side):
        return f"`{side['content_hash']}` (v{side.get('version') or '?'})" if side else "—"

    def cell(side, key):
        return "—" if not side or side[key] is None else f"{side[key]:.3f}"

    lines = [f"Compared with the previous run (study `{wc['previous_study']}`, best **{wc['previous_best']}**); "
             f"this run's best: **{wc['new_best']}**."]
    if wc["base_changed"]:
        lines.append("The base model changed.")
    if wc["experts"]:
        lines += ["", "| expert | change | previous | new |", "|---|---|---|---|"]
        lines += [f"| {e['name']} | {e['change']} | {ver(e['old'])} | {ver(e['new'])} |" for e in wc["experts"]]
    else:
        lines.append("No expert changed.")
    lines += ["", "| capability (test) | expert score: previous → new | best score: previous → new "
              "| best retention: previous → new |", "|---|---|---|---|"]
    for r in wc["capabilities"]:
        p, n = r["previous"], r["new"]
        lines.append(f"| {r['capability']} | {cell(p, 'expert_score')} → {cell(n, 'expert_score')} | "
                     f"{cell(p, 'score')} → {cell(n, 'score')} | {cell(p, 'retention')} → {cell(n, 'retention')} |")
    return "\n".join(lines)
