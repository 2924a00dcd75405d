"""The GSPO trainer under DeepSpeed ZeRO-2 on the CPU (gloo): one process in CI, two ranks when slow.

The first DeepSpeed start on a machine compiles a small C++ op (about 45 s, cached afterwards in
~/.cache/torch_extensions), so the CI test pays that once.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opd.gspo.ds import init_process_env

ROOT = Path(__file__).resolve().parents[1]
ZERO2 = {"zero_optimization": {"stage": 2}}


def _spec(tmp_path, base, **extra):
    body = {"capability": "count", "base": str(base), "steps": 2, "eval_every": 1, "eval_limit": 10,
            "checkpoint_every": 1, "threads": 1, "score_capabilities": ["count"], "deepspeed": ZERO2,
            "gspo": {"prompts_per_step": 4, "group_size": 4, "updates_per_batch": 2, "lr": 1e-3,
                     "eps_low": 0.2, "eps_high": 0.28, "min_informative": 0.0}, **extra}
    p = tmp_path / "count.yaml"
    p.write_text(yaml.safe_dump(body))
    return p


def _env(tmp_path):
    # A clean rendezvous: variables left over from an outer launcher would make this a rank of it.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OPD_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


def _check_expert(out: Path, steps: int):
    from transformers import AutoModelForCausalLM

    m = json.loads((out / "manifest.json").read_text())
    assert m["train"]["steps"] == steps and m["spec"]["deepspeed"] == ZERO2
    assert any(r.get("grad_norm", 0) > 0 for r in m["train"]["history"])  # the engine did step
    AutoModelForCausalLM.from_pretrained(out)


def test_process_env_single_and_launched(monkeypatch):
    for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    assert init_process_env() == (0, 1)
    assert int(os.environ["MASTER_PORT"]) > 0
    # under a launcher its values win
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.delenv("LOCAL_RANK")
    assert init_process_env() == (1, 2)
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["MASTER_PORT"] == "29999"


def test_zero2_single_process_cli(trained_pico_dir, tmp_path):
    spec = _spec(tmp_path, trained_pico_dir)
    out = tmp_path / "experts" / "count"
    r = subprocess.run([sys.executable, str(ROOT / "scripts/train_expert.py"), str(spec), "--out", str(out)],
                       cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    _check_expert(out, 2)


@pytest.mark.slow
def test_zero2_two_cpu_ranks_torchrun(trained_pico_dir, tmp_path):
    """Two gloo ranks on one machine: torchrun sets RANK/WORLD_SIZE/MASTER_* for each."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    spec = _spec(tmp_path, trained_pico_dir)
    out = tmp_path / "experts" / "count"
    r = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(ROOT / "scripts/train_expert.py"),
                        str(spec), "--out", str(out)], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    _check_expert(out, 2)
    # one expert, written once: no leftover temp or backup directories from a second writer
    assert sorted(p.name for p in out.parent.iterdir() if p.name != ".history") == ["count"]


def test_zero2_optimizer_state_round_trip(tmp_path, monkeypatch):
    """A ZeRO-2 optimizer's state, saved as the trainer's checkpoint does, restores into a new engine.

    The trainer does not do this yet: it loads the checkpoint's optimizer state into the torch
    AdamW before `wrap` (KeyError 'param_groups' on resume); it must call `load_optimizer_state`
    on the optimizer `wrap` returns.
    """
    import torch

    from opd.expert.spec import ExpertSpec
    from opd.gspo.ds import deepspeed_wrap, load_optimizer_state
    from opd.lab.model import ModelShape, build_model
    from opd.lab.tokenizer import build_char_tokenizer

    for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    spec = ExpertSpec(capability="count", deepspeed=ZERO2)
    tok = build_char_tokenizer()
    shape = ModelShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64)
    ids = torch.randint(3, len(tok), (4, 12))

    def engine(model):
        return deepspeed_wrap(spec)(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    first, opt, backward = engine(build_model(shape, tok, seed=0))
    for _ in range(2):
        backward(first(input_ids=ids, labels=ids).loss)
    saved = torch.load(_roundtrip(tmp_path, opt.state_dict()), weights_only=False)

    second, opt2, backward2 = engine(build_model(shape, tok, seed=1))
    second.module.load_state_dict(first.module.state_dict())
    load_optimizer_state(opt2, saved)
    # one more identical step from identical weights and moments: identical results
    backward(first(input_ids=ids, labels=ids).loss)
    backward2(second(input_ids=ids, labels=ids).loss)
    for (k, a), b in zip(first.module.state_dict().items(), second.module.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


def _roundtrip(tmp_path, obj):
    import torch

    path = tmp_path / "optim.pt"
    torch.save(obj, path)
    return path
