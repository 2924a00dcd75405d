"""opd on a local multi-node Ray cluster (ray.cluster_utils.Cluster: a head with no CPUs and two
one-CPU worker nodes, shared by every test of the module): the lab's experts as Ray tasks, a node
killed mid-expert, OPD teachers as actors, search workers as tasks, and the one-line refusals.

`pytest -m ray` runs these alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'opd[ray]'")

from opd.errors import OpdError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


# --- OPD teachers as actors -------------------------------------------------------------------------

def _opd(tokenizer, lab, **cfg):
    from transformers import AutoModelForCausalLM

    from opd.distill.config import DistillConfig
    from opd.distill.loop import distill
    from opd.distill.routing import resolve_routes
    from opd.distill.teachers import embedded_teacher

    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_pretrained(lab["base"])
    teachers = {n: embedded_teacher(n, n, AutoModelForCausalLM.from_pretrained(p), tokenizer)
                for n, p in lab["experts"].items()}
    config = DistillConfig(**{"steps": 2, "prompts_per_step": 6, "group_size": 2, "lr": 3e-3, "updates_per_batch": 2,
                              **cfg})
    state = distill(config, student, tokenizer, teachers, resolve_routes({n: n for n in teachers}),
                    log=lambda *_: None)
    return state, student


@pytest.mark.parametrize("estimator,actors", [("sampled", {"per_actor": 2}),
                                              ("full", {"replicas": {"add": 2}, "resources": {"CPU": 0.5}}),
                                              ("topk", {"per_actor": 1}),
                                              ("teacher_topk", {"replicas": {"add": 2}, "resources": {"CPU": 0.5}})])
def test_opd_with_ray_teacher_actors_equals_in_process(cluster, tmp_path, tokenizer, estimator, actors):
    """Two teachers on actors (sampled: one actor holds both; full: add over-provisioned with two
    actors, which split its rows): every step's loss, KLs and grad norm, and the student's weights,
    equal the in-process bank's. top-k (one actor per teacher) reads the same gathered targets as full;
    teacher_topk gets each teacher's top k from its actors (add's rows split between two)."""
    from opd.lab.pico import build_fake_lab

    lab = build_fake_lab(tmp_path / "lab", ("add", "rev"), scale=0.05)
    extra = {"topk": 8} if estimator in ("topk", "teacher_topk") else {}
    local, s_local = _opd(tokenizer, lab, estimator=estimator, **extra)
    remote, s_remote = _opd(tokenizer, lab, estimator=estimator, teachers_on="ray", teacher_actors=actors, **extra)
    for a, b in zip(local.history, remote.history, strict=True):
        for k in ("loss", "grad_norm", "kl/add", "kl/rev"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])
    for (n, p), q in zip(s_local.state_dict().items(), s_remote.state_dict().values()):
        # Adam turns a rounding-level gradient difference into up to ~1e-5 of a 3e-3 step (seen: 1.1e-5)
        assert torch.allclose(p, q, atol=1e-4), n


def test_kl_warm_start_from_ray_teacher_actors_with_topk_equals_in_process(cluster, tmp_path, tokenizer):
    """warmstart_topk with teachers_on: ray: the teachers sample on their actors (seeded, so the same samples)
    and return their top-k log-probs from there (add over-provisioned with two actors, which split its
    pairs); the warm start trains the student to the in-process teachers' weights."""
    from opd.lab.pico import build_fake_lab

    lab = build_fake_lab(tmp_path / "lab", ("add", "rev"), scale=0.05)
    warm = {"steps": 0, "warmstart_steps": 3, "warmstart_prompts": 4, "warmstart_batch": 6, "warmstart_loss": "kl",
            "warmstart_topk": 6, "verifier": "none"}
    local, s_local = _opd(tokenizer, lab, **warm)
    remote, s_remote = _opd(tokenizer, lab, teachers_on="ray",
                            teacher_actors={"replicas": {"add": 2}, "resources": {"CPU": 0.5}}, **warm)
    assert remote.warm_tokens == local.warm_tokens > 0
    for (n, p), q in zip(s_local.state_dict().items(), s_remote.state_dict().values()):
        assert torch.allclose(p, q, atol=1e-4), n
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(lab["base"]).state_dict()
    moved = max(float((s_local.state_dict()[n] - base[n]).abs().max()) for n in base)
    assert moved > 1e-4  # it trained


def test_remote_bank_splits_rows_between_replicas(tokenizer, tmp_path):
    """The routing itself (engine 'local': the same hosts, in process): an over-provisioned teacher's
    rows are dealt between its actors, and the gathered targets equal one in-process bank's."""
    from transformers import AutoModelForCausalLM

    from opd.cluster import Actors
    from opd.distill.remote import RemoteBank, TeacherHost, TeacherPool
    from opd.distill.teacher_bank import TeacherBank
    from opd.distill.teachers import embedded_teacher
    from opd.lab.pico import build_fake_lab
    from opd.rl.batch import completion_targets, pad_sequences

    lab = build_fake_lab(tmp_path / "lab", ("add", "rev"), scale=0.05)
    models = {n: ("add" if n == "add" else "rev", AutoModelForCausalLM.from_pretrained(p))
              for n, p in lab["experts"].items()}
    groups = [["add"], ["add"], ["rev"]]
    pool = TeacherPool(Actors("local", TeacherHost, [({n: models[n] for n in g}, tokenizer, None) for g in groups],
                              {}), groups)
    assert pool.split("add", [0, 1, 2, 3, 4]) == [(0, [0, 2, 4]), (1, [1, 3])]
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in ["#a:ab=", "#b:bbd=", "#c:a=", "#d:dd="]]
    comp = [tokenizer(c, add_special_tokens=False).input_ids for c in ["2\n", "13\n", "4\n", "0\n"]]
    x, attn, cmask, plen = pad_sequences(ids, comp, tokenizer.pad_token_id)
    targets = completion_targets(x, plen, cmask.shape[1])
    w = torch.tensor([[1.0, 0.5, 1.0, 0.0], [0.0, 0.5, 0.0, 1.0]])  # (K, B): row 1 mixes both teachers
    got = RemoteBank(pool, ["add", "rev"]).score(x, attn, plen, targets, w)
    teachers = {n: embedded_teacher(n, c, m, tokenizer) for n, (c, m) in models.items()}
    want = TeacherBank(teachers, ["add", "rev"]).score(x, attn, plen, targets, w)
    for g, e in zip(got, want):
        assert torch.allclose(g, e, atol=1e-5)


# --- the lab's experts on Ray -----------------------------------------------------------------------

STEPS = 6
OVERRIDES = {"steps": STEPS, "max_minutes": 30, "eval_every": 2, "eval_limit": 20, "checkpoint_every": 2,
             "threads": 1, "gspo.prompts_per_step": 4, "gspo.group_size": 4, "gspo.updates_per_batch": 1,
             "gspo.lr": 0.003, "gspo.eps_low": 0.2, "gspo.eps_high": 0.28, "gspo.min_informative": 0.0}


def _lab_recipe(tmp_path: Path, base: Path, out: str, **train) -> Path:
    doc = {"name": "pico", "base": str(base), "experts": [str(tmp_path / out / "count"), str(tmp_path / out / "max")],
           "strategies": {"linear": {"weight": [0.2, 1.0]}}, "budget": {"n_trials": 3}, "sampler": "random",
           "screening": {"limit": None}, "final_candidates": 2, "eval_batch_size": 64,
           "out": str(tmp_path / out / "merge"), "train": {"overrides": OVERRIDES, **train}}
    p = tmp_path / f"{out}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def _kill_mid_expert(cluster, nodes, ckpt: Path, log: Path, seen: dict, stop: threading.Event) -> None:
    """Once `ckpt` holds a checkpoint, remove the node whose log line says it runs the expert."""
    while not stop.is_set():
        if ckpt.exists():
            step = torch.load(ckpt, weights_only=False)["state"]["step"]
            node_id = next((ln.split()[-1] for ln in log.read_text().splitlines() if ln.startswith("[opd] on node")),
                           None)
            victim = next((n for n in nodes if n.node_id == node_id), None)
            if victim is not None and step < STEPS:
                cluster.remove_node(victim)
                seen.update(step=step, node=node_id)
                return
        time.sleep(0.05)


def test_pico_lab_on_ray_matches_the_local_pool_with_a_node_killed_mid_expert(cluster, tmp_path, monkeypatch):
    """The pico lab's experts stage and search: on the local pool (2 jobs), then with every expert a
    Ray task spread over the two worker nodes, one of which is killed after `count` wrote a
    checkpoint. Ray reruns `count` on the other node from that checkpoint (no step before it trained
    again), and both experts come out bit-identical to the local run's, with the same search result."""
    from opd.lab.pico import build_trained_pico
    from opd.lab.pipeline import run_lab

    c, nodes = cluster
    monkeypatch.chdir(tmp_path)
    base = build_trained_pico(tmp_path / "base", "count", steps=60)
    local = _lab_recipe(tmp_path, base, "local", jobs=2)
    on_ray = _lab_recipe(tmp_path, base, "ray", cluster={"engine": "ray", "address": c.address})
    run_lab(str(local), ["experts", "merge"])
    seen: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_mid_expert, args=(
        c, nodes, tmp_path / "ray" / ".count.ckpt" / "state.pt", tmp_path / "runs" / "lab" / "logs" / "count.log",
        seen, stop))
    killer.start()
    try:
        run_lab(str(on_ray), ["experts", "merge"])
    finally:
        stop.set()
        killer.join()
        nodes[:] = [n for n in nodes if n.node_id != seen.get("node")]
        while len(nodes) < 2:  # the module's other tests get their two workers back
            nodes.append(c.add_node(num_cpus=1))
        c.wait_for_nodes()
    assert seen, "no node was removed: count finished before its first checkpoint was seen"
    log = (tmp_path / "runs" / "lab" / "logs" / "count.log").read_text()
    assert log.count("[opd] on node") == 2  # the killed attempt and Ray's retry, on another node
    attempts = log.split("[opd] on node")
    assert attempts[1].split()[0] == seen["node"] and attempts[2].split()[0] != seen["node"]
    resumed = int(attempts[2].split("resuming count at step ")[1].split()[0])
    assert resumed >= seen["step"] >= 2  # from the checkpoint (or a later one), never from scratch
    for name in ("count", "max"):
        a = json.loads((tmp_path / "local" / name / "manifest.json").read_text())
        b = json.loads((tmp_path / "ray" / name / "manifest.json").read_text())
        assert a["content_hash"] == b["content_hash"], name  # bit-identical weights
        assert [r["step"] for r in b["train"]["history"]] == list(range(1, STEPS + 1))  # each step once
        assert [r.get("reward") for r in a["train"]["history"]] == [r.get("reward") for r in b["train"]["history"]]
    ra = json.loads((tmp_path / "local" / "merge" / "results.json").read_text())
    rb = json.loads((tmp_path / "ray" / "merge" / "results.json").read_text())
    assert [(t["params"], t["values"]) for t in ra["trials"]] == [(t["params"], t["values"]) for t in rb["trials"]]
    assert ra["final"] == rb["final"] and ra["best"] == rb["best"]


# --- search workers on Ray --------------------------------------------------------------------------

def test_search_workers_as_ray_tasks_share_the_study(cluster, tmp_path):
    """`python -m opd.merge --recipe R --workers 2 --ray ADDRESS`: two Ray tasks share the study (a
    `journal:` file storage), then this process re-scores the finalists on test and writes the report."""
    import optuna
    from test_merge_fakes import build_fake_lab, write_recipe

    from opd.merge.trials import read

    c, _ = cluster
    lab = build_fake_lab(tmp_path / "lab")
    journal = tmp_path / "out" / "study.journal"  # Optuna's JournalStorage: the multi-machine file storage
    path = write_recipe(tmp_path / "r.yaml", lab, tmp_path / "out", budget={"n_trials": 6},
                        storage=f"journal:{journal}")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "opd.merge", "--recipe", str(path), "--no-live", "--workers", "2",
                        "--ray", c.address], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "results.json").read_text())
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    study = optuna.load_study(study_name=summary["study"], storage=storage)
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert 6 <= len(done) <= 7 and len(summary["trials"]) == len(done)
    assert len({read(t).worker for t in done}) == 2  # both workers ran trials
    assert (tmp_path / "out" / "report.md").exists() and summary["final"]


# --- bad cluster settings: one line, exit 2 ---------------------------------------------------------

def _lab_cli(tmp_path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "lab.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_unreachable_address_is_one_line_and_exit_2(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("experts: [count]\nstrategies: {linear: {weight: 1.0}}\n")
    r = _lab_cli(tmp_path, "--recipe", str(recipe), "--stages", "experts", "--ray", "127.0.0.1:1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "cannot reach a Ray cluster" in r.stderr
    assert "'127.0.0.1:1'" in r.stderr and "Traceback" not in r.stderr


def test_ray_not_installed_is_one_line(monkeypatch):
    import builtins

    from opd.cluster import connect

    real = builtins.__import__

    def no_ray(name, *a, **kw):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(OpdError, match=r"Ray is not installed; pip install 'opd\[ray\]'"):
        connect("auto")


def test_storage_the_nodes_cannot_see_is_refused(cluster, tmp_path, monkeypatch):
    """The driver writes its marker where the nodes do not look (here: nowhere, as a driver's local
    disk would be to them): every node is named blind, in one line."""
    import opd.cluster

    monkeypatch.setattr(opd.cluster, "_write_marker", lambda path, token: None)
    with pytest.raises(OpdError) as e:
        opd.cluster.check_shared(ray, tmp_path / "run")
    msg = str(e.value)
    assert "is not shared storage" in msg and "\n" not in msg and msg.count(" of 3 ") == 1
    monkeypatch.undo()
    opd.cluster.check_shared(ray, tmp_path / "run")  # the real marker: every node sees it
