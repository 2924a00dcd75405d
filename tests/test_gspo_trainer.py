"""The GSPO loop on a pico model: stats, learning signal, resume after SIGKILL, manifest."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from opd.expert.spec import ExpertSpec, load_expert_spec
from opd.expert.trainer import train
from opd.rl.batch import (
    completion_logits,
    completion_targets,
    group_rollouts,
    grouped_completion_logits,
    pad_sequences,
    token_logprobs,
)

ROOT = Path(__file__).resolve().parents[1]


def test_train_loop_stats_and_checkpoint(trained_pico_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    tok = AutoTokenizer.from_pretrained(trained_pico_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spec = ExpertSpec(capability="count", base=str(trained_pico_dir), steps=3, eval_every=2, checkpoint_every=1,
                      gspo={"prompts_per_step": 4, "group_size": 4, "updates_per_batch": 2, "lr": 1e-3,
                            "eps_low": 0.2, "eps_high": 0.28, "min_informative": 0.0})
    screens = []
    state = train(spec.gspo, spec.run_settings(), model, tok, tmp_path / "ck" / "state.pt",
                  evaluate_fn=lambda m: screens.append(1) or 0.5, log=lambda *_: None)
    assert state.step == 3 and len(state.history) == 3 and len(screens) == 2  # step 0 and step 2
    rec = [r for r in state.history if "clip_fraction" in r][0]
    for key in ("reward", "informative", "ratio_mean", "clip_fraction", "grad_norm", "entropy",
                "rollout_tok_s", "train_tok_s", "logprob_mismatch"):
        assert key in rec, key
    # trainer-recomputed old logprobs match the engine's: same weights, same maths
    assert rec["logprob_mismatch"] < 1e-4
    assert (tmp_path / "ck" / "state.pt").exists()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # rerun: the progress bar hears the resumed step (3 of 3 here) instead of starting at 0
    seen = []
    train(spec.gspo, spec.run_settings(), AutoModelForCausalLM.from_pretrained(trained_pico_dir), tok,
          tmp_path / "ck" / "state.pt",
          evaluate_fn=lambda m: 0.5, log=lambda *_: None, progress=lambda st, rec: seen.append((st.step, rec is None)))
    assert seen == [(3, True)]


def _write_spec(tmp_path, base, **extra):
    body = {"capability": "count", "base": str(base), "steps": 6, "eval_every": 3, "eval_limit": 20,
            "checkpoint_every": 1, "threads": 1, "score_capabilities": ["count", "rev"],
            "gspo": {"prompts_per_step": 4, "group_size": 4, "updates_per_batch": 2, "lr": 1e-3,
                     "eps_low": 0.2, "eps_high": 0.28}, **extra}
    p = tmp_path / "count.yaml"
    p.write_text(yaml.safe_dump(body))
    return p


@pytest.mark.parametrize("ds", [None, {"zero_optimization": {"stage": 2}}], ids=["torch", "zero2"])
def test_cli_resumes_after_sigkill(trained_pico_dir, tmp_path, ds):
    # under ZeRO-2 the checkpoint holds DeepSpeed's optimizer state, which a weights-only load must accept
    spec = _write_spec(tmp_path, trained_pico_dir, steps=40, **({"deepspeed": ds} if ds else {}))
    out = tmp_path / "experts" / "count"
    env = {**os.environ, "OPD_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, str(ROOT / "scripts/train_expert.py"), str(spec), "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "experts" / ".count.ckpt" / "state.pt"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists() and torch.load(ckpt, weights_only=False)["state"]["step"] >= 3:
            break
        time.sleep(0.5)
    assert proc.poll() is None, "run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(ckpt, weights_only=False)["state"]["step"]
    assert 3 <= killed_at < 40 and not out.exists()
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming count at step {killed_at}" in r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["train"]["steps"] == 40 and m["capability"] == "count"
    assert set(m["metrics"]["test"]) == {"count", "rev"} and m["metrics"]["test"]["count"]["n"] == 300
    assert m["base"]["content_hash"] and m["content_hash"] and m["spec"]["gspo"]["eps_low"] == 0.2
    assert not ckpt.parent.exists()  # checkpoints are cleaned once the expert is registered


def test_retrain_keeps_previous_version(trained_pico_dir, tmp_path):
    spec = _write_spec(tmp_path, trained_pico_dir, steps=1, eval_every=1)
    out = tmp_path / "experts" / "count"
    env = {**os.environ, "OPD_CACHE": str(tmp_path / "cache")}
    for seed in (0, 1):
        subprocess.run([sys.executable, str(ROOT / "scripts/train_expert.py"), str(spec), f"seed={seed}",
                        "--out", str(out)], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    m = json.loads((out / "manifest.json").read_text())
    assert m["version"] == 2
    old = list((tmp_path / "experts" / ".history" / "count").glob("v1-*"))
    assert len(old) == 1 and (old[0] / "manifest.json").exists()


def test_every_shipped_expert_spec_loads():
    specs = sorted((ROOT / "experts").glob("*.yaml"))
    assert len(specs) >= 10
    for p in specs:
        spec = load_expert_spec(p)
        assert spec.expert_name == p.stem


@pytest.mark.slow
def test_spec_recorded_before_a_field_was_added_is_the_same_spec():
    """A manifest written before a new spec field existed must not force a retrain."""
    from opd.expert.spec import same_spec

    spec = ExpertSpec(capability="count")
    stored = spec.model_dump(mode="json")
    del stored["reward_timeout_s"]  # as written by an older opd
    assert same_spec(stored, spec)
    assert not same_spec({**stored, "seed": 1}, spec)
    assert not same_spec({"capability": "nope"}, spec)


def test_loop_settings_resume_only_a_checkpoint_of_the_same_spec(tmp_path, pico_model):
    """The loop takes settings, not the spec, yet refuses another spec's checkpoint as `same_spec` does:
    a changed seed starts fresh; where the curves go, or a field an older opd did not record, does not."""
    import random

    from opd.expert.settings import GSPORun
    from opd.expert.trainer import RunState, checkpointer

    spec = ExpertSpec(capability="count", steps=3)
    run = spec.run_settings()
    assert (run.name, run.capability, run.steps, run.job) == ("count", "count", 3, spec.model_dump(mode="json"))
    # a default spec's run is the loop's default run (the two keep one set of defaults)
    assert ExpertSpec(capability="count").run_settings().model_dump(exclude={"job"}) == \
        GSPORun(name="count", capability="count").model_dump(exclude={"job"})
    path = tmp_path / "state.pt"
    checkpointer(path, run).save(pico_model, torch.optim.AdamW(pico_model.parameters()), RunState(step=2).__dict__,
                                 random.Random(0))

    def resumed(other: ExpertSpec) -> bool:
        return checkpointer(path, other.run_settings(), log=lambda *_: None).latest() is not None

    assert resumed(spec) and resumed(spec.model_copy(update={"report_to": "none"}))
    assert not resumed(spec.model_copy(update={"seed": 1}))
    older = torch.load(path, weights_only=False)
    del older["spec"]["reward_timeout_s"]  # as written by an older opd
    del older["ranks"]  # older checkpoints recorded no ranks
    torch.save(older, path)
    assert resumed(spec)


@pytest.mark.parametrize("completions", [[[5, 7, 2], [9], [5, 59], [3, 3, 3], [8, 2]], [[5], [9], [7], [3], [8]]],
                         ids=["ragged", "one-token"])
def test_grouped_logits_match_one_padded_forward(pico_model, tokenizer, completions):
    """Running each distinct prompt once and the completions on its KV cache gives the logprobs
    and gradients of the plain right-padded forward over every prompt+completion row."""
    a, b = (tokenizer(p, add_special_tokens=False).input_ids for p in ("12+7=", "reverse abc:"))
    prompts = [a, b, a, b, a]  # two groups, interleaved as a shuffled batch is
    pad = tokenizer.pad_token_id
    ids, attn, cmask, plen = pad_sequences(prompts, completions, pad)
    Tc = cmask.shape[1]
    batch = group_rollouts(prompts, completions, pad)
    assert batch.prompt_ids.shape[0] == 2 and batch.row_prompt.tolist() == [0, 1, 0, 1, 0]

    def plain(rows):  # (b, Tc), 0 past each completion
        logits = completion_logits(pico_model, ids[rows], attn[rows], plen[rows], Tc)
        return token_logprobs(logits, completion_targets(ids[rows], plen[rows], Tc)) * cmask[rows]

    def grouped(rows, n_grad=None):
        logits = grouped_completion_logits(pico_model, batch, rows, n_grad=n_grad)
        return token_logprobs(logits, batch.completion_ids[rows]) * batch.cmask[rows]

    def grads(loss):
        pico_model.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in pico_model.parameters() if p.grad is not None]

    everything = torch.arange(5)
    torch.testing.assert_close(grouped(everything), plain(everything), atol=1e-5, rtol=0)
    # rows 3 and 0 carry gradient, row 4 rides along without: its values still match
    rows = torch.tensor([3, 0, 4])
    got = grouped(rows, n_grad=2)
    torch.testing.assert_close(got, plain(rows), atol=1e-5, rtol=0)
    for g_got, g_ref in zip(grads(got.sum()), grads(plain(rows[:2]).sum()), strict=True):
        torch.testing.assert_close(g_got, g_ref, atol=1e-5, rtol=1e-4)
