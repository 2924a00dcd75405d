"""Train a student by OPD and keep its best step: what the standalone recipe (opd.distill.run) and the
search's OPD strategies (opd.merge.strategies.distill) both do with the loop."""

from __future__ import annotations

from pathlib import Path

from opd.distill.bar import opd_bar
from opd.distill.config import DistillConfig
from opd.distill.loop import DistillState, distill
from opd.distill.routing import Routes
from opd.distill.teachers import Teacher
from opd.tracking import Tracker


def keep_best(student, state: DistillState, log=print) -> None:
    """Put the student of the best val retention check back in place, if the run ended past it
    (retention can peak and fall within a run)."""
    if state.best_model is not None and state.best_step != state.step:
        log(f"keeping step {state.best_step} (min val retention {state.best_min_retention:.3f})")
        student.load_state_dict(state.best_model)


def train_student(cfg: DistillConfig, student, tokenizer, teachers: dict[str, Teacher], routes: Routes,
                  ckpt_path: Path | None, *, tracker: Tracker, bar: str, live: bool = True, log=print,
                  **distill_kw) -> DistillState:
    """`distill` with its curves in `tracker` (entered and closed here) and its bars in the live display
    under the title `bar` (when `live`), then `keep_best`; returns the loop's state. `distill_kw`: the
    loop's other arguments (evaluate_fn, references, teacher_weights, wrap, ...)."""
    with tracker, opd_bar(bar, cfg, enabled=live) as progress:
        state = distill(cfg, student, tokenizer, teachers, routes, ckpt_path, log=log, tracker=tracker,
                        progress=progress, **distill_kw)
    keep_best(student, state, log)
    return state
