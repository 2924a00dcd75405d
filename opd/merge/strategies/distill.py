"""On-policy distillation (OPD) as strategies: a student trained from the experts as teachers.

`opd` starts the student from the base, `merge_opd` from the best weight-space candidate the search
has scored so far, and a `<method>+opd` hybrid per merge method from that method's merge (its
parameters searched with the OPD settings). `offpolicy` and `gspo` are what a user would do instead
(supervised training on verified teacher samples; multi-task GSPO on verifier rewards), run by the
same loop so that tokens and minutes compare.

Their `build` calls `opd_student`, which trains one trial's student with the distillation loop
(opd.distill). Students are cached per trial, so re-scoring on test and saving the best model never
retrain, and a killed trial's run resumes from its checkpoint.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from pydantic import ValidationError

from opd.devices import place
from opd.distill.config import DistillConfig
from opd.distill.routing import resolve_routes
from opd.distill.student import train_student
from opd.distill.teachers import embedded_teacher
from opd.errors import OpdError
from opd.io import atomic_save_safetensors, atomic_write_json, exclusive_dir, remove_checkpoint
from opd.merge.strategies.base import RUNS_DIR, BuildContext, MergeInputs, ModelCard, Strategy, get_strategy
from opd.tracking import open_tracker, tracking_dir
from opd.weights.merge import Candidate, merge_keys, mergekit_config, methods


@dataclass(frozen=True, kw_only=True)
class DistillStrategy(Strategy):
    """OPD (and its off-policy and GSPO baselines): a student trained from the experts as teachers,
    starting from the base, the search's best merge, or a merge method's merge (a hybrid)."""

    distill_shared: dict[str, Any]  # the DistillConfig fields it searches (defaults: the recipe's `distill`)
    init: str  # how the student starts: "base", "best", or a merge method's name (a hybrid)
    # DistillConfig settings that define the strategy itself (not searchable), e.g. GSPO's kl_weight 0
    distill_fixed: dict[str, Any] | None = None

    resumable = True
    stage = "OPD"

    @property
    def waits_for_merges(self) -> bool:
        return self.init == "best"

    def merge_part(self, cand: Candidate) -> Candidate | None:
        if self.init in ("base", "best"):
            return None
        method = get_strategy(self.init)
        return Candidate(strategy=method.name, shared={k: v for k, v in cand.shared.items() if k in method.shared},
                         per_model={e: {k: v for k, v in ps.items() if k in method.per_model}
                                    for e, ps in cand.per_model.items()}, seed=cand.seed)

    def check_inputs(self, n_experts: int) -> None:
        if self.init not in ("base", "best"):
            get_strategy(self.init).check_inputs(n_experts)

    def check_params(self, params: dict[str, Any], distill) -> None:
        if self.init not in ("base", "best"):  # a hybrid: its merge's parameters as that method checks them
            method = get_strategy(self.init)
            try:
                method.check_params({p: v for p, v in params.items() if p in method.parameters}, distill)
            except ValueError as e:
                raise ValueError(f"strategy {self.name!r}: {e}") from None
        fixed = {p: v for p, v in params.items() if p in self.distill_shared and isinstance(v, bool | int | float | str)}
        try:
            type(distill).model_validate({**distill.model_dump(), **fixed, **(self.distill_fixed or {})})
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"strategy {self.name!r}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None

    def reward_setting(self, params: dict[str, Any]) -> str | None:
        """`reward_weight` fixed above 0 by the strategy (gspo), or a value, range or choice above 0 in
        the recipe; None if neither. The recipe's `distill.reward_weight` is DistillConfig's to check."""
        fixed = (self.distill_fixed or {}).get("reward_weight", 0.0)
        if fixed > 0:
            return f"reward_weight {fixed}, fixed by the strategy"
        spec = params.get("reward_weight")
        if spec is None:
            return None
        values = getattr(spec, "choices", None) or (spec if isinstance(spec, tuple) else [spec])
        if any(isinstance(v, int | float) and v > 0 for v in values):
            return f"reward_weight {getattr(spec, 'choices', spec)} can be above 0"
        return None

    def start(self, cand: Candidate, best_merge: Callable[[], Candidate | None]) -> dict[str, Any]:
        init = self.merge_part(cand)
        return {"opd_init": best_merge() if init is None and self.init == "best" else init}

    def build(self, inputs: MergeInputs, cand: Candidate, ctx: BuildContext | None = None
              ) -> tuple[dict, dict[str, Any]]:
        """The trial's student (trained once, then read from <out>/opd/trial-<n>/) and its history."""
        if ctx is None:
            raise ValueError(f"strategy {cand.strategy!r} trains a student: build() needs its trial's context")
        init = ctx.opd_init
        init_sd = get_strategy(init.strategy).build(inputs, init)[0] if init else inputs.base_sd
        sd, history = opd_student(inputs, cand, ctx.distill, ctx.name, init_sd, student_dir(ctx.out_dir, ctx.number),
                                  evaluate_fn=ctx.evaluate_fn, references=ctx.references, live=ctx.live,
                                  device=ctx.device, dtype=ctx.dtype)
        return sd, {"opd_history": history}

    def card(self, cand: Candidate, base_path: str, expert_paths: dict[str, str], ctx: BuildContext) -> ModelCard:
        # A student is not a function of the inputs' weights alone: record how it was trained.
        init = ctx.opd_init
        doc = {"opd": cand.model_dump(mode="json"), "distill": ctx.distill.model_dump(mode="json"),
               "init": mergekit_config(init, base_path, expert_paths) if init else "base"}
        return ModelCard("distilled", "distill.yaml", doc,
                         f"by on-policy distillation (`{cand.strategy}`) from the experts as teachers; "
                         "`distill.yaml` records the settings and the student's initial merge",
                         "Rerun the recipe (`python -m opd.merge --recipe ...`) to retrain it:", ("distillation",))

    def check_export(self, number: int, run_dir: Path, run: int) -> None:
        raise OpdError(f"trial {number} is a distilled student ({self.name}), not a merge: its weights are "
                       f"{student_dir(run_dir, run) / 'student.safetensors'}")


def student_dir(out_dir: Path, run: int) -> Path:
    """Where the student of trial `run` (the trial a requeued one resumes) is trained and kept."""
    return Path(out_dir) / RUNS_DIR / f"trial-{run}"


# The DistillConfig fields an OPD strategy searches (defaults: the recipe's `distill` block), and
# its per-teacher weight: the teacher's share of its capability's KL target and of the prompts.
OPD_SHARED = {"steps": 50, "lr": 3e-4, "estimator": "sampled", "reward_weight": 0.0, "temperature": 1.0,
              "prompts_per_step": 16, "group_size": 4, "updates_per_batch": 1, "lr_schedule": "constant",
              "adaptive_mix": 0.0, "kl_weight": 1.0, "warmstart_steps": 0, "warmstart_prompts": 256,
              "warmstart_lr": 1e-3, "domain_balance": "none"}
OPD_PER_MODEL = {"teacher_weight": 1.0}
HYBRID_SUFFIX = "+opd"
HYBRIDS_ARE = f"'<method>{HYBRID_SUFFIX}' hybrids of a mergekit method with OPD"


def _opd(name: str, pretty: str, init: str, fixed: dict[str, Any] | None = None) -> DistillStrategy:
    return DistillStrategy(name=name, inputs="distill", shared=dict(OPD_SHARED), per_model=dict(OPD_PER_MODEL),
                           pretty=pretty, distill_shared=dict(OPD_SHARED), init=init, distill_fixed=fixed)


DISTILL_STRATEGIES = [
    _opd("opd", "OPD from the base", "base"),
    _opd("merge_opd", "OPD from the best merge so far", "best"),
    # What a user would do instead of OPD, run by the same loop so that tokens and minutes compare:
    # supervised training on teacher samples the verifier accepts, or on all of them with verifier: none
    # (off-policy distillation, no on-policy steps; lab12_noverifier's final recipe), and multi-task GSPO from the base on verifier rewards alone (no teacher).
    _opd("offpolicy", "off-policy distillation (the warm start alone: teacher samples, verified unless "
         "verifier: none)", "base", {"steps": 0}),
    _opd("gspo", "multi-task GSPO on verifier rewards", "base",
         {"kl_weight": 0.0, "reward_weight": 1.0, "warmstart_steps": 0}),
]
# `<method>+opd`: OPD from that method's merge, its parameters searched with the OPD settings.
HYBRIDS = {f"{m.name}{HYBRID_SUFFIX}": DistillStrategy(
    name=f"{m.name}{HYBRID_SUFFIX}", inputs=m.inputs, shared={**m.shared, **OPD_SHARED},
    per_model={**m.per_model, **OPD_PER_MODEL}, pretty=f"OPD from {m.pretty}", layerwise=m.floats,
    distill_shared=dict(OPD_SHARED), init=m.name) for m in methods()}


def distill_part(cand: Candidate) -> tuple[dict[str, Any], dict[str, float]]:
    """An OPD candidate's DistillConfig settings and its teacher weights (expert -> weight)."""
    strategy = get_strategy(cand.strategy)
    settings = {k: v for k, v in cand.shared.items() if k in strategy.distill_shared}
    settings.update(strategy.distill_fixed or {})
    weights = {e: float(ps["teacher_weight"]) for e, ps in cand.per_model.items() if "teacher_weight" in ps}
    return settings, weights


def opd_settings(distill_cfg: DistillConfig, cand: Candidate) -> tuple[DistillConfig, dict[str, float]]:
    """The candidate's DistillConfig (the recipe's `distill_cfg` overridden by its parameters) and
    teacher weights."""
    settings, weights = distill_part(cand)
    cfg = DistillConfig.model_validate({**distill_cfg.model_dump(), **settings, "seed": cand.seed})
    return cfg, weights


def opd_student(inputs: MergeInputs, cand: Candidate, distill_cfg: DistillConfig, name: str, init_sd: dict,
                trial_dir: Path, *, evaluate_fn=None, references: dict[str, float] | None = None,
                log=lambda *_: None, live: bool = False, device=None, dtype=None) -> tuple[dict, list[dict]]:
    """Distil the experts into a student starting from `init_sd`, with the recipe's `distill_cfg`
    under the candidate's parameters; returns (state dict, history). `name` (the recipe's) names its
    curves; `live`: show the student's bars in the live display (opd.display); `device`, `dtype`: where the
    student and its teachers train (default: the base model's, the CPU in float32). The state dict returned
    is on the CPU in float32, as every candidate's."""
    weights_file, history_file = trial_dir / "student.safetensors", trial_dir / "history.json"
    if weights_file.exists() and history_file.exists():
        return _trained(trial_dir)
    with exclusive_dir(trial_dir):  # a requeued trial never trains beside a live original
        if weights_file.exists() and history_file.exists():  # it finished while we waited to look
            return _trained(trial_dir)
        return _train_student(inputs, cand, distill_cfg, name, init_sd, trial_dir, evaluate_fn, references, log,
                              live, device, dtype)


def _trained(trial_dir: Path) -> tuple[dict, list[dict]]:
    """The finished student and its history. A kill between their writes and the checkpoint's removal
    left the checkpoint: nothing resumes from it once both are written, so it goes now."""
    remove_checkpoint(trial_dir / "state.pt")
    history = json.loads((trial_dir / "history.json").read_text())
    return safetensors.torch.load_file(trial_dir / "student.safetensors"), history


def _train_student(inputs, cand, distill_cfg, name, init_sd, trial_dir: Path, evaluate_fn, references, log, live,
                   device=None, dtype=None):
    weights_file, history_file = trial_dir / "student.safetensors", trial_dir / "history.json"
    cfg, weights = opd_settings(distill_cfg, cand)
    student = copy.deepcopy(inputs.base_model)
    student.load_state_dict(init_sd, strict=False)  # tied lm_head follows the embedding
    on_device = (lambda m: place(m, device, dtype or torch.float32)) if device is not None else (lambda m: m)
    on_device(student)
    teachers = {}
    for e, sd in inputs.expert_sds.items():
        model = copy.deepcopy(inputs.base_model)
        model.load_state_dict(sd, strict=False)
        on_device(model)
        teachers[e] = embedded_teacher(e, inputs.manifests[e].capability, model, inputs.tokenizer,
                                       inputs.manifests[e].tasks)
    routes = resolve_routes({e: t.tasks for e, t in teachers.items()}, cfg.routes, weights)
    # the study's OPD curves side by side: <out>/opd/tb/trial-<n>
    # the student of the best val retention check, as the standalone run keeps (val is the search's
    # split; the test split only reports)
    state = train_student(cfg, student, inputs.tokenizer, teachers, routes, trial_dir / "state.pt",
                          tracker=open_tracker(cfg.report_to, tracking_dir(trial_dir), f"{name}/{trial_dir.name}",
                                               cfg.model_dump(mode="json")),
                          bar=f"{trial_dir.name} {cand.strategy}", live=live, log=log, evaluate_fn=evaluate_fn,
                          references=references, teacher_weights=weights)
    sd = {k: v.detach().to("cpu", torch.float32).clone().contiguous()
          for k, v in merge_keys(student.state_dict()).items()}
    trial_dir.mkdir(parents=True, exist_ok=True)
    # history last: the pair is complete only once both exist, and each lands whole
    atomic_save_safetensors(sd, weights_file)
    atomic_write_json(history_file, state.history)
    remove_checkpoint(trial_dir / "state.pt")
    return sd, state.history
