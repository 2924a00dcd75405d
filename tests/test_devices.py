"""Every stage on a device: the settings' `device`/`dtype` fields, and a CPU check that every training,
sampling and scoring batch is built on the model's device.

On a CPU-only machine the model and a careless `torch.tensor(...)` land on the same device, so a plain
run cannot tell them apart. `OnModelDevice` (a torch function mode) can: it follows where each tensor
opd's code makes was put. A tensor opd builds with `device=` (or moves with `.to(device)`) is on the
model's device, as are the model's parameters and whatever is computed from them; one built without a
device is on the host, and so is anything computed from it alone. An op that mixes a host tensor (of
one or more dimensions: CUDA takes CPU scalars) with a device tensor is what fails on a GPU ("Expected
all tensors to be on the same device"), and fails here too. It catches tensors made without `device=`
and never moved; it cannot catch a hard-coded `.to("cpu")` (on this machine that is the model's device).
"""

from __future__ import annotations

import copy
import random
import sys
import traceback
from pathlib import Path

import opd_kernels
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import opd
from opd.devices import DeviceName, device_problem, model_device, place, resolve_device, resolve_dtype

OPD_SOURCES = (str(Path(opd.__file__).parent), str(Path(opd_kernels.__file__).parent))
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange,
             torch.randperm, torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace}
# copying a host tensor into part of a device tensor is a host-to-device copy, which CUDA does
COPIES = {torch.Tensor.__setitem__, torch.Tensor.copy_}
HOST, DEVICE = "host", "device"


def _where(t: torch.Tensor) -> str | None:
    return DEVICE if isinstance(t, torch.nn.Parameter) else getattr(t, "_opd_where", None)


def _mark(out, where: str) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            t._opd_where = where


def _opd_frame() -> str:
    """The innermost frame of opd's own code on the stack, for the failure message."""
    for f in reversed(traceback.extract_stack()):
        if f.filename.startswith(OPD_SOURCES):
            return f"{Path(f.filename).name}:{f.lineno} {f.line}"
    return "?"


class OnModelDevice(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            if sys._getframe(1).f_code.co_filename.startswith(OPD_SOURCES):
                _mark(out, DEVICE if kwargs.get("device") is not None else HOST)
            return out
        if func is torch.Tensor.to:
            named = kwargs.get("device") is not None or any(
                isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])
            if named:
                _mark(out, DEVICE)
                return out
        if func is torch.Tensor.cuda:
            _mark(out, DEVICE)
            return out
        if func is torch.Tensor.cpu:
            _mark(out, HOST)
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        where = {_where(t) for t in tensors}
        host = [t for t in tensors if _where(t) == HOST and t.dim() > 0]
        if func not in COPIES and host and DEVICE in where:
            raise AssertionError(f"{getattr(func, '__name__', func)} mixes a tensor built off the model's device "
                                 f"(shape {tuple(host[0].shape)}) with the model's: {_opd_frame()}")
        if func not in COPIES:
            _mark(out, DEVICE if DEVICE in where else HOST if HOST in where else None) \
                if where - {None} else None
        return out


def _gspo_kept(model, tokenizer, prompts=("12+3=", "7-2="), group=3):
    from opd.rollout import SamplingParams, get_engine

    engine = get_engine("embedded", model=model, tokenizer=tokenizer)
    groups = engine.generate(list(prompts), group, SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))
    return [(g, [float(i % 2) for i in range(len(g))]) for g in groups]


def test_the_check_fails_on_a_batch_built_off_the_model_device(pico_model, tokenizer):
    """The check itself: a batch built with torch.tensor(...) and no device fails it, the same batch
    built on the model's device passes."""
    from opd.rl.batch import group_rollouts, grouped_completion_logits

    rows = [r for g, _ in _gspo_kept(pico_model, tokenizer) for r in g]
    P, C = [r.prompt_ids for r in rows], [r.completion_ids for r in rows]
    with OnModelDevice(), torch.no_grad():
        grouped_completion_logits(pico_model, group_rollouts(P, C, tokenizer.pad_token_id, model_device(pico_model)))
        with pytest.raises(AssertionError, match="off the model's device"):
            ids = torch.tensor([P[0]])  # what a careless loop does (here in the test's frame: marked by hand)
            ids._opd_where = HOST
            pico_model(input_ids=ids)


def test_gspo_step_and_rollout_build_on_the_model_device(pico_model, tokenizer):
    from opd.expert.settings import GSPOConfig
    from opd.expert.trainer import gspo_step

    g = GSPOConfig(prompts_per_step=2, group_size=3, updates_per_batch=2, kl_coef=0.1)
    opt = torch.optim.AdamW(pico_model.parameters(), lr=1e-3)
    ref = copy.deepcopy(pico_model).eval()
    with OnModelDevice():
        kept = _gspo_kept(pico_model, tokenizer)  # the rollout: the embedded engine's batches
        st = gspo_step(pico_model, opt, ref, kept, g, tokenizer.pad_token_id)
    assert st["trained_tokens"] > 0


@pytest.mark.parametrize("estimator, stacked", [("sampled", False), ("full", True), ("full", False)])
def test_opd_step_builds_on_the_model_device(pico_model, tokenizer, estimator, stacked):
    from opd.distill.batch import build_batch, sample_batch
    from opd.distill.config import DistillConfig
    from opd.distill.loop import StudentHidden, opd_step
    from opd.distill.routing import resolve_routes
    from opd.distill.teacher_bank import TeacherBank
    from opd.distill.teachers import embedded_teacher
    from opd.rollout import get_engine

    torch.manual_seed(1)
    teachers = {}
    for i, cap in enumerate(["count", "rev"]):
        m = copy.deepcopy(pico_model)
        for p in m.parameters():
            p.data += 0.05 * torch.randn_like(p)
        teachers[f"t{i}"] = embedded_teacher(f"t{i}", cap, m, tokenizer)
    routes = resolve_routes({n: t.capability for n, t in teachers.items()})
    cfg = DistillConfig(estimator=estimator, updates_per_batch=2, prompts_per_step=4, group_size=2)
    bank = TeacherBank(teachers, sorted(teachers)) if stacked else None
    opt = torch.optim.AdamW(pico_model.parameters(), lr=1e-3)
    engine = get_engine("embedded", model=pico_model, tokenizer=tokenizer)
    with OnModelDevice():
        items, groups = sample_batch(engine, routes, {"count": 1.0, "rev": 1.0}, random.Random(0), prompts=4,
                                     group=2, temperature=1.0, max_new_tokens=4, seed=0)
        batch = build_batch(pico_model, items, groups, teachers, routes, tokenizer.pad_token_id, bank=bank,
                            old_lp=estimator == "sampled")
        st = opd_step(StudentHidden(pico_model), opt, batch, cfg, teachers)
    assert st["loss"] == st["loss"]  # not NaN


def test_scoring_builds_on_the_model_device(pico_model, tokenizer):
    """A scoring pass: the embedded engine's scores and lm-eval through opd.evaluation."""
    from opd.evaluation.api import evaluate
    from opd.rollout import get_engine

    engine = get_engine("embedded", model=pico_model, tokenizer=tokenizer)
    with OnModelDevice():
        engine.score([[5, 6, 7], [8, 9]], [[10, 11], [12]])
        scores = evaluate(pico_model, tokenizer, ["count"], "val", limit=4, batch_size=4)
    assert 0 <= scores["count"].score <= 1


def test_device_and_dtype_resolve_on_this_machine():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32  # a CPU run stays what it was
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert "not a device" in device_problem("gpu")
    if not torch.cuda.is_available():
        assert "no CUDA device" in device_problem("cuda") and "no CUDA device" in device_problem("cuda:1")


def test_place_casts_parameters_not_buffers(pico_model):
    place(pico_model, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in pico_model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in pico_model.buffers() if b.is_floating_point()} <= {torch.float32}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("kind, text", [
    ("expert", "capability: count\ndevice: cuda\n"),
    ("base", None),
    ("distill", "teachers: [a]\ndevice: cuda:0\n"),
    ("merge", "experts: [a]\nstrategies: {linear: {weight: 1.0}}\ndevice: cuda\n"),
])
def test_cuda_without_cuda_is_one_line_naming_file_and_field(tmp_path, kind, text):
    import yaml

    from opd.errors import OpdError

    path = tmp_path / f"{kind}.yaml"
    if kind == "base":
        from opd.lab.base import DEFAULT_SPEC, load_base_spec

        raw = yaml.safe_load(DEFAULT_SPEC.read_text())
        path.write_text(yaml.safe_dump({**raw, "device": "cuda"}))
        load = load_base_spec
    else:
        path.write_text(text)
        if kind == "expert":
            from opd.expert.spec import load_expert_spec as load
        elif kind == "distill":
            from opd.distill.config import load_run as load
        else:
            from opd.merge.recipe import load_recipe as load
    with pytest.raises(OpdError) as e:
        load(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "device" in msg and "no CUDA device" in msg, msg


def test_cuda_without_cuda_exits_2_before_anything_is_written(tmp_path):
    import subprocess

    spec = tmp_path / "e.yaml"
    spec.write_text(f"capability: count\nbase: {tmp_path / 'nobase'}\ndevice: cuda\n")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "scripts/train_expert.py", str(spec), "--out", str(out)],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert r.returncode == 2, r.stderr
    assert "device" in r.stderr and "Traceback" not in r.stderr and not out.exists()


def test_where_a_run_ran_is_not_part_of_its_identity():
    """A spec or base recorded on a GPU is the same job on a CPU; a base's build key is unchanged by the
    new fields at their defaults (float32 here), so bases built before them are reused."""
    from opd.expert.spec import ExpertSpec, same_spec
    from opd.lab.base import DEFAULT_SPEC, load_base_spec, same_training

    spec = ExpertSpec(capability="count")
    assert same_spec({**spec.model_dump(mode="json"), "device": "cuda:3"}, spec)
    assert not same_spec({**spec.model_dump(mode="json"), "dtype": "bfloat16"}, spec)
    base = load_base_spec(DEFAULT_SPEC)
    fields = base.training_fields()
    assert "device" not in fields and "dtype" not in fields
    assert same_training(fields, base)
    assert not same_training(load_base_spec(DEFAULT_SPEC, dtype="bfloat16").training_fields(), base)


def test_device_name_field():
    from pydantic import BaseModel, ValidationError

    class S(BaseModel):
        device: DeviceName = "auto"

    assert S(device="cpu").device == "cpu"
    with pytest.raises(ValidationError):
        S(device="tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gspo_opd_and_merge_scoring_on_cuda_in_bf16():
    """One GSPO step, one OPD step (sampled and full) and one merge-candidate scoring on the GPU in bf16
    (scripts/gpu_check.py --steps; scripts/gpu_check.sh runs it on a lent machine)."""
    import subprocess

    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--steps"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert r.returncode == 0 and r.stdout.count("PASS") == 3, r.stdout + r.stderr


def test_a_bf16_expert_has_the_hash_a_float32_reader_computes(trained_pico_dir, tmp_path):
    """An expert trained with dtype: bfloat16 records the content hash the merge computes when it reads
    the saved expert back in float32 (opd.merge.recipe.load_inputs), and the base hash of the float32 base."""
    import json

    from transformers import AutoModelForCausalLM

    from opd.expert.run import run_expert
    from opd.expert.spec import ExpertSpec
    from opd.io import state_dict_hash

    spec = ExpertSpec(capability="count", base=str(trained_pico_dir), steps=1, eval_every=1, eval_limit=8,
                      threads=1, dtype="bfloat16", score_capabilities=["count"], report_to="none",
                      gspo={"prompts_per_step": 2, "group_size": 2, "updates_per_batch": 1, "lr": 1e-3})
    out = tmp_path / "experts" / "count"
    run_expert(spec, out=out)
    m = json.loads((out / "manifest.json").read_text())
    assert m["train"]["dtype"] == "bfloat16" and m["train"]["device"] == "cpu"
    assert m["base"]["content_hash"] == state_dict_hash(AutoModelForCausalLM.from_pretrained(trained_pico_dir,
                                                                                              dtype=torch.float32))
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert state_dict_hash(back) == m["content_hash"]


def test_scorer_in_another_dtype_scores_a_copy_and_leaves_the_merge_base(pico_model, tokenizer):
    """The merge search's scorer on `device` in `dtype`: merged state dicts stay on the CPU in float32 and
    are copied into the scorer's own model; the base the merges read is left as it was."""
    from opd.merge.references import Scorer
    from opd.merge.strategies import MergeInputs
    from opd.weights.merge import merge_keys

    inputs = MergeInputs(Path("."), pico_model, tokenizer, "", {}, {}, {}, ["count"])
    before = {k: v.clone() for k, v in pico_model.state_dict().items()}
    scorer = Scorer(inputs, batch_size=8, device="cpu", dtype=torch.bfloat16)
    sd = {k: v + 0.01 for k, v in merge_keys(pico_model.state_dict()).items()}  # a "merged" candidate
    with OnModelDevice():
        scorer.score(sd, "val", limit=4)
    assert next(scorer.model.parameters()).dtype is torch.bfloat16 and scorer.model is not pico_model
    emb = "model.embed_tokens.weight"
    torch.testing.assert_close(scorer.model.state_dict()[emb].float(), sd[emb].to(torch.bfloat16).float())
    assert all(torch.equal(v, before[k]) for k, v in pico_model.state_dict().items())
    assert Scorer(inputs, batch_size=8).model is pico_model  # CPU float32: the base model itself, as before
