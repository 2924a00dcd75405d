"""Build the lab base if needed (cached by spec), then print its lm-eval table."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from opd.display import display
from opd.evaluation.api import evaluate
from opd.io import atomic_write_json
from opd.lab.base import DEFAULT_SPEC, build_base, load_base_spec, same_training
from opd.paths import check_output

console = Console(stderr=True)
# What "mediocre" means for the lab (room for RL experts); the spec's `band` is the stricter
# target used to choose the checkpoint on validation.
LAB_BAND = (0.10, 0.60)


def build_and_report(spec_path=None, out="runs/base", force=False, overrides=None) -> dict:
    spec = load_base_spec(spec_path or DEFAULT_SPEC, **(overrides or {}))
    out = check_output(out, "--out", kind="base")
    mf = out / "manifest.json"
    manifest = json.loads(mf.read_text()) if mf.exists() else None
    if manifest and same_training(manifest.get("spec"), spec) and not force:
        console.print(f"base {out} is up to date (spec unchanged); reusing it")
        if manifest.get("capabilities") != spec.lab_capabilities:  # a reporting field, not the weights
            manifest["capabilities"] = spec.lab_capabilities
            atomic_write_json(mf, manifest)
    else:
        # a section of the one live display: off a terminal (nohup, CI) it prints every 30 s too
        bar = Progress(TextColumn(f"[bold]pre-training {out}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("loss {task.fields[loss]:.3f}"))
        task = bar.add_task("base", total=spec.steps, loss=float("nan"))
        with display.section("base", lambda: bar):
            manifest = build_base(spec, out, progress=lambda s, n, loss: bar.update(task, completed=s, loss=loss),
                                  log=console.print)
    return report_base(out, spec.lab_capabilities, LAB_BAND)


def report_base(out: Path, capabilities: list[str], band) -> dict:
    # lazy: the Auto classes add ~0.4 s to `opd base`'s start, a bad spec's included
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    scores = evaluate(model, tok, capabilities, "test")
    table = Table(title=f"lab base {out} — lm-eval, held-out test split")
    for col in ("capability", "score", "stderr", "n", f"in band {band[0]:.2f}-{band[1]:.2f}"):
        table.add_column(col, justify="right")
    for c, s in scores.items():
        table.add_row(c, f"{s.score:.3f}", f"{s.stderr:.3f}", str(s.n), "yes" if band[0] <= s.score <= band[1] else "no")
    Console().print(table)
    inside = sum(band[0] <= s.score <= band[1] for s in scores.values())
    console.print(f"{inside}/{len(scores)} capabilities in the band")
    return {c: s.__dict__ for c, s in scores.items()}
