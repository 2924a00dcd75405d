"""OPD as a search strategy: train one candidate's student from the search's loaded base and experts.

The OPD strategies' `build` (opd.merge.methods.DistillStrategy: `opd`, `merge_opd`, `<method>+opd`,
`offpolicy`, `gspo`) calls `opd_student`. Students are cached per trial, so re-scoring on test and saving the best
model never retrain, and a killed trial's run resumes from its checkpoint.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from opd.distill.bar import opd_bar
from opd.distill.config import DistillConfig
from opd.distill.loop import distill
from opd.distill.routing import resolve_routes
from opd.distill.teachers import embedded_teacher
from opd.io import atomic_save_safetensors, atomic_write_json, exclusive_dir
from opd.tracking import open_tracker, tracking_dir


def opd_settings(recipe, cand) -> tuple[DistillConfig, dict[str, float]]:
    """The candidate's DistillConfig (recipe.distill overridden by its parameters) and teacher weights."""
    from opd.merge.methods import distill_part

    settings, weights = distill_part(cand)
    cfg = DistillConfig.model_validate({**recipe.distill.model_dump(), **settings, "seed": cand.seed})
    return cfg, weights


def opd_student(inputs, cand, recipe, init_sd: dict, trial_dir: Path, *, evaluate_fn=None,
                references: dict[str, float] | None = None, log=lambda *_: None,
                live: bool = False) -> tuple[dict, list[dict]]:
    """Distil the experts into a student starting from `init_sd`; returns (state dict, history).
    `live`: show the student's bars in the live display (opd.display)."""
    weights_file, history_file = trial_dir / "student.safetensors", trial_dir / "history.json"
    if weights_file.exists() and history_file.exists():
        return _trained(trial_dir)
    with exclusive_dir(trial_dir):  # a requeued trial never trains beside a live original
        if weights_file.exists() and history_file.exists():  # it finished while we waited to look
            return _trained(trial_dir)
        return _train_student(inputs, cand, recipe, init_sd, trial_dir, evaluate_fn, references, log, live)


def _trained(trial_dir: Path) -> tuple[dict, list[dict]]:
    """The finished student and its history. A kill between their writes and the checkpoint's removal
    left the checkpoint: nothing resumes from it once both are written, so it goes now."""
    from safetensors.torch import load_file

    (trial_dir / "state.pt").unlink(missing_ok=True)
    return load_file(trial_dir / "student.safetensors"), json.loads((trial_dir / "history.json").read_text())


def _train_student(inputs, cand, recipe, init_sd, trial_dir: Path, evaluate_fn, references, log, live):
    from opd.merge.recipe import merge_keys

    weights_file, history_file = trial_dir / "student.safetensors", trial_dir / "history.json"
    cfg, weights = opd_settings(recipe, cand)
    student = copy.deepcopy(inputs.base_model)
    student.load_state_dict(init_sd, strict=False)  # tied lm_head follows the embedding
    teachers = {}
    for e, sd in inputs.expert_sds.items():
        model = copy.deepcopy(inputs.base_model)
        model.load_state_dict(sd, strict=False)
        teachers[e] = embedded_teacher(e, inputs.manifests[e].capability, model, inputs.tokenizer)
    routes = resolve_routes({e: t.capability for e, t in teachers.items()}, cfg.routes, weights)
    # the study's OPD curves side by side: <out>/opd/tb/trial-<n>
    with open_tracker(cfg.report_to, tracking_dir(trial_dir), f"{recipe.name}/{trial_dir.name}",
                      cfg.model_dump(mode="json")) as tracker, \
            opd_bar(f"{trial_dir.name} {cand.strategy}", cfg, enabled=live) as progress:
        state = distill(cfg, student, inputs.tokenizer, teachers, routes, trial_dir / "state.pt",
                        evaluate_fn=evaluate_fn, references=references, teacher_weights=weights, log=log,
                        tracker=tracker, progress=progress)
    if state.best_model is not None and state.best_step != state.step:
        # the student of the best val retention check, as the standalone run keeps (val is the
        # search's split; the test split only reports)
        log(f"keeping step {state.best_step} (min val retention {state.best_min_retention:.3f})")
        student.load_state_dict(state.best_model)
    sd = {k: v.detach().clone().contiguous() for k, v in merge_keys(student.state_dict()).items()}
    trial_dir.mkdir(parents=True, exist_ok=True)
    # history last: the pair is complete only once both exist, and each lands whole
    atomic_save_safetensors(sd, weights_file)
    atomic_write_json(history_file, state.history)
    (trial_dir / "state.pt").unlink(missing_ok=True)
    return sd, state.history
