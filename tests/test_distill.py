"""On-policy distillation: estimator maths by hand, routing, learning on a pico student, resume after SIGKILL."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from opd_kernels import reverse_kl, reverse_kl_from_logits
from test_merge_fakes import PICO, build_fake_lab

from opd.distill import DistillConfig, TeacherRef, distill, embedded_teacher, prompt_mix, resolve_routes
from opd.distill.teachers import completion_hidden
from opd.errors import OpdError
from opd.lab.model import build_model
from opd.rl.batch import pad_sequences
from opd.rl.distill_loss import mix_teacher_logprobs, reward_mixed_advantages, sampled_advantages

ROOT = Path(__file__).resolve().parents[1]


def test_reverse_kl_of_known_distributions():
    # p_s = (1/2, 1/2), p_t = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    ps, pt = torch.tensor([[0.5, 0.5]]), torch.tensor([[0.25, 0.75]])
    want = 0.5 * math.log(4 / 3)
    assert reverse_kl_from_logits(ps.log(), pt.log()).item() == pytest.approx(want, abs=1e-6)
    # the chunked kernel: hidden = log p, LM head = identity, so the logits are log p
    got = reverse_kl(ps.log(), torch.eye(2), teacher_logits=pt.log())
    assert got.item() == pytest.approx(want, abs=1e-6)
    assert reverse_kl_from_logits(pt.log(), pt.log()).item() == pytest.approx(0.0, abs=1e-7)


def test_sampled_estimator_expectation_and_gradient_match_full_kl():
    torch.manual_seed(0)
    zs = torch.randn(6, requires_grad=True)  # student logits over a 6-token vocabulary
    lt = torch.log_softmax(torch.randn(6), -1)
    ls = torch.log_softmax(zs, -1)
    kl = (ls.exp() * (ls - lt)).sum()
    # expectation of the per-token estimate log p_s(y) - log p_t(y) over y ~ p_s, computed exactly
    adv = sampled_advantages(ls.detach()[None], lt[None], torch.ones(1, 6))[0]  # (V,): A_y for each y
    assert (-(ls.exp() * adv).sum()).item() == pytest.approx(kl.item(), abs=1e-6)
    # policy gradient: E_y[-A_y grad log p_s(y)] equals grad KL, because E[grad log p_s] = 0
    surrogate = -(ls.exp().detach() * adv * ls).sum()
    (g_pg,) = torch.autograd.grad(surrogate, zs, retain_graph=True)
    (g_kl,) = torch.autograd.grad(kl, zs)
    assert torch.allclose(g_pg, g_kl, atol=1e-6)
    # and by Monte Carlo, as the loop sees it
    y = torch.multinomial(ls.exp().detach(), 200_000, replacement=True)
    assert (-adv[y].mean()).item() == pytest.approx(kl.item(), abs=0.02)


def test_teacher_mixture_and_reward_mix_by_hand():
    lp = torch.tensor([[[-1.0, -2.0]], [[-3.0, -4.0]]])  # (K=2, B=1, T=2)
    w = torch.tensor([[0.25], [0.75]])  # (K, B)
    # 0.25 * -1 + 0.75 * -3 = -2.5 ; 0.25 * -2 + 0.75 * -4 = -3.5
    assert torch.allclose(mix_teacher_logprobs(lp, w), torch.tensor([[-2.5, -3.5]]))
    mask = torch.tensor([[1.0, 0.0]])
    adv = sampled_advantages(torch.tensor([[-2.0, -9.0]]), torch.tensor([[-2.5, -3.5]]), mask)
    assert torch.allclose(adv, torch.tensor([[-0.5, 0.0]]))  # student more confident than teacher: pushed down
    mixed = reward_mixed_advantages(adv, torch.tensor([1.0]), 0.5, mask)
    assert torch.allclose(mixed, torch.tensor([[0.0, 0.0]]))


def test_routing_defaults_overrides_and_mix():
    caps = {"add_a": "add", "add_b": "add", "rev": "rev"}
    r = resolve_routes(caps, weights={"add_a": 3.0})
    assert r == {"add": {"add_a": 0.75, "add_b": 0.25}, "rev": {"rev": 1.0}}
    assert prompt_mix(r, teacher_weights={"add_a": 3.0}) == {"add": 0.8, "rev": 0.2}
    assert prompt_mix(r, mix={"add": 1.0, "rev": 3.0}) == {"add": 0.25, "rev": 0.75}
    # the routing key is overridable: rev's teacher also serves count, by path
    r = resolve_routes(caps, {"count": [TeacherRef(expert="experts/rev")], "add": [TeacherRef(expert="add_b")]})
    assert r == {"count": {"rev": 1.0}, "add": {"add_b": 1.0}}
    with pytest.raises(OpdError, match="not among the loaded teachers"):
        resolve_routes(caps, {"add": [TeacherRef(expert="nope")]})
    with pytest.raises(OpdError, match="no share given"):
        prompt_mix(r, mix={"add": 1.0})


def _exact_kl(student, teacher, tok, prompts: list[str]) -> float:
    """Mean full-vocabulary KL(student || teacher) on fixed teacher-forced answers to `prompts`."""
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    comp = [tok("2\n", add_special_tokens=False).input_ids for _ in prompts]
    x, attn, cmask, plen = pad_sequences(ids, comp, tok.pad_token_id)
    with torch.no_grad():
        hs = completion_hidden(student, x, attn, plen, cmask.shape[1])[cmask.bool()]
        ht = completion_hidden(teacher, x, attn, plen, cmask.shape[1])[cmask.bool()]
        w_s, w_t = student.get_output_embeddings().weight, teacher.get_output_embeddings().weight
        return float(reverse_kl(hs, w_s, ht, w_t).mean())


@pytest.mark.parametrize("estimator,layout", [("sampled", "padded"), ("full", "padded"), ("full", "packed"),
                                              ("sampled", "packed")])
def test_opd_lowers_student_kl_to_teacher(trained_pico_dir, tokenizer, estimator, layout):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    student = build_model(PICO, tokenizer, seed=0)
    prompts = ["#a:abca=", "#b:bbdd=", "#c:acdcab=", "#d:ddda="]
    before = _exact_kl(student, teacher, tokenizer, prompts)
    cfg = DistillConfig(estimator=estimator, steps=30, lr=3e-3, prompts_per_step=8, group_size=4, layout=layout)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    state = distill(cfg, student, tokenizer, teachers, resolve_routes({"count": "count"}), log=lambda *_: None)
    after = _exact_kl(student, teacher, tokenizer, prompts)
    assert after < 0.8 * before, (before, after)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    rec = state.history[-1]
    assert {"kl/count", "reward/count", "loss", "grad_norm", "gen_tokens"} <= set(rec)
    assert state.gen_tokens == rec["gen_tokens"] > 0


def test_reward_mix_and_retention_are_logged(trained_pico_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    student = build_model(PICO, tokenizer, seed=0)
    cfg = DistillConfig(steps=2, prompts_per_step=4, group_size=2, reward_weight=0.5, eval_every=1)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    state = distill(cfg, student, tokenizer, teachers, resolve_routes({"count": "count"}), log=lambda *_: None,
                    evaluate_fn=lambda m: {"count": 0.3}, references={"count": 0.6})
    assert all(r["retention/count"] == pytest.approx(0.5) and r["min_retention"] == pytest.approx(0.5)
               for r in state.history)


def test_adaptive_mix_by_hand():
    from opd.distill.loop import adapted_mix

    mix = {"a": 0.5, "b": 0.25, "c": 0.25}
    history = [{"step": 1, "min_retention": 0.5, "retention/a": 0.5, "retention/b": 1.2, "retention/c": 0.9},
               {"step": 2, "loss": 0.1}]
    # raw a: 0.5 * (1 + 2 * 0.5) = 1.0, b: 0.25 (above its teacher: no boost), c: 0.25 * 1.2 = 0.3
    assert adapted_mix(mix, history, 2.0) == pytest.approx({"a": 1.0 / 1.55, "b": 0.25 / 1.55, "c": 0.3 / 1.55})
    assert adapted_mix(mix, history, 0.0) == mix and adapted_mix(mix, history[1:], 2.0) == mix
    with pytest.raises(ValueError, match="set eval_every > 0"):
        DistillConfig(adaptive_mix=1.0)


def test_cosine_schedule_is_logged_and_pins_steps_for_resume(trained_pico_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from opd.distill.loop import run_identity, step_lr

    cfg = DistillConfig(steps=4, lr=1e-3, lr_schedule="cosine", lr_min_ratio=0.1, prompts_per_step=2, group_size=2)
    assert step_lr(cfg, 0) == pytest.approx(1e-3) and step_lr(cfg, 3) == pytest.approx(1e-4)
    assert step_lr(cfg.model_copy(update={"lr_schedule": "constant"}), 3) == pytest.approx(1e-3)
    # extending a cosine run changes every lr after step 0, so it must not resume the shorter run
    assert run_identity(cfg) != run_identity(cfg.model_copy(update={"steps": 8}))
    const = cfg.model_copy(update={"lr_schedule": "constant"})
    assert run_identity(const) == run_identity(const.model_copy(update={"steps": 8}))
    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    state = distill(cfg, build_model(PICO, tokenizer, seed=0), tokenizer, teachers,
                    resolve_routes({"count": "count"}), log=lambda *_: None)
    lrs = [r["lr"] for r in state.history]
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4) and lrs == sorted(lrs, reverse=True)


def test_cli_resumes_after_sigkill(tmp_path):
    lab = build_fake_lab(tmp_path / "lab", ("count", "rev"))
    run = {"name": "r", "base": str(lab["base"]), "teachers": [str(p) for p in lab["experts"].values()],
           "out": str(tmp_path / "out"), "distill": {"steps": 100_000, "prompts_per_step": 2, "group_size": 2,
                                                      "checkpoint_every": 1}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    cmd = [sys.executable, "-m", "opd.distill", str(path), "--no-eval"]
    env = {**os.environ, "OPD_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / ".out.ckpt" / "state.pt"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists() and torch.load(ckpt, weights_only=False)["state"]["step"] >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(ckpt, weights_only=False)["state"]["step"]
    # same run, more modest step count: steps may change on resume, the trajectory does not
    r = subprocess.run([*cmd, f"distill.steps={killed_at + 2}"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming distillation at step {killed_at}" in r.stderr
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["train"]["steps"] == killed_at + 2 and m["kind"] == "distilled"
    assert set(m["routes"]) == {"count", "rev"} and m["inputs"]["teachers"]["rev"]["content_hash"]
    hist = json.loads((tmp_path / "out" / "history.json").read_text())
    assert [h["step"] for h in hist] == list(range(1, killed_at + 3))
    assert not ckpt.parent.exists()


@pytest.mark.parametrize("match", [["--target", "0.5"], ["--match-gspo"]])
def test_bench_fast_path_runs(tmp_path, match):
    env = {**os.environ, "OPD_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(ROOT / "bench/bench_opd.py"), "--fake", "--experts", "count,rev",
                        "--prompts", "2", "--group", "2", "--out", str(tmp_path / "b.json"), *match],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "b.json").read_text())
    # a ratio only when the target is above the start model's score
    gain = res["args"]["min_gain"]
    assert ("tokens GSPO / OPD" in r.stdout) == (res["target"] >= res["start"] + gain) == (res["ratio"] is not None)
    assert "threads 1" in r.stdout
    assert res["OPD"]["tokens"] > 0 and res["GSPO"]["tokens"] > 0
    assert all(len(res[k]["curve"]) == res[k]["steps"] for k in ("OPD", "GSPO"))  # --fake evaluates every step
    if "--match-gspo" in match:  # OPD's target is GSPO's best, reached or not
        assert res["target"] == res["GSPO"]["best_mean_val"] == max(v for _, v in res["GSPO"]["curve"])


def test_rerun_of_a_finished_run_does_nothing(tmp_path):
    """A run killed after writing its student and removing its checkpoint (the process was still
    shutting down) leaves what a finished run leaves: its rerun must not train it all over again."""
    from opd.distill.config import DistillRun
    from opd.distill.run import run_distill

    lab = build_fake_lab(tmp_path / "lab", ("count",))
    run = DistillRun(name="d", base=str(lab["base"]), teachers=[str(lab["experts"]["count"])],
                     out=str(tmp_path / "out"), distill={"steps": 2, "prompts_per_step": 2, "group_size": 2})
    first = run_distill(run, log=lambda *_: None, evaluate=False)
    weights = tmp_path / "out" / "model.safetensors"
    written = weights.stat().st_mtime_ns
    stale = tmp_path / ".out.ckpt"  # as if killed while removing it
    stale.mkdir()
    logs = []
    assert run_distill(run, log=logs.append, evaluate=False) == first
    assert any("nothing to do" in m for m in logs) and not any("opd step" in m for m in logs)
    assert weights.stat().st_mtime_ns == written and not stale.exists()
    # another run into the same directory (more steps, scored, or --fresh) trains
    longer = run.model_copy(update={"distill": run.distill.model_copy(update={"steps": 3})})
    for again, kwargs in ((run, {"evaluate": True}), (longer, {"evaluate": False}),
                          (run, {"evaluate": False, "fresh": True})):
        logs = []
        run_distill(again, log=logs.append, **kwargs)
        assert any("opd step 1/" in m for m in logs), kwargs


def test_run_config_refusals_and_server_teachers(tmp_path, tokenizer):
    from opd.distill.config import load_run
    from opd.distill.run import load_teachers
    from opd.rollout.sglang import SGLangEngine

    lab = build_fake_lab(tmp_path / "lab", ("count",))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"teachers": [str(lab["experts"]["count"])],
                                    "teacher_servers": {"count": "http://127.0.0.1:1"}}))
    assert load_run(path).name == "run"
    with pytest.raises(OpdError, match="full estimator reads teachers' hidden states"):
        load_run(path, ["distill.estimator=full"])
    with pytest.raises(OpdError, match="field 'distill.bogus'"):
        load_run(path, ["distill.bogus=1"])
    teachers, manifests = load_teachers([str(lab["experts"]["count"])], tokenizer, {"count": "http://127.0.0.1:1"})
    assert isinstance(teachers["count"].engine, SGLangEngine) and teachers["count"].model is None
    assert manifests["count"]["capability"] == "count"


def test_student_from_a_merge_of_the_teachers(tmp_path):
    from opd.distill.config import DistillRun
    from opd.distill.run import run_distill

    lab = build_fake_lab(tmp_path / "lab", ("count", "rev"))
    merge = {"strategy": "linear", "per_model": {"count": {"weight": 1.0}, "rev": {"weight": 1.0}}}
    run = DistillRun(name="m", base=str(lab["base"]), teachers=[str(p) for p in lab["experts"].values()],
                     student_merge=merge, out=str(tmp_path / "out"),
                     distill={"steps": 1, "prompts_per_step": 2, "group_size": 2, "estimator": "full"})
    m = run_distill(run, log=lambda *_: None, evaluate=False)
    from safetensors.torch import load_file

    # the student started from the mean of the two teachers, then took one step away from it
    a, b = (load_file(p / "model.safetensors") for p in lab["experts"].values())
    k = "model.layers.0.mlp.up_proj.weight"
    start = (a[k] + b[k]) / 2
    got = load_file(tmp_path / "out" / "model.safetensors")[k]
    # one AdamW step at lr 3e-4 moves a weight by about 3e-4; the teachers sit ~1e-2 from their mean
    assert (got - start).abs().max() < 1e-3 < (a[k] - start).abs().max()
    assert m["student_init_hash"] != m["content_hash"] and m["run"]["student_merge"]["strategy"] == "linear"


def test_bench_reuses_a_matching_gspo_run_only(tmp_path):
    env = {**os.environ, "OPD_CACHE": str(tmp_path / "cache")}
    bench = [sys.executable, str(ROOT / "bench/bench_opd.py"), "--fake", "--experts", "count,rev",
             "--prompts", "2", "--group", "2", "--match-gspo"]

    def run(*extra):
        return subprocess.run([*bench, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert run("--out", str(tmp_path / "a.json")).returncode == 0
    r = run("--reuse-gspo", str(tmp_path / "a.json"), "--opd", "group_size=1", "--out", str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert b["GSPO"] == a["GSPO"] and "GSPO: reused" in r.stdout
    assert (b["opd_config"]["group_size"], a["opd_config"]["group_size"]) == (1, 2)
    r = run("--reuse-gspo", str(tmp_path / "a.json"), "--lr", "1e-3")  # another GSPO run: refused
    assert r.returncode != 0 and "GSPO settings differ" in r.stderr
