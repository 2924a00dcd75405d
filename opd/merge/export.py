"""`python -m opd.merge export <run dir> <trial>`: one searched candidate as a mergekit YAML and the
model mergekit's own `run_merge` builds from it, checked tensor for tensor against the search's merge.

The export runs in a process that imported `opd.weights.merge`, so opd's own methods (tsv_m, iso_c,
iso_cts, regmean, wudi, adamerging) are registered with mergekit; a plain `mergekit-yaml` does not know them.
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import yaml

from opd.errors import OpdError
from opd.io import atomic_dir
from opd.merge.recipe import MergeRecipe, load_inputs
from opd.merge.strategies import get_strategy
from opd.merge.trials import from_results
from opd.paths import check_output
from opd.weights.merge import merge_candidate, mergekit_config, run_mergekit


def export_trial(run_dir: str | Path, number: int, out: str | Path | None = None, log=print) -> Path:
    """Write <out>/mergekit.yaml and the merged HF model in <out> (default <run>/export/trial-<n>);
    returns <out>. Raises OpdError for a run without results, an unknown trial, or a trial whose
    strategy is not a merge (a distilled student)."""
    run_dir = Path(run_dir)
    try:
        summary = json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError):
        raise OpdError(f"{run_dir}: no readable results.json; give the out directory of a finished merge run "
                       "(runs/merge/<name>)") from None
    trial = next((t for t in summary["trials"] if t["number"] == number), None)
    if trial is None:
        have = ", ".join(str(t["number"]) for t in summary["trials"])
        raise OpdError(f"trial {number}: not a finished trial of {run_dir} (finished: {have})")
    rec = from_results(trial)
    cand = rec.candidate
    # a trial that is not a merge (a distilled student) says where its weights are instead
    get_strategy(cand.strategy).check_export(number, run_dir, number if rec.resume_of is None else rec.resume_of)
    recipe = MergeRecipe.model_validate(summary["recipe"])
    inputs = load_inputs(recipe)  # the same checks as the search: hashes, architecture, vocabulary
    base, experts = str(inputs.base_path), {e: str(p) for e, p in inputs.expert_paths.items()}
    config = mergekit_config(cand, base, experts)
    out = check_output(out or run_dir / "export" / f"trial-{number}", "--out", kind="export")
    log(f"trial {number}: {cand.label()} -> {out}")
    with atomic_dir(out) as tmp:
        (tmp / "mergekit.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        run_mergekit(config, str(tmp), seed=cand.seed)
        built = {}
        for f in sorted(tmp.glob("*.safetensors")):
            built.update(safetensors.torch.load_file(f))
        searched = merge_candidate(cand, base, experts, inputs.base_sd, inputs.expert_sds)
        diff = max((float((built[k] - v).abs().max()) for k, v in searched.items() if k in built), default=0.0)
        missing = sorted(set(searched) - set(built))
        if missing or diff > 1e-5:
            raise OpdError(f"trial {number}: mergekit's run_merge does not reproduce the search's merge "
                           f"(max |diff| {diff:.3g}, missing {missing[:3]}); nothing was written")
        (tmp / "manifest.json").write_text(json.dumps({
            "kind": "export", "trial": number, "candidate": cand.model_dump(mode="json"), "run": str(run_dir),
            "reproduced": {"tensors": len(searched), "max_abs_diff": diff}}, indent=2) + "\n")
    log(f"mergekit's run_merge reproduces the search's merge: {len(searched)} tensors, max |diff| {diff:.3g}")
    return out
