"""The train-expert recipe: parse, set up, train, score, register (called by scripts/train_expert.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opd.capabilities.reward_model import greedy_reward, load_reward_model
from opd.devices import dtype_tag, place, resolve_device, resolve_dtype
from opd.evaluation.api import evaluate
from opd.evaluation.heldout import heldout_items
from opd.expert.build import base_capabilities, default_out, load_base, write_expert
from opd.expert.spec import ExpertSpec, same_spec
from opd.expert.trainer import train
from opd.io import state_dict_hash, sweep_stale
from opd.paths import check_output
from opd.rl.checkpoint import Ranks
from opd.rl.distributed import deepspeed_wrap
from opd.tracking import Tracker, open_tracker, tracking_dir

console = Console(stderr=True)


def run_expert(spec: ExpertSpec, out: Path | None = None, fresh: bool = False) -> dict:
    torch.set_num_threads(spec.threads)
    out = check_output(out, "--out", kind="expert") if out else check_output(default_out(spec), "name", kind="expert")
    base_dir = Path(spec.base)
    model, tok = load_base(base_dir)
    reward_model = None
    if spec.reward_model_dir is not None:  # refused before anything is written: missing, or another tokenizer's
        val_prompts = [it["prompt"] for it in heldout_items(spec.capability, "val")[: spec.eval_limit]]
        reward_model = load_reward_model(spec.reward_model_dir, spec.capability, tok)
    base_hash = state_dict_hash(model)  # of the float32 weights, before `place` casts them
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    place(model, device, dtype)
    caps = spec.score_capabilities or base_capabilities(base_dir) or [spec.capability]
    if spec.capability not in caps:
        caps = [spec.capability, *caps]
    # next to the output, so two runs writing different outputs never share a checkpoint
    ckpt = out.parent / f".{out.name}.ckpt" / "state.pt"
    sweep_stale(out)  # temp dirs of a run killed while writing
    if fresh and ckpt.parent.exists():
        shutil.rmtree(ckpt.parent)
    done = _already_written(spec, out, base_hash)
    if done is not None and reward_model is not None and \
            (done.get("reward_model") or {}).get("content_hash") != reward_model.manifest["content_hash"]:
        done = None  # the same spec over a reward model trained since: a new version
    if done is not None and not fresh:
        # Same spec, same base: nothing changed (also the case of a run killed right after writing).
        console.print(f"{out} already holds this spec's expert (version {done['version']}); nothing to do "
                      "(--fresh trains a new version)")
        shutil.rmtree(ckpt.parent, ignore_errors=True)
        return done

    def screen(m) -> float:
        return evaluate(m, tok, [spec.capability], "val", limit=spec.eval_limit)[spec.capability].score

    def rm_screen(m) -> dict:
        """Logged beside the rule's val score: a reward model's score can climb while the rule's falls."""
        return {"rm_val": greedy_reward(reward_model, m, tok, spec.capability, val_prompts)}

    wrap = None
    if spec.deepspeed is not None:
        wrap = deepspeed_wrap(spec.gspo.grad_clip, spec.deepspeed)

    # rank 0 logs the curves; the other ranks of a data-parallel run sample their own batches. The rank
    # comes from the one place both loops take it (joining is idempotent: train() joins again).
    ranks = Ranks.join(deepspeed=wrap is not None)
    tracker = open_tracker(spec.report_to, tracking_dir(out), spec.expert_name, spec.model_dump(mode="json")) \
        if ranks.rank == 0 else Tracker()
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console)
    with tracker, bar:
        task = bar.add_task(f"GSPO {spec.expert_name}", total=spec.steps, info="")

        def progress(state, rec):
            if rec is None:  # resumed: the bar starts at the checkpoint's step
                bar.update(task, completed=state.step)
                return
            info = (f"reward {rec.get('reward', 0):.2f} informative {rec['informative']:.2f} "
                    f"clip {rec.get('clip_fraction', 0):.2f} T {rec['temperature']:.2f} "
                    f"best val {state.best_score:.2f}@{state.best_step}")
            if "val" in rec:
                info += f" val {rec['val']:.2f}"
            if "rm_val" in rec:
                info += f" rm val {rec['rm_val']:.2f}"
            bar.update(task, completed=state.step, info=info)

        state = train(spec.gspo, spec.run_settings(), model, tok, ckpt, evaluate_fn=screen, log=console.print,
                      progress=progress, wrap=wrap, tracker=tracker,
                      extra_eval_fn=rm_screen if reward_model is not None else None)
    if ranks.rank != 0:
        return {}  # rank 0 scores and writes the expert
    rm_ref = None if reward_model is None else {
        "path": spec.reward_model_dir, "content_hash": reward_model.manifest["content_hash"],
        "tokenizer_hash": reward_model.manifest["tokenizer_hash"],
        "heldout_accuracy": reward_model.manifest["heldout"]["accuracy"]}
    manifest = write_expert(spec, model, tok, state, base_dir, base_hash, out, caps, log=console.print,
                            extra={"reward_model": rm_ref} if rm_ref else None)
    shutil.rmtree(ckpt.parent, ignore_errors=True)
    base_scores = {c: s.score for c, s in evaluate(load_base(base_dir, device, dtype)[0], tok, caps, "test",
                                                   model_hash=base_hash + dtype_tag(dtype)).items()}
    table = Table(title=f"expert {spec.expert_name} (test split, lm-eval)")
    for col in ("capability", "base", "expert", "delta"):
        table.add_column(col, justify="right")
    for c in caps:
        e = manifest["metrics"]["test"][c]["score"]
        table.add_row(c + (" *" if c == spec.capability else ""), f"{base_scores[c]:.3f}", f"{e:.3f}",
                      f"{e - base_scores[c]:+.3f}")
    Console().print(table)
    console.print(f"wrote {out} (version {manifest['version']}, {state.step} steps, "
                  f"best step {state.best_step}, {state.elapsed / 60:.1f} min)")
    return manifest


def _already_written(spec: ExpertSpec, out: Path, base_hash: str) -> dict | None:
    mf = out / "manifest.json"
    if not mf.exists():
        return None
    m = json.loads(mf.read_text())
    same = same_spec(m.get("spec"), spec) and m["base"]["content_hash"] == base_hash
    return m if same else None
