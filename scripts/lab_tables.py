"""Print the lab's measured tables as Markdown (what docs/results/ shows), from the manifests on disk.

    python scripts/lab_tables.py [--base runs/base] [--experts add,count,...]

Reads runs/base/manifest.json + lm-eval scores (cached), <experts-dir>/<name>/manifest.json and
runs/controls/<name>.json (scripts/sft_control.py). Nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from opd.errors import cli_main


@cli_main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--experts", default=None, help="comma-separated (default: every trained expert)")
    ap.add_argument("--experts-dir", default=None, help="where the experts are (default experts/; e.g. "
                    "experts/lab10 for the ten-expert lab's)")
    ap.add_argument("--merge", nargs="*", default=[], help="merge run dirs (runs/merge/<name>) to summarise")
    ap.add_argument("--distill", nargs="*", default=[], help="distillation outputs (runs/distill/<name>) to score")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.evaluation.api import evaluate
    from opd.manifest import EXPERTS_DIR

    base_mf = json.loads((Path(args.base) / "manifest.json").read_text())
    caps = base_mf.get("capabilities") or base_mf["spec"]["capabilities"]
    model = AutoModelForCausalLM.from_pretrained(args.base)
    tok = AutoTokenizer.from_pretrained(args.base)
    base = evaluate(model, tok, caps, "test", model_hash=base_mf["content_hash"])
    experts_dir = Path(args.experts_dir) if args.experts_dir else EXPERTS_DIR
    names = args.experts.split(",") if args.experts else sorted(
        p.parent.name for p in experts_dir.glob("*/manifest.json"))
    experts = {n: json.loads((experts_dir / n / "manifest.json").read_text()) for n in names}

    print(f"### Base (`{args.base}`, kept step {base_mf['kept_step']}, "
          f"{base_mf['train_seconds'] / 60:.1f} min of pre-training), lm-eval test split\n")
    print("| capability | score | stderr | n |\n|---|---|---|---|")
    for c in caps:
        s = base[c]
        print(f"| {c} | {s.score:.3f} | {s.stderr:.3f} | {s.n} |")
    for d in args.merge:
        merge_table(Path(d))
    for d in args.distill:
        distill_table(Path(d), model, tok, base_mf["content_hash"])
    if not experts:
        return
    print("\n### Experts vs base vs SFT control (own capability, test split)\n")
    print("| expert | base | GSPO expert | delta | minutes | SFT control (same minutes) "
          "| other capabilities, mean: base / GSPO / SFT |\n|---|---|---|---|---|---|---|")
    for n, m in experts.items():
        c = m["capability"]
        e = m["metrics"]["test"][c]["score"]
        def mean_others(scores, c=c):
            return sum(scores[o] for o in caps if o != c) / (len(caps) - 1)

        ctrl_p = Path("runs/controls") / f"{n}.json"
        ctrl_scores = json.loads(ctrl_p.read_text())["test"] if ctrl_p.exists() else None
        ctrl = f"{ctrl_scores[c]:.3f}" if ctrl_scores else "not run"
        off = (f"{mean_others({o: base[o].score for o in caps}):.2f} / "
               f"{mean_others({o: m['metrics']['test'][o]['score'] for o in caps}):.2f} / "
               + (f"{mean_others(ctrl_scores):.2f}" if ctrl_scores else "-"))
        print(f"| {n} | {base[c].score:.3f} | {e:.3f} | {e - base[c].score:+.3f} | "
              f"{m['train']['seconds'] / 60:.1f} | {ctrl} | {off} |")
    print("\n### Every expert on every capability (test split; base in the first row)\n")
    print("| model | " + " | ".join(caps) + " |\n|---|" + "---|" * len(caps))
    print("| base | " + " | ".join(f"{base[c].score:.2f}" for c in caps) + " |")
    for n, m in experts.items():
        row = [f"**{m['metrics']['test'][c]['score']:.2f}**" if c == m["capability"]
               else f"{m['metrics']['test'][c]['score']:.2f}" for c in caps]
        print(f"| {n} | " + " | ".join(row) + " |")



def merge_table(run: Path) -> None:
    """Per strategy, its best final candidate by minimum retention on the test split."""
    res = json.loads((run / "results.json").read_text())
    rows: dict[str, dict] = {}
    for cell in res["matrix"]["test"]:
        rows.setdefault(cell["candidate"], {})[cell["capability"]] = cell
    caps = list(next(iter(rows.values())))
    took = (f"{res['total_seconds'] / 60:.1f} min" if "total_seconds" in res
            else f"last invocation {res['seconds'] / 60:.1f} min, earlier ones not recorded")
    print(f"\n### Merge search `{run}` ({len(res['trials'])} trials, {took}): "
          "best candidate per strategy, test split, retention vs each expert\n")
    print("| strategy | candidate | " + " | ".join(caps) + " | min retention |\n|---|---|" + "---|" * (len(caps) + 1))
    best: dict[str, tuple] = {}
    for label, cells in rows.items():
        if label.startswith(("expert ", "base")):
            continue
        strategy = label.split(" ", 1)[1]
        worst = min(c["retention"] for c in cells.values())
        if strategy not in best or worst > best[strategy][0]:
            best[strategy] = (worst, label, cells)
    for strategy, (worst, label, cells) in sorted(best.items(), key=lambda kv: -kv[1][0]):
        print(f"| {strategy} | {label} | " + " | ".join(f"{cells[c]['score']:.2f} ({cells[c]['retention']:.2f})"
                                                       for c in caps) + f" | {worst:.2f} |")


def distill_table(run: Path, base_model, base_tok, base_hash: str) -> None:
    """A distillation output on the test split against its teachers, with the report's headline
    measures (opd.merge.headline): retention and gain kept per capability, their minima over the
    capabilities whose expert beats the base by 2 stderr, and each shortfall's z."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.evaluation.api import evaluate
    from opd.manifest import load_manifest, resolve_expert
    from opd.merge.headline import capability_rows, minima

    mf = json.loads((run / "manifest.json").read_text())
    teachers = {n: load_manifest(resolve_expert(t["path"])) for n, t in mf["inputs"]["teachers"].items()}
    caps = [t.capability for t in teachers.values()]
    model = AutoModelForCausalLM.from_pretrained(run)
    scores = evaluate(model, AutoTokenizer.from_pretrained(run), caps, "test", model_hash=mf["content_hash"])
    base_scores = evaluate(base_model, base_tok, caps, "test", model_hash=base_hash)  # the teachers' capabilities
    cells = []
    for t in teachers.values():
        c, own = t.capability, t.metrics["test"][t.capability]
        cells += [{"candidate": "student", "capability": c, "score": scores[c].score, "stderr": scores[c].stderr,
                   "retention": scores[c].score / own.score},
                  {"candidate": f"expert {c}", "capability": c, "score": own.score, "stderr": own.stderr},
                  {"candidate": "base", "capability": c, "score": base_scores[c].score, "stderr": base_scores[c].stderr}]
    rows = capability_rows(cells, "student", {t.capability: f"expert {t.capability}" for t in teachers.values()})
    train = mf["train"]
    print(f"\n### Distillation `{run}` ({train['steps']} OPD steps, kept step {train['kept_step']}, "
          f"{train['gen_tokens']} sampled student tokens, {train['seconds'] / 60:.1f} min), test split\n")
    print("| capability | base | expert | student | retention | gain kept | z vs expert |\n|---|---|---|---|---|---|---|")
    for r in rows:
        kept = "-" if r.gain_kept is None else f"{r.gain_kept:.2f}"
        print(f"| {r.capability} | {r.base:.3f} | {r.expert:.3f} | {r.model:.3f} | {r.retention:.2f} | {kept} | "
              f"{r.vs_expert_z:+.1f} |")
    m = minima(rows)
    gain = "-" if m["min_gain_kept"] is None else f"{m['min_gain_kept']:.2f} ({m['weakest_gain']})"
    print(f"\nover the {m['gain_capabilities']} of {m['capabilities']} capabilities whose expert beats the base by "
          f"2 stderr: min retention {m['min_retention']:.2f} ({m['weakest']}, z {m['weakest_z']:+.1f}), mean "
          f"{m['mean_retention']:.2f}, min gain kept {gain}, lost for certain: "
          + (", ".join(f"{c} (z {z:+.1f})" for c, z in m["losses"]) or "none"))


if __name__ == "__main__":
    sys.exit(main())
