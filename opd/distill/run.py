"""The standalone OPD recipe: load base, teachers and student init; distill; score; write the student."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from opd.devices import fp32_state, place, resolve_device, resolve_dtype
from opd.distill.config import DistillRun
from opd.distill.routing import resolve_routes
from opd.distill.student import train_student
from opd.distill.teacher_bank import check_same_architecture
from opd.distill.teachers import Teacher, embedded_teacher
from opd.errors import OpdError
from opd.evaluation.api import evaluate as lm_eval_score
from opd.io import atomic_dir, atomic_write_json, state_dict_hash
from opd.manifest import load_manifest, resolve_expert
from opd.model_inputs import OpenedExpert, entry_name, hub_id, open_experts, write_model_card
from opd.paths import check_output, require_model_dir, require_same_tokenizer
from opd.rl.distributed import deepspeed_wrap, init_distributed
from opd.rollout import get_engine
from opd.tracking import Tracker, open_tracker, tracking_dir
from opd.weights.merge import Candidate, merge_candidate, merge_keys


def load_teachers(names: list, tokenizer, servers: dict[str, str] | None = None, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, base: str | Path | None = None
                  ) -> tuple[dict[str, Teacher], dict[str, dict]]:
    """Each expert (an opd expert's name or path, or a BYO `{path, tasks}` entry) as a frozen in-process
    teacher on `device` in `dtype` (or, when `servers` names it, a client of the SGLang server at that
    URL) serving its tasks, and its record (as a dict) by teacher name. With `base`, every teacher is
    checked against it (architecture, tensors, tokenizer content: opd.model_inputs) before any weights
    load; without, opd experts' tokenizers against `tokenizer`."""
    # lazy: transformers' Auto classes add ~0.45 s to `python -m opd.distill`'s start, a bad run YAML's too
    from transformers import AutoModelForCausalLM

    if base is not None:
        opened = open_experts(list(names), base, what="teacher")
    else:
        paths = {n: resolve_expert(n) for n in names}
        require_same_tokenizer(("the student", tokenizer), {f"teacher {p.name!r}": p for p in paths.values()})
        opened = {p.name: OpenedExpert(p.name, p, load_manifest(p)) for p in paths.values()}
    teachers, manifests = {}, {}
    for name, e in opened.items():
        m = e.record
        url = (servers or {}).get(name)
        if url:
            teachers[name] = Teacher(name, m.capability, get_engine("sglang", base_url=url, tokenizer=tokenizer),
                                     tasks=tuple(m.tasks))
        else:
            model = place(AutoModelForCausalLM.from_pretrained(e.path, dtype="float32"), torch.device(device), dtype)
            teachers[name] = embedded_teacher(name, m.capability, model, tokenizer, m.tasks)
        manifests[name] = {"path": str(e.path), **m.model_dump(mode="json")}
    return teachers, manifests


def teacher_references(routes, manifests: dict[str, dict]) -> dict[str, float]:
    """Each routed capability's reference val score: the best of its teachers' own (from their manifests)."""
    refs = {}
    for cap, ts in routes.items():
        scores = [manifests[t]["metrics"].get("val", {}).get(cap, {}).get("score") for t in ts]
        scores = [s for s in scores if s is not None]
        if scores:
            refs[cap] = max(scores)
    return refs


def init_student(run: DistillRun, teachers: dict[str, Teacher], manifests: dict[str, dict]):
    """The student's starting weights: the base, a model directory, or a weight-space merge of the teachers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: Auto classes, as in load_teachers

    src = require_model_dir(run.base, "base", "set base= to a model directory") if run.student == "base" \
        else require_model_dir(run.student, "student", "give a model directory or 'base'")
    model = AutoModelForCausalLM.from_pretrained(src, dtype="float32")
    tok = AutoTokenizer.from_pretrained(src)
    if run.student_merge is not None:
        cand = Candidate.model_validate(run.student_merge)
        base_sd = {k: v.detach().clone() for k, v in merge_keys(model.state_dict()).items()}
        # the teachers may sit on a GPU in bf16; the merge runs on the CPU in float32, as the base here
        sds = {n: {k: v.to("cpu", torch.float32) for k, v in merge_keys(t.model.state_dict()).items()}
               for n, t in teachers.items()}
        merged = merge_candidate(cand, run.base, {n: manifests[n]["path"] for n in teachers}, base_sd, sds)
        model.load_state_dict(merged, strict=False)  # tied lm_head follows the embedding
    return model, tok


def _prefixed(log, prefix: str):
    return lambda msg: log(prefix + msg)


def run_distill(run: DistillRun, log=print, fresh: bool = False, evaluate: bool = True) -> dict:
    """Parse-setup-train-save: returns the manifest written to <out>/manifest.json.

    With `run.deepspeed`, under a launcher every rank calls this; rank 0 writes and returns the
    manifest, the others return {}.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # lazy: as in load_teachers

    torch.set_num_threads(run.threads)
    out = check_output(run.out_dir, "out" if run.out else "name", kind="distilled")
    require_model_dir(run.base, "base", "build the lab base with `python scripts/build_base.py` or set base= "
                      "to a model directory")
    if run.student != "base":
        require_model_dir(run.student, "student", "give a model directory (e.g. runs/merge/<name>/best) or 'base'")
    wrap, rank, world = None, 0, 1
    if run.deepspeed is not None:
        rank, world = init_distributed()
        wrap = deepspeed_wrap(run.distill.grad_clip, run.deepspeed)
        if rank:
            log = _prefixed(log, f"[rank {rank}] ")
    tok0 = AutoTokenizer.from_pretrained(run.base)
    if run.student != "base":  # the teachers are checked against the base in load_teachers
        require_same_tokenizer(("the base", tok0), {"the student": run.student})
    names = [entry_name(t) for t in run.teachers]
    unknown = sorted(set(run.teacher_servers) - set(names))
    if unknown:
        raise OpdError(f"teacher_servers names {unknown}, which are not among the teachers {names}")
    # after the process group: 'auto' and 'cuda' are each rank's own GPU (LOCAL_RANK)
    device = resolve_device(run.device)
    dtype = resolve_dtype(run.dtype, device)
    teachers, manifests = load_teachers(run.teachers, tok0, run.teacher_servers, device, dtype, base=run.base)
    check_same_architecture(teachers, student=AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run.base)))
    student, tok = init_student(run, teachers, manifests)
    init_hash = state_dict_hash(student)  # of the float32 init, before `place` casts it
    place(student, device, dtype)
    routes = resolve_routes({n: t.tasks for n, t in teachers.items()}, run.distill.routes)
    caps = list(routes)
    refs = teacher_references(routes, manifests)
    ckpt = out.parent / f".{out.name}.ckpt" / "state.pt"
    # the run as it ran: its dtype resolved ('auto' is float32 on a CPU, as every run was before the field)
    recorded = {**run.model_dump(mode="json"), "dtype": str(dtype).removeprefix("torch.")}
    done = _already_written(out, recorded, init_hash, manifests, evaluate)
    if done is not None and not fresh:
        # Same run, same inputs: nothing to do (also the case of a run killed after writing its student
        # and removing its checkpoint, which would otherwise train it all again from step 0).
        log(f"{out} already holds this run's student; nothing to do (--fresh trains it again)")
        shutil.rmtree(ckpt.parent, ignore_errors=True)
        return done
    if fresh and ckpt.parent.exists():
        try:
            shutil.rmtree(ckpt.parent)
        except FileNotFoundError:  # another rank removed it first (before any rank can save again)
            pass

    def screen(m) -> dict[str, float]:
        return {c: s.score for c, s in lm_eval_score(m, tok, caps, "val", limit=run.distill.eval_limit).items()}

    log(f"student and teachers on {device} in {str(dtype).removeprefix('torch.')}")

    # rank 0 logs the curves, as it writes the student
    tracker = open_tracker(run.distill.report_to, tracking_dir(out), run.name, run.model_dump(mode="json")) \
        if rank == 0 else Tracker()
    state = train_student(run.distill, student, tok, teachers, routes, ckpt, tracker=tracker, bar=run.name,
                          live=rank == 0, log=log, evaluate_fn=screen if evaluate else None, references=refs,
                          wrap=wrap)
    if rank != 0:
        return {}  # rank 0 writes the student
    manifest = {
        "kind": "distilled", "name": run.name, "content_hash": state_dict_hash(fp32_state(student)),
        "run": recorded, "routes": routes, "student_init_hash": init_hash,
        "inputs": {"base": run.base, "teachers": {n: {"path": m["path"], "content_hash": m["content_hash"],
                                                      "capability": m["capability"], "tasks": m["tasks"],
                                                      "kind": m["kind"], "hub_id": m.get("hub_id")}
                                                  for n, m in manifests.items()}},
        "train": {"steps": state.step, "seconds": state.elapsed, "gen_tokens": state.gen_tokens, "ranks": world,
                  "kept_step": state.best_step if state.best_model is not None else state.step,
                  "kept_min_val_retention": state.best_min_retention},
        "references": refs, "final": state.history[-1] if state.history else {},
    }
    with atomic_dir(out) as tmp:
        student.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / "manifest.json", manifest)
        atomic_write_json(tmp / "history.json", state.history)
        _write_card(tmp, run, manifest)
    shutil.rmtree(ckpt.parent, ignore_errors=True)
    log(f"wrote {out} ({state.step} steps, {state.gen_tokens} student tokens, {state.elapsed / 60:.1f} min)")
    return manifest


def _write_card(out: Path, run: DistillRun, manifest: dict) -> None:
    """The student's model card: Hub ids of its base and teachers (when they came from the Hub) as
    base_model, local paths in the body."""
    teachers = manifest["inputs"]["teachers"]
    rows = "\n".join(f"| {n} | {', '.join(t['tasks'])} | `{t['path']}` | `{t['content_hash']}` |"
                     for n, t in teachers.items())
    final = manifest["final"]
    scores = "\n".join(f"| {k.removeprefix('val/')} | {v:.3f} |" for k, v in final.items() if k.startswith("val/"))
    body = f"""# {run.name}: distilled model

Trained by opd's on-policy distillation (`python -m opd.distill`) from the base `{run.base}`
for {manifest['train']['steps']} steps, each prompt's tokens scored by the teachers of its task:

| teacher | tasks | path | content hash |
|---|---|---|---|
{rows}
""" + (f"\n| task | score (val) |\n|---|---|\n{scores}\n" if scores else "") + """
`manifest.json` beside the weights records the run's settings and inputs.
"""
    write_model_card(out, body, {"base": {"hub_id": hub_id(run.base)}, "teachers": teachers},
                     ["opd", "distillation"])


def _already_written(out: Path, run: dict, init_hash: str, manifests: dict[str, dict], evaluate: bool
                     ) -> dict | None:
    """The manifest in `out` when this run wrote it: same settings, student init and teachers, and
    scored on val (its final record has a retention) exactly when this run scores."""
    mf = out / "manifest.json"
    if not mf.exists():
        return None
    m = json.loads(mf.read_text())
    teachers = {n: t.get("content_hash") for n, t in m.get("inputs", {}).get("teachers", {}).items()}
    same = (_settings(m.get("run")) == _settings(run) and m.get("student_init_hash") == init_hash
            and teachers == {n: t["content_hash"] for n, t in manifests.items()}
            and ("min_retention" in m.get("final", {})) == evaluate)
    return m if same else None


def _settings(run: dict | None) -> dict | None:
    """A run's recorded fields less where its curves go (`distill.report_to`, which changes no weights
    and which manifests written before it existed lack) and where it ran (`device`); a run recorded
    before `dtype` existed ran in float32, one recorded before `verifier` existed with the capability's."""
    if not run:
        return run
    return {"dtype": "float32", "verifier": "capability", **{k: v for k, v in run.items() if k != "device"},
            "distill": {"verifier": "capability",
                        **{k: v for k, v in run.get("distill", {}).items() if k != "report_to"}}}
