"""Tracked curves: GSPO, OPD and base pre-training write TensorBoard event files with every metric
of their history records; a resumed run does not log a step twice; `report_to` picks the tracker."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
from test_merge_fakes import build_fake_lab

from opd.errors import OpdError
from opd.tracking import open_tracker, scalars, tracking_dir


def curves(log_dir) -> dict[str, list[int]]:
    """Each scalar tag's steps as TensorBoard reads them (a restart's purge_step applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def history_steps(history: list[dict], extra: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """What the curves must be: every numeric metric of the history records, at its record's step."""
    want: dict[str, list[int]] = {k: list(v) for k, v in (extra or {}).items()}
    for rec in history:
        for tag, _ in scalars(rec):
            want.setdefault(tag, []).append(rec["step"])
    return want


def test_scalars_flatten_a_history_record():
    rec = {"step": 3, "loss": 0.5, "val": {"add": 0.25, "rev": 1}, "phase": "warmstart", "kl/add": 0.1, "ok": True}
    assert dict(scalars(rec)) == {"loss": 0.5, "val/add": 0.25, "val/rev": 1.0, "kl/add": 0.1, "ok": 1.0}


def test_gspo_writes_every_metric_and_a_resume_logs_no_step_twice(trained_pico_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.expert.spec import ExpertSpec
    from opd.expert.trainer import train

    tok = AutoTokenizer.from_pretrained(trained_pico_dir)
    # checkpoints at step 2 only: the second run resumes there and logs step 3 again, as a run
    # killed after logging step 3 would
    spec = ExpertSpec(capability="count", base=str(trained_pico_dir), steps=3, eval_every=2, checkpoint_every=2,
                      gspo={"prompts_per_step": 2, "group_size": 4, "updates_per_batch": 1, "lr": 1e-3,
                            "drop_zero_variance": False, "min_informative": 0.0})
    tb, ckpt = tracking_dir(tmp_path / "count"), tmp_path / ".count.ckpt" / "state.pt"
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
        with open_tracker(spec.report_to, tb) as tracker:
            state = train(spec.gspo, spec.run_settings(), model, tok, ckpt, evaluate_fn=lambda m: 0.5,
                          log=lambda *_: None, tracker=tracker)
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2  # two sessions, one directory
    got = curves(tb)
    assert got == history_steps(state.history, {"val": [0]})  # val: the start's screening, then step 2
    for tag in ("reward", "clip_fraction", "ratio_min", "ratio_max", "informative", "loss", "grad_norm", "entropy"):
        assert got[tag] == [1, 2, 3], tag


def test_opd_run_writes_each_teachers_kl(tmp_path):
    from opd.distill.config import DistillRun
    from opd.distill.run import run_distill

    lab = build_fake_lab(tmp_path / "lab", ("count", "rev"))
    out = tmp_path / "runs" / "distill" / "d"
    run = DistillRun(name="d", base=str(lab["base"]), teachers=[str(p) for p in lab["experts"].values()],
                     out=str(out), distill={"steps": 3, "prompts_per_step": 4, "group_size": 2})
    run_distill(run, log=lambda *_: None, evaluate=False)
    history = json.loads((out / "history.json").read_text())
    got = curves(tracking_dir(out))
    assert got == history_steps(history)
    assert {"kl/count", "kl/rev", "loss", "grad_norm", "lr", "gen_tokens"} <= set(got)
    assert got["loss"] == [1, 2, 3]
    assert tracking_dir(out) == tmp_path / "runs" / "distill" / "tb" / "d"


def test_base_pretraining_writes_loss_every_step_and_screens(tmp_path):
    from opd.lab.base import BaseSpec, build_base
    from opd.lab.pico import PICO

    spec = BaseSpec(capabilities=["count"], mixture={"count": 1.0}, steps=4, eval_every=2, eval_limit=4,
                    batch_size=4, warmup=0, shape=PICO, threads=1)
    out = tmp_path / "runs" / "base"
    manifest = build_base(spec, out, log=lambda *_: None)
    got = curves(tracking_dir(out))
    assert got["loss"] == got["lr"] == [1, 2, 3, 4]
    assert got["val/count"] == got["in_band"] == [r["step"] for r in manifest["history"]] == [2, 4]
    # where the curves go changes no weights: the same build, not another one
    assert spec.model_copy(update={"report_to": "none"}).training_fields() == spec.training_fields()


def test_report_to_none_writes_nothing(tmp_path):
    with open_tracker("none", tmp_path / "tb") as tracker:
        tracker.log({"loss": 1.0}, 1)
    assert not (tmp_path / "tb").exists()
    with open_tracker("tensorboard", tmp_path / "tb") as tracker:
        tracker.log({"loss": math.nan, "val": {"add": 0.5}}, 1)
    assert curves(tmp_path / "tb") == {"loss": [1], "val/add": [1]}


def test_report_to_does_not_change_an_experts_identity():
    from opd.distill.config import DistillConfig
    from opd.distill.loop import run_identity
    from opd.expert.spec import ExpertSpec, same_spec

    spec = ExpertSpec(capability="count")
    assert same_spec(spec.model_dump(mode="json"), spec.model_copy(update={"report_to": "none"}))
    recorded = spec.model_dump(mode="json")
    del recorded["report_to"]  # a manifest written before the field existed
    assert same_spec(recorded, spec)
    assert run_identity(DistillConfig()) == run_identity(DistillConfig(report_to="none"))


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_when_not_installed_is_one_line(tmp_path, capsys, monkeypatch):
    from opd.distill.config import DistillConfig
    from opd.expert.cli import train_main
    from opd.expert.spec import load_expert_spec

    spec = tmp_path / "count.yaml"
    spec.write_text("capability: count\n")
    with pytest.raises(OpdError) as e:
        load_expert_spec(spec, report_to="wandb")
    msg = str(e.value)
    assert "\n" not in msg and str(spec) in msg and "pip install wandb" in msg
    with pytest.raises(OpdError, match="pip install wandb"):
        DistillConfig(report_to="wandb")
    with pytest.raises(OpdError, match="pip install wandb"):
        open_tracker("wandb", tmp_path / "tb")
    # the command line: one line on stderr, exit code 2, before anything loads
    monkeypatch.setenv("OPD_VERBOSE", "1")  # keep this process's console settings as they are
    with pytest.raises(SystemExit) as exit_:  # scripts/train_expert.py and `opd train-expert` run it
        train_main([str(spec), "report_to=wandb"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert exit_.value.code == 2 and len(err) == 1 and "wandb" in err[0], err


def test_expert_run_writes_its_curves_beside_the_expert(trained_pico_dir, tmp_path):
    from opd.expert.run import run_expert
    from opd.expert.spec import ExpertSpec

    spec = ExpertSpec(capability="count", base=str(trained_pico_dir), steps=2, eval_every=1, eval_limit=4,
                      threads=1, score_capabilities=["count"],
                      gspo={"prompts_per_step": 2, "group_size": 2, "updates_per_batch": 1, "min_informative": 0.0})
    out = tmp_path / "experts" / "count"
    manifest = run_expert(spec, out)
    got = curves(out.parent / "tb" / "count")
    assert got == history_steps(manifest["train"]["history"], {"val": [0]})
