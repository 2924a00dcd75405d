"""Merge reports: plots, report.md, a self-contained report.html, the best model's card, the live board's rows."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from pathlib import Path

import yaml
from rich.table import Table

from opd.errors import OpdError
from opd.io import atomic_dir, atomic_write_json, atomic_write_text, state_dict_hash
from opd.merge import trials
from opd.merge.headline import capability_rows, headline_md, missing_strategies, strategy_rows
from opd.merge.history import what_changed_md
from opd.merge.interference import Cell, as_table
from opd.merge.recipe import MergeRecipe
from opd.merge.strategies import BuildContext, get_strategy
from opd.model_inputs import write_model_card
from opd.weights.lazy import load_into


def best_table(study, top: int = 5):
    """The live board's table (opd.display.LiveBoard): the `top` candidates so far, fully scored
    first, by min retention."""
    table = Table(title="best candidates (min retention)")
    for col in ("trial", "strategy", "stage", "min retention", "retention per capability"):
        table.add_column(col)
    done = [(t, trials.read(t)) for t in study.get_trials(deepcopy=False) if t.values is not None]
    done.sort(key=lambda tr: (tr[1].stage == "full", tr[1].min_retention or 0), reverse=True)
    for t, rec in done[:top]:
        table.add_row(str(t.number), rec.candidate.strategy, rec.stage or "",
                      f"{rec.min_retention if rec.min_retention is not None else float('nan'):.3f}",
                      " ".join(f"{c}={v:.2f}" for c, v in (rec.retention or {}).items()))
    return table


def trial_line(trial, done: int, n_trials: int | None) -> str:
    """One finished trial as a plain progress line: its count, strategy, stage, min retention and minutes."""
    rec = trials.read(trial)
    strategy = rec.candidate.strategy if rec.candidate is not None else "?"
    state = trial.state.name.lower()
    if rec.min_retention is not None and state == "complete":
        state = f"min retention {rec.min_retention:.3f} on the {rec.stage or 'full'} val"
    minutes = ""
    if trial.datetime_start is not None and trial.datetime_complete is not None:
        minutes = f", {(trial.datetime_complete - trial.datetime_start).total_seconds() / 60:.1f} min"
    return f"trial {done}/{n_trials if n_trials is not None else '?'} (#{trial.number} {strategy}): {state}{minutes}"


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt  # lazy: matplotlib, as in plot_all (a caller has loaded it)

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def plot_all(summary: dict, matrix: dict) -> dict[str, bytes]:
    """PNG bytes per plot: retention heatmap, Pareto front, per-strategy best, search history."""
    # lazy: matplotlib (~0.3 s) only for plots; `opd merge` imports this module before it checks a recipe
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib, as above

    plots = {}
    cands, caps, vals = as_table(matrix["test"], "retention")
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(caps), 0.8 + 0.4 * len(cands)))
    im = ax.imshow(vals, cmap="RdYlGn", vmin=0, vmax=max(1.0, max(max(r) for r in vals)), aspect="auto")
    ax.set_xticks(range(len(caps)), caps)
    ax.set_yticks(range(len(cands)), cands)
    for i, row in enumerate(vals):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="retention (test)")
    ax.set_title("retention vs each capability's expert (test)")
    plots["retention_heatmap"] = _png(fig)

    trials = summary["trials"]
    full = [t for t in trials if t["stage"] == "full"]
    final = {v["trial"] for v in summary["final"].values()}
    fig, ax = plt.subplots(figsize=(5, 4))
    mean = [lambda t: sum(t["retention"].values()) / len(t["retention"])][0]
    ax.scatter([mean(t) for t in trials], [t["min_retention"] for t in trials], c="lightgray", label="screened")
    ax.scatter([mean(t) for t in full], [t["min_retention"] for t in full], c="tab:blue", label="full val")
    ax.scatter([mean(t) for t in full if t["number"] in final], [t["min_retention"] for t in full if t["number"] in final],
               c="tab:red", label="final set")
    ax.set_xlabel("mean retention (val)")
    ax.set_ylabel("min retention (val)")
    ax.legend()
    ax.set_title("candidates: Pareto set in red")
    plots["pareto_front"] = _png(fig)

    best: dict[str, float] = {}
    for t in full:
        s = t["candidate"]["strategy"]
        best[s] = max(best.get(s, -math.inf), t["min_retention"])
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(list(best), list(best.values()), color="tab:green")
    ax.set_ylabel("best min retention (val)")
    ax.set_title("best candidate per strategy")
    ax.tick_params(axis="x", rotation=30)
    plots["strategy_best"] = _png(fig)

    fig, ax = plt.subplots(figsize=(5, 3))
    xs = [t["number"] for t in trials]
    ys = [t["min_retention"] for t in trials]
    run, cur = [], -math.inf
    for t in trials:
        if t["stage"] == "full":
            cur = max(cur, t["min_retention"])
        run.append(cur if cur > -math.inf else float("nan"))
    ax.scatter(xs, ys, c=["tab:blue" if t["stage"] == "full" else "lightgray" for t in trials], s=12)
    ax.plot(xs, run, c="tab:red", label="best full-val so far")
    ax.set_xlabel("trial")
    ax.set_ylabel("min retention")
    ax.legend()
    ax.set_title("search history")
    plots["search_history"] = _png(fig)

    opd = opd_trials(summary)
    if opd:
        fig, ax = plt.subplots(figsize=(6, 4))
        for t in opd[:4]:  # the best few runs: more lines would hide each other
            hist = t["opd_history"]
            for key in sorted({k for rec in hist for k in rec if k.startswith("kl/")}):
                pts = [(rec["step"], rec[key]) for rec in hist if key in rec]
                ax.plot(*zip(*pts), label=f"#{t['number']} {t['candidate']['strategy']} {key[3:]}")
        ax.set_xlabel("OPD step")
        ax.set_ylabel("KL(student || teacher) per token")
        ax.legend(fontsize=7)
        ax.set_title("per-teacher KL during distillation")
        plots["opd_kl"] = _png(fig)
        plots["retention_vs_tokens"] = _retention_vs_tokens(plt, summary, opd)
    return plots


WEIGHTSPACE_TITLES = {"cosine": "task-vector cosine", "sign_conflict": "sign-conflict rate",
                      "norm_ratio": "norm ratio ||τ_row|| / ||τ_col||"}
WEIGHTSPACE_HOWTO = ("Each panel compares the experts' task vectors (expert − base) in one layer group: cosine near 0 "
                     "means two experts changed unrelated directions, which merges keep; a negative cosine or a "
                     "sign-conflict rate above 0.5 means they pulled the same weights opposite ways, and a norm ratio "
                     "far from 1 means the row's expert moved that group much more than the column's and will "
                     "dominate it in a merge, so look here for the pair and layers behind a capability the "
                     "interference matrix shows as lost.")


def weightspace_plots(ws: dict) -> dict[str, bytes]:
    """One PNG per metric of `summary["weightspace"]`: an expert x expert heatmap per layer group."""
    # lazy: matplotlib (~0.3 s) only for plots; `opd merge` imports this module before it checks a recipe
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib, as above

    names, groups = ws["experts"], ws["groups"]
    n = len(names)
    plots = {}
    for metric, title in WEIGHTSPACE_TITLES.items():
        fig, axes = plt.subplots(1, len(groups), figsize=(0.6 + (1.0 + 0.35 * n) * len(groups), 1.0 + 0.35 * n),
                                 squeeze=False)
        for ax, g in zip(axes[0], groups, strict=True):
            vals = [[math.nan if v is None else v for v in row] for row in ws[metric][g]]
            # The norm ratio is reciprocal (r_ji = 1/r_ij): coloured on a log2 scale so 2x and 0.5x look alike.
            shown = [[math.log2(v) if v > 0 else math.nan for v in row] for row in vals] \
                if metric == "norm_ratio" else vals
            lim = {"cosine": (-1, 1), "sign_conflict": (0, 1)}.get(metric, (-2, 2))
            cmap = "Reds" if metric == "sign_conflict" else "coolwarm"
            im = ax.imshow(shown, cmap=cmap, vmin=lim[0], vmax=lim[1])
            ax.set_xticks(range(n), names, rotation=90, fontsize=7)
            ax.set_yticks(range(n), names if ax is axes[0][0] else [""] * n, fontsize=7)
            ax.set_title(g, fontsize=9)
            if n <= 6:  # more numbers than that hide each other
                for i, row in enumerate(vals):
                    for j, v in enumerate(row):
                        ax.text(j, i, "" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=6)
        fig.colorbar(im, ax=list(axes[0]), label="log2 norm ratio" if metric == "norm_ratio" else title, shrink=0.8)
        fig.suptitle(title)
        plots[f"weightspace_{metric}"] = _png(fig)
    return plots


def _retention_vs_tokens(plt, summary: dict, opd: list[dict]) -> bytes:
    """Min val retention at each retention check against the tokens the student trained on (its own
    samples, plus the teacher samples of an off-policy warm start), one line per distillation trial;
    the best weight-space candidate of each strategy as a point at 0 tokens."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in opd:
        pts = [(r.get("gen_tokens", 0) + r.get("warm_tokens", 0), r["min_retention"]) for r in t["opd_history"]
               if "min_retention" in r and "step" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"#{t['number']} {t['candidate']['strategy']}")
    merges: dict[str, float] = {}
    for t in summary["trials"]:
        if not t.get("opd_history") and t.get("stage") == "full":
            s = t["candidate"]["strategy"]
            merges[s] = max(merges.get(s, -1.0), t["min_retention"])
    for s, v in merges.items():
        ax.scatter([0], [v], s=14)
        ax.annotate(s, (0, v), fontsize=6, xytext=(3, 0), textcoords="offset points")
    ax.set_xlabel("tokens trained on (student samples + off-policy teacher samples)")
    ax.set_ylabel("min retention (val checks)")
    ax.legend(fontsize=7)
    ax.set_title("retention against training tokens")
    return _png(fig)


def opd_trials(summary: dict) -> list[dict]:
    """Finished trials that trained a student, best min retention first."""
    out = [t for t in summary["trials"] if t.get("opd_history")]
    return sorted(out, key=lambda t: t["min_retention"], reverse=True)


def _opd_md(summary: dict) -> str:
    """One row per OPD run: settings, final per-teacher KL, student tokens sampled, retention."""
    rows = ["| trial | strategy | init | steps | student tokens | final KL per teacher | min retention (val) |",
            "|---|---|---|---|---|---|---|"]
    for t in opd_trials(summary):
        last = t["opd_history"][-1]
        kls = " ".join(f"{k[3:]}={v:.3f}" for k, v in sorted(last.items()) if k.startswith("kl/"))
        init = (t.get("opd_init") or {}).get("strategy", "base")
        rows.append(f"| #{t['number']} | {t['candidate']['strategy']} | {init} | {last['step']} | "
                    f"{last.get('gen_tokens', 0)} | {kls} | {t['min_retention']:.3f} ({t['stage']}) |")
    return "\n".join(rows)


def _md_table(cells, split: str) -> str:
    cands, caps, _ = as_table(cells)
    lookup = {(c.candidate, c.capability): c for c in cells}
    lines = [f"| candidate ({split}) | " + " | ".join(caps) + " |", "|---" * (len(caps) + 1) + "|"]
    for a in cands:
        row = [f"{lookup[a, b].score:.3f} ±{lookup[a, b].stderr:.3f} (ret {lookup[a, b].retention:.2f}, "
               f"Δbase {lookup[a, b].delta_vs_base:+.3f})" for b in caps]
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _html_table(cells, split: str) -> str:
    cands, caps, _ = as_table(cells)
    lookup = {(c.candidate, c.capability): c for c in cells}
    head = "".join(f"<th>{html.escape(c)}</th>" for c in caps)
    rows = []
    for a in cands:
        tds = []
        for b in caps:
            c = lookup[a, b]
            shade = max(0.0, min(1.0, c.retention))
            tds.append(f'<td style="background: hsl({int(120 * shade)}, 60%, 85%)">{c.score:.3f} ±{c.stderr:.3f}'
                       f"<br><small>ret {c.retention:.2f} · Δbase {c.delta_vs_base:+.3f}</small></td>")
        rows.append(f"<tr><th>{html.escape(a)}</th>{''.join(tds)}</tr>")
    return (f'<table class="matrix"><caption>interference matrix, {split} split</caption>'
            f"<tr><th>candidate</th>{head}</tr>{''.join(rows)}</table>")


def _inline_md(text: str) -> str:
    """Escape, then render the two inline Markdown marks the intro uses (**bold**, `code`)."""
    out = html.escape(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


def write_report(recipe, summary: dict, matrix: dict) -> Path:
    """Write report.md, report.html (plots inlined as base64) and the PNGs into the run directory."""
    out = Path(recipe.out_dir)
    plots = plot_all(summary, matrix)
    for name, png in plots.items():
        (out / f"{name}.png").write_bytes(png)
    final_lines = [f"- **{label}**: `{v['label']}`" for label, v in summary["final"].items()]
    n_full = sum(t["stage"] == "full" for t in summary["trials"])
    intro = (f"Recipe `{recipe.name}`: {len(summary['trials'])} finished trials ({n_full} scored on the full val "
             f"split), objectives {', '.join(summary['objectives'])}. Best (chosen on val): **{summary['best']}**. "
             "Retention = candidate score / the capability's expert score on the same split.")
    if summary.get("split_rules"):
        intro += " Splits: " + "; ".join(f"`{c}`: {r}" for c, r in summary["split_rules"].items()) + "."
    if recipe.verifier == "none":
        intro += (" No verifier (`verifier: none`): no strategy called a capability's reward (warm starts on the "
                  "teachers' unfiltered samples, no reward term); the val and test scores are lm-eval's.")
    ws = summary.get("weightspace") if len(summary["inputs"]["experts"]) >= 2 else None
    ws_plots = weightspace_plots(ws) if ws else {}
    for name, png in ws_plots.items():
        (out / f"{name}.png").write_bytes(png)
    changed = summary.get("what_changed")
    changed_md = what_changed_md(changed) if changed else ""
    head_md = headline(summary)
    md = "\n\n".join([
        f"# Merge report: {recipe.name}", "## Headline", head_md, *(["## What changed", changed_md] if changed else []), intro, "## Final candidates", "\n".join(final_lines),
        "## Interference matrix (test)", _md_table(matrix["test"], "test"),
        "## Interference matrix (val)", _md_table(matrix["val"], "val"),
        *(["## Weight-space interference", WEIGHTSPACE_HOWTO, "\n".join(f"![{n}]({n}.png)" for n in ws_plots)]
          if ws_plots else []),
        *(["## On-policy distillation runs", _opd_md(summary)] if opd_trials(summary) else []),
        "## Plots", "\n".join(f"![{n}]({n}.png)" for n in plots),
        "## Inputs", "```json\n" + _json(summary["inputs"]) + "\n```",
    ]) + "\n"
    atomic_write_text(out / "report.md", md)
    imgs = _html_figures(plots)
    ws_html = (f"<h2>Weight-space interference</h2><p>{html.escape(WEIGHTSPACE_HOWTO)}</p>{_html_figures(ws_plots)}"
               if ws_plots else "")
    finals = "".join(f"<li><b>{html.escape(label)}</b>: <code>{html.escape(v['label'])}</code></li>"
                     for label, v in summary["final"].items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>merge report: {html.escape(recipe.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #999;padding:4px 8px;text-align:center}} figure{{display:inline-block;margin:1em}}</style>
</head><body><h1>Merge report: {html.escape(recipe.name)}</h1>{_md_html("Headline", head_md)}
{_md_html("What changed", changed_md)}
<p>{_inline_md(intro)}</p>
<h2>Final candidates</h2><ul>{finals}</ul>
<h2>Interference</h2>{_html_table(matrix["test"], "test")}{_html_table(matrix["val"], "val")}{ws_html}{_opd_html(summary)}
<h2>Plots</h2>{imgs}<h2>Inputs</h2><pre>{html.escape(_json(summary["inputs"]))}</pre></body></html>
"""
    atomic_write_text(out / "report.html", page)
    return out / "report.html"


def _html_figures(plots: dict[str, bytes]) -> str:
    return "".join(f'<figure><img alt="{n}" src="data:image/png;base64,{base64.b64encode(p).decode()}">'
                   f"<figcaption>{n.replace('_', ' ')}</figcaption></figure>" for n, p in plots.items())


def expert_rows(summary: dict) -> dict[str, str]:
    """capability -> the matrix row of its expert ("expert <name>"): the search's owner of each task
    (the best on val of the experts listing it), else each expert's tasks (results written before)."""
    rows = {t: f"expert {n}" for n, e in reversed(summary["inputs"]["experts"].items())
            for t in e.get("tasks") or [e["capability"]]}
    return {**rows, **{c: f"expert {n}" for c, n in summary.get("owners", {}).items()}}


def headline(summary: dict) -> str:
    """The report's headline section (Markdown) from a results summary."""
    cells, experts = summary["matrix"]["test"], expert_rows(summary)
    rows = capability_rows(cells, summary["best"], experts)
    best = strategy_rows(cells, summary["final"], experts)
    missing = missing_strategies(list(summary.get("recipe", {}).get("strategies", {})), best, summary.get("trials", []))
    return headline_md(summary["best"], rows, best, summary.get("stages", {}), summary.get("best_model"), missing)


def _opd_html(summary: dict) -> str:
    return _md_html("On-policy distillation runs", _opd_md(summary)) if opd_trials(summary) else ""


def _md_html(title: str, md: str) -> str:
    """A section of markdown paragraphs and pipe tables (as the report's md writers make) in HTML."""
    if not md:
        return ""
    parts = [f"<h2>{html.escape(title)}</h2>"]
    for block in md.split("\n\n"):
        lines = [ln for ln in block.splitlines() if not ln.startswith("|---")]
        if not lines[0].startswith("|"):
            parts.append(f"<p>{html.escape(' '.join(lines)).replace('**', '')}</p>")
            continue
        cells = [[html.escape(c.strip()) for c in ln.strip("|").split("|")] for ln in lines]
        head = "".join(f"<th>{c}</th>" for c in cells[0])
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in cells[1:])
        parts.append(f"<table><tr>{head}</tr>{body}</table>")
    return "".join(parts)


def _json(obj) -> str:
    return json.dumps(obj, indent=2, default=str)


def save_best_model(recipe, inputs, cand, sd: dict, summary: dict) -> Path:
    """The best candidate as an HF model dir with a model card, the recipe that made it (its strategy
    says which: a mergekit YAML, a distillation's settings) and provenance."""
    model = inputs.base_model
    load_into(model, sd)  # tensor by tensor: sd may be a candidate spilled to disk (opd.weights.lazy)
    final = recipe.out_dir / "best"
    paths = {e: str(Path(p).resolve()) for e, p in inputs.expert_paths.items()}
    label = summary["best"]
    trial = summary["final"][label]["trial"]
    init = next((trials.from_results(t).opd_init for t in summary["trials"] if t["number"] == trial), None)
    ctx = BuildContext(recipe.distill, recipe.out_dir, recipe.name, init, trial)
    card = get_strategy(cand.strategy).card(cand, str(Path(inputs.base_path).resolve()), paths, ctx)
    doc, recipe_file, how, reproduce = card.recipe, card.recipe_file, card.how, card.reproduce
    rows = [c for c in summary["matrix"]["test"] if c["candidate"] == label]
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp)
        inputs.tokenizer.save_pretrained(tmp)
        (tmp / recipe_file).write_text(yaml.safe_dump(doc, sort_keys=False))
        atomic_write_json(tmp / "manifest.json", {
            "kind": card.kind, "name": recipe.name, "candidate": cand.model_dump(mode="json"),
            "content_hash": state_dict_hash(model), "inputs": summary["inputs"], "recipe": summary["recipe"],
            "metrics": {"test": {c["capability"]: {k: c[k] for k in ("score", "stderr", "n", "retention")}
                                 for c in rows}},
        })
        scores = "\n".join(f"| {c['capability']} | {c['score']:.3f} ± {c['stderr']:.3f} | {c['retention']:.2f} | "
                           f"{c['delta_vs_base']:+.3f} |" for c in rows)
        write_model_card(tmp, f"""# {recipe.name}: {card.kind} model

Merged by opd from the base {_input_md(summary['inputs']['base'])}
and the experts {', '.join(f"`{e}` ({_input_md(i)})" for e, i in summary['inputs']['experts'].items())}, {how}.
Chosen on the validation split by recipe `{recipe.name}`; the scores below are on the test split.

Candidate: `{cand.label()}` (seed {cand.seed}).

| capability | score (test) | retention vs expert | Δ vs base |
|---|---|---|---|
{scores}

{reproduce}

```yaml
{yaml.safe_dump(doc, sort_keys=False)}```

Recipe:

```yaml
{yaml.safe_dump(summary['recipe'], sort_keys=False)}```
""", summary["inputs"], ["merge", "mergekit", "opd", *card.tags])
    load_into(model, inputs.base_sd)  # tensor by tensor: base_sd may be lazy (opd.weights.lazy)
    return final


def _input_md(i: dict) -> str:
    """An input model in the card's body: its Hub id when it came from the Hub, its local path, its hash."""
    hub = f"[{i['hub_id']}](https://huggingface.co/{i['hub_id']}), " if i.get("hub_id") else ""
    return f"{hub}`{i['path']}` (content hash `{i['content_hash']}`)"


def rewrite_report(run_dir: str | Path, log=print) -> Path:
    """Render a finished run's report again from its results.json (after an opd upgrade, or to print
    its headline); scores nothing and trains nothing. Returns report.html's path."""
    run_dir = Path(run_dir)
    path = run_dir / "results.json"
    if not path.is_file():
        raise OpdError(f"{path}: no such file; give a merge run's directory (runs/merge/<name>) whose search "
                       "has finished (python -m opd.merge --recipe R.yaml writes it)")
    try:
        summary = json.loads(path.read_text())
        recipe = MergeRecipe.model_validate({**summary["recipe"], "out": str(run_dir)})
        matrix = {split: [Cell(**c) for c in cells] for split, cells in summary["matrix"].items()}
    except (ValueError, KeyError, TypeError) as e:
        raise OpdError(f"{path}: not a merge run's results ({type(e).__name__}: {str(e).splitlines()[0]}); "
                       "rerun the search to write it again") from None
    write_report(recipe, summary, matrix)
    log(headline(summary))
    return run_dir / "report.html"
