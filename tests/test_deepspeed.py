"""The GSPO and OPD trainers under DeepSpeed ZeRO-2 on the CPU (gloo): one process in CI, two ranks
started by the `deepspeed` launcher (and torchrun) when slow.

The first DeepSpeed start on a machine compiles a small C++ op (about 45 s, cached afterwards in
~/.cache/torch_extensions), so the CI test pays that once.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_merge_fakes import build_fake_lab

from opd.errors import OpdError
from opd.rl.distributed import _free_port, init_process_env

ROOT = Path(__file__).resolve().parents[1]
ZERO2 = {"zero_optimization": {"stage": 2}}
LAUNCHER = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))


def _launcher(*args) -> list[str]:
    """Two CPU ranks on this machine: the launcher counts CPU devices by NUMA node (1 here) and
    `--num_gpus` overrides the count; our scripts read their rank from the environment."""
    return [LAUNCHER, "--num_gpus", "2", "--master_port", str(_free_port()), "--no_local_rank", *args]


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
    # (tb/: the TensorBoard curves, opd.tracking)
    assert sorted(p.name for p in out.parent.iterdir() if p.name not in (".history", "tb")) == ["count"]


def test_zero2_optimizer_state_round_trip(tmp_path, monkeypatch):
    """A ZeRO-2 optimizer's state, saved as the trainer's checkpoint does, restores into a new engine.

    The GSPO and OPD loops call `load_optimizer_state` on the optimizer `wrap` returns (loading it
    into the torch AdamW before `wrap` fails with KeyError 'param_groups'); the end-to-end resumes
    are test_gspo_trainer.py::test_cli_resumes_after_sigkill[zero2] and the OPD tests here.
    """
    import torch

    from opd.expert.spec import ExpertSpec
    from opd.lab.model import ModelShape, build_model
    from opd.lab.tokenizer import build_char_tokenizer
    from opd.rl.distributed import deepspeed_wrap, load_optimizer_state

    for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    spec = ExpertSpec(capability="count", deepspeed=ZERO2)
    tok = build_char_tokenizer()
    shape = ModelShape(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64)
    ids = torch.randint(3, len(tok), (4, 12))

    def engine(model):
        return deepspeed_wrap(spec.gspo.grad_clip, spec.deepspeed)(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

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


@pytest.mark.slow
def test_zero2_two_cpu_ranks_deepspeed_launcher(trained_pico_dir, tmp_path):
    spec = _spec(tmp_path, trained_pico_dir)
    out = tmp_path / "experts" / "count"
    r = subprocess.run(_launcher(str(ROOT / "scripts/train_expert.py"), str(spec), "--out", str(out)),
                       cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "dist_world_size=2" in r.stdout + r.stderr
    _check_expert(out, 2)
    # (tb/: the TensorBoard curves, opd.tracking)
    assert sorted(p.name for p in out.parent.iterdir() if p.name not in (".history", "tb")) == ["count"]


# On-policy distillation under DeepSpeed

def _clean_launcher_env(monkeypatch):
    """A world of one for in-process engines, undone after the test."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)


def _distill_run(tmp_path, **distill) -> Path:
    lab = build_fake_lab(tmp_path / "lab", ("count", "rev"))
    run = {"name": "r", "base": str(lab["base"]), "teachers": [str(p) for p in lab["experts"].values()],
           "out": str(tmp_path / "out"), "deepspeed": ZERO2,
           "distill": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "checkpoint_every": 1, "eval_limit": 4,
                       **distill}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def _check_student(out: Path, steps: int, ranks: int):
    from transformers import AutoModelForCausalLM

    m = json.loads((out / "manifest.json").read_text())
    assert m["kind"] == "distilled" and m["run"]["deepspeed"] == ZERO2
    assert m["train"]["steps"] == steps and m["train"]["ranks"] == ranks
    hist = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in hist] == list(range(1, steps + 1))
    assert any(h["grad_norm"] > 0 for h in hist)  # the engine did step
    AutoModelForCausalLM.from_pretrained(out)
    assert not (out.parent / f".{out.name}.ckpt").exists()
    return m


def test_distill_zero2_single_process_cli(tmp_path):
    path = _distill_run(tmp_path, eval_every=1)
    r = subprocess.run([sys.executable, "-m", "opd.distill", str(path)], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    m = _check_student(tmp_path / "out", 2, ranks=1)
    assert "min_retention" in m["final"]


def test_distill_zero2_matches_plain_torch_and_resumes(trained_pico_dir, tokenizer, tmp_path, monkeypatch):
    """One ZeRO-2 rank takes the steps plain torch takes (so the cosine lr reaches the engine's
    optimizer), across a stop and a resume that restores the ZeRO optimizer state too."""
    from transformers import AutoModelForCausalLM

    from opd.distill import DistillConfig, distill, embedded_teacher, resolve_routes
    from opd.lab.model import build_model
    from opd.lab.pico import PICO
    from opd.rl.distributed import deepspeed_wrap

    _clean_launcher_env(monkeypatch)
    teacher = AutoModelForCausalLM.from_pretrained(trained_pico_dir)
    teachers = {"count": embedded_teacher("count", "count", teacher, tokenizer)}
    routes = resolve_routes({"count": "count"})
    cfg = DistillConfig(steps=3, lr=3e-3, lr_schedule="cosine", prompts_per_step=4, group_size=2)
    plain = build_model(PICO, tokenizer, seed=0)
    ref = distill(cfg, plain, tokenizer, teachers, routes, log=lambda *_: None)

    wrap = deepspeed_wrap(cfg.grad_clip, ZERO2)
    ckpt = tmp_path / "ck" / "state.pt"
    cut = cfg.model_copy(update={"checkpoint_every": 1})
    distill(cut, build_model(PICO, tokenizer, seed=0), tokenizer, teachers, routes, ckpt, log=lambda *_: None,
            wrap=wrap, stop=lambda rec: rec["step"] == 2)
    student, logs = build_model(PICO, tokenizer, seed=0), []
    state = distill(cut, student, tokenizer, teachers, routes, ckpt, log=logs.append, wrap=wrap)
    assert "resuming distillation at step 2" in logs
    assert [r["lr"] for r in state.history] == pytest.approx([r["lr"] for r in ref.history])
    assert [r["loss"] for r in state.history] == pytest.approx([r["loss"] for r in ref.history], abs=1e-5)
    for (k, a), b in zip(plain.state_dict().items(), student.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), k


def test_multi_rank_resume_takes_the_latest_step_every_rank_holds(tmp_path, tokenizer, monkeypatch):
    """A rank killed between two ranks' saves is one checkpoint behind: all resume from the older one."""
    import random

    from opd.distill import DistillConfig, loop
    from opd.lab.model import build_model
    from opd.lab.pico import PICO
    from opd.rl import checkpoint
    from opd.rl.checkpoint import Ranks

    cfg = DistillConfig()
    model = build_model(PICO, tokenizer, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    path = tmp_path / "state.pt"
    two = loop.checkpointer(path, cfg, Ranks(0, 2, True))
    for step in (1, 2):
        two.save(model, opt, loop.DistillState(step=step).__dict__, random.Random(0))
    assert {p.name for p in tmp_path.iterdir()} == {"state.pt", "state.prev.pt"}
    # the other rank holds only step 1
    monkeypatch.setattr(checkpoint, "common_step", lambda steps: max(set(steps) & {1}, default=None))
    assert two.latest()["state"]["step"] == 1
    # a one-rank run (or a plain one) does not resume a two-rank checkpoint
    assert loop.checkpointer(path, cfg).latest() is None
    assert loop.checkpointer(path, cfg, Ranks(0, 1, True)).latest() is None


def test_gspo_multi_rank_resume_takes_the_latest_step_every_rank_holds(tmp_path, tokenizer, monkeypatch):
    """GSPO ranks agree as OPD's do: this rank holds steps 1 and 2, the other (killed between the two
    ranks' saves) only step 1, so this rank resumes step 1; one rank alone takes its newest."""
    import random

    from opd.expert import trainer
    from opd.expert.spec import ExpertSpec
    from opd.lab.model import build_model
    from opd.lab.pico import PICO
    from opd.rl import checkpoint
    from opd.rl.checkpoint import Ranks

    run = ExpertSpec(capability="count", deepspeed=ZERO2).run_settings()
    model = build_model(PICO, tokenizer, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    path = tmp_path / "state.pt"
    two, one = trainer.checkpointer(path, run, Ranks(0, 2, True)), trainer.checkpointer(path, run, Ranks(0, 1, True))
    for step in (1, 2):
        two.save(model, opt, trainer.RunState(step=step).__dict__, random.Random(0))
    monkeypatch.setattr(checkpoint, "common_step", lambda steps: max(set(steps) & {1}, default=None))
    assert two.restore(model, random.Random(0))[0]["step"] == 1
    assert one.latest() is None  # another number of ranks: its ZeRO partitions do not fit
    for step in (1, 2):
        one.save(model, opt, trainer.RunState(step=step).__dict__, random.Random(0))
    assert one.restore(model, random.Random(0))[0]["step"] == 2  # one rank alone takes its newest
    monkeypatch.setattr(checkpoint, "common_step", lambda steps: None)  # no step in common: start fresh
    assert two.restore(model, random.Random(0)) is None


@pytest.mark.parametrize("override, says", [
    ("deepspeed.zero_optimization.stage=3", "zero_optimization.stage: 3"),
    ("deepspeed.optimizer={type: Adam}", "optimizer: set by the loop"),
    ("deepspeed.zero_optimization.stagee=2", "stagee: Extra inputs are not permitted"),
    ("deepspeed=[2]", "valid dictionary"),
    ("deepspeed.zero_optimization=2", "zero_optimization: expected a mapping"),
])
def test_distill_deepspeed_fragment_refusals(tmp_path, override, says):
    from opd.distill.config import load_run

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"teachers": ["count"]}))
    assert load_run(path, ["deepspeed={}"]).deepspeed == {}
    with pytest.raises(OpdError) as e:
        load_run(path, [override])
    msg = str(e.value)
    assert msg.startswith(f"{path}: field 'deepspeed'") and says in msg and "\n" not in msg, msg


def test_plain_distill_does_not_import_deepspeed(tmp_path):
    """Without `deepspeed:` nothing of opd's imports it, up to the end of training (transformers'
    `save_pretrained` imports it by itself when it is installed)."""
    path = _distill_run(tmp_path, steps=1)
    run = yaml.safe_load(path.read_text())
    del run["deepspeed"]
    path.write_text(yaml.safe_dump(run))
    code = ("import sys\n"
            "import opd.distill.student as r\n"
            "def spy(*a, _inner=r.distill, **k):\n"
            "    state = _inner(*a, **k)\n"
            "    print('deepspeed imported:', 'deepspeed' in sys.modules)\n"
            "    return state\n"
            "r.distill = spy\n"
            "from opd.distill.__main__ import main\n"
            "main([sys.argv[1], '--no-eval'])\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "deepspeed imported: False" in r.stdout, r.stdout[-2000:]


def _rank_checkpoints(ckpt_dir: Path, rank: int) -> dict[int, dict]:
    """step -> checkpoint, over a rank's current and previous checkpoint files."""
    stem = "state" if rank == 0 else f"state-rank{rank}"
    found = {}
    for p in (ckpt_dir / f"{stem}.pt", ckpt_dir / f"{stem}.prev.pt"):
        try:
            ck = torch.load(p, weights_only=False)
        except (FileNotFoundError, EOFError, RuntimeError):  # absent, or being replaced
            continue
        found[ck["state"]["step"]] = ck
    return found


@pytest.mark.slow
def test_distill_zero2_two_cpu_ranks_deepspeed_launcher_killed_and_resumed(tmp_path):
    """Two gloo ranks started by the deepspeed launcher, SIGKILLed mid-run, then resumed: each rank
    resumes from its own checkpoint at a step both hold; rank 0 evaluates and writes the student."""
    path = _distill_run(tmp_path, steps=100_000, eval_every=1)
    cmd = _launcher("--module", "opd.distill", str(path))
    env, ckpt_dir = _env(tmp_path), tmp_path / ".out.ckpt"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # its own process group: launcher and both ranks
    deadline, common = time.time() + 600, set()
    try:
        while time.time() < deadline and proc.poll() is None and max(common, default=0) < 2:
            common = set(_rank_checkpoints(ckpt_dir, 0)) & set(_rank_checkpoints(ckpt_dir, 1))
            time.sleep(0.5)
        assert proc.poll() is None, "run ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    by_rank = [_rank_checkpoints(ckpt_dir, r) for r in (0, 1)]
    killed_at = max(set(by_rank[0]) & set(by_rank[1]))
    a, b = (ck[killed_at] for ck in by_rank)
    # ZeRO keeps the weights identical on both ranks; each rank drew its own prompts
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["rng"] != b["rng"] and a["ranks"] == b["ranks"] == {"deepspeed": True, "world_size": 2}

    r = subprocess.run([*_launcher("--module", "opd.distill", str(path), f"distill.steps={killed_at + 2}")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert r.stderr.count(f"resuming distillation at step {killed_at}") == 2  # both ranks
    assert f"[rank 1] resuming distillation at step {killed_at}" in r.stderr
    m = _check_student(tmp_path / "out", killed_at + 2, ranks=2)
    assert "min_retention" in m["final"] and m["train"]["kept_step"] >= 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))) == ["out"]
