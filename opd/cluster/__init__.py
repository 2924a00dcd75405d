"""Where work runs: on this machine (the default: a local process pool, or in process) or on a Ray
cluster. The loops and the search above never import Ray; they hand this layer commands to run,
or a class to host as remote actors, and a `ClusterSettings`.

Ray is an optional extra (`pip install 'opd[ray]'`): it is imported only when a setting asks for it,
and every failure to reach a cluster (Ray missing, an unreachable address, a run directory the
nodes do not share) is one line (`OpdError`) before any work starts.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from opd.errors import OpdError

# Environment variables a command run on a node inherits from the driver: where the code and the
# caches are, and the offline switches (a node is assumed to hold the same install at the same path).
FORWARDED_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "OPD_CACHE",
                 "OPD_OUTPUT_ROOTS", "OPD_VERBOSE", "OPD_CI")


class ClusterSettings(BaseModel):
    """Where a lab's experts (and a search's workers) run: the `cluster:` block of a recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["local", "ray"] = Field("local", description="'local': a process pool on this machine "
                                           "(train.jobs at once); 'ray': one Ray task per expert on the cluster "
                                           "at `address`, with the resources its spec asks for")
    address: str = Field("auto", description="the Ray cluster: 'auto' (the one `ray start` made on this "
                         "machine), 'ray://host:port' (Ray Client) or 'host:port' (the head's GCS)")
    max_retries: int = Field(3, ge=0, description="times Ray reruns an expert whose node died; the rerun "
                             "resumes from the expert's last checkpoint on the shared storage")


def import_ray():
    """The `ray` module, or one line saying how to install it."""
    try:
        import ray  # lazy: ray is an optional dependency
    except ImportError:
        raise OpdError("cluster engine 'ray': Ray is not installed; pip install 'opd[ray]' (ray==2.60.0) on "
                       "this machine and every node") from None
    return ray


def connect(address: str, field: str = "cluster.address"):
    """The `ray` module, connected to the cluster at `address` (once per process), or one line naming
    `field` and the fix."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    hostport = address.removeprefix("ray://")
    if address != "auto" and not address.startswith("local"):
        # ray.init retries a GCS it cannot reach for ever (seen here: > 5 minutes of "Failed to connect
        # to GCS"), so the address must answer a TCP connect first

        host, _, port = hostport.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            raise OpdError(f"{field} {address!r}: cannot reach a Ray cluster there ({type(e).__name__}: {e}); "
                           "start one with `ray start --head` (docs/cluster.md) or fix the address") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise OpdError(f"{field} {address!r}: cannot reach a Ray cluster ({type(e).__name__}: {first}); start "
                       "one with `ray start --head` (docs/cluster.md) or fix the address") from None
    return ray


def forwarded_env() -> dict[str, str]:
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}


def _write_marker(path: Path, token: str) -> None:
    path.write_text(token)


def check_shared(ray, run_dir: Path, field: str = "cluster") -> None:
    """Refuse (one line) unless every alive node of the cluster reads and writes `run_dir`: the driver
    writes a marker there, a zero-CPU task pinned to each node checks it and writes one back."""
    # lazy: ray is an optional dependency
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    probe_dir = run_dir / f".opd-shared-{token}"
    probe_dir.mkdir()
    try:
        _write_marker(probe_dir / "driver", token)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        probe = ray.remote(num_cpus=0, max_retries=0)(_probe_marker)
        refs = {n["NodeManagerAddress"] + " " + n["NodeID"][:8]: probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(str(probe_dir), token)
                for n in nodes}
        seen = dict(zip(refs, ray.get(list(refs.values()), timeout=120)))
        blind = [n for n, ok in seen.items() if not ok or not (probe_dir / n.split()[1]).exists()]
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    if blind:
        raise OpdError(f"{field}: {run_dir} is not shared storage: node(s) {', '.join(sorted(blind))} of "
                       f"{len(nodes)} cannot see it; put the run on a file system every node mounts at the same "
                       "path (NFS, a cloud bucket mount), see docs/cluster.md")


def _probe_marker(probe_dir: str, token: str) -> bool:
    """On one node: whether the driver's marker is there with its token; if so, answer with this node's."""
    import ray  # lazy: ray is an optional dependency

    p = Path(probe_dir)
    try:
        ok = (p / "driver").read_text() == token
    except OSError:
        return False
    if ok:
        (p / ray.get_runtime_context().get_node_id()[:8]).write_text(token)
    return ok


def _run_logged(cmd: list[str], log_path: str, cwd: str, env: dict[str, str]) -> int:
    """On a node: run `cmd`, its output appended to `log_path` (a retry adds its own part below the
    dead attempt's). The child dies with this worker (PR_SET_PDEATHSIG), so a node that Ray declares
    dead leaves no trainer writing the checkpoint that the retry resumes."""
    import ray  # lazy: ray is an optional dependency

    def die_with_parent():
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG

    with open(log_path, "ab") as out:
        out.write(f"[opd] on node {ray.get_runtime_context().get_node_id()}\n".encode())
        out.flush()
        return subprocess.run(cmd, cwd=cwd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                              preexec_fn=die_with_parent if sys.platform.startswith("linux") else None).returncode


def ray_resources(resources: dict[str, float]) -> dict:
    """`{CPU: n, GPU: m, <custom>: x}` as Ray's task options."""
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 1), "num_gpus": resources.get("GPU", 0),
            **({"resources": rest} if rest else {})}


def run_commands_on_ray(settings: ClusterSettings, cmds: dict[str, list[str]], resources: dict[str, dict],
                        log_dir: Path, log: Callable[[str], None] = print) -> dict[str, int]:
    """Each named command as one Ray task with its `resources`, its output in log_dir/<name>.log (on
    storage every node shares: `check_shared`); a task whose node dies is rerun up to
    `settings.max_retries` times. Returns each command's exit code once all have ended."""
    ray = connect(settings.address)
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    task = ray.remote(_run_logged)
    env, cwd = forwarded_env(), str(Path.cwd())
    refs = {}
    for name, cmd in cmds.items():
        (log_dir / f"{name}.log").write_bytes(b"")
        refs[name] = task.options(max_retries=settings.max_retries, **ray_resources(resources[name])).remote(
            cmd, str(log_dir / f"{name}.log"), cwd, env)
    codes: dict[str, int] = {}
    pending = {r: n for n, r in refs.items()}
    t0 = time.time()
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        name = pending.pop(done[0])
        try:
            codes[name] = ray.get(done[0])
        except Exception as e:  # retries used up (RayTaskError, WorkerCrashedError, NodeDiedError...)
            codes[name] = -1
            with open(log_dir / f"{name}.log", "a") as f:
                f.write(f"[opd] Ray gave up after {settings.max_retries} retries: {type(e).__name__}\n")
        log(f"{name}: {'done' if codes[name] == 0 else f'FAILED (exit {codes[name]})'} on Ray after "
            f"{(time.time() - t0) / 60:.1f} min ({log_dir / name}.log)")
    return codes


class Actors:
    """Objects of one class, each built from its own arguments, hosted in this process (engine
    'local') or as Ray actors (engine 'ray', each with `resources`). `submit` calls a method on one of
    them and returns a handle; `gather` waits for the handles' results, in order."""

    def __init__(self, engine: Literal["local", "ray"], cls, args: list[tuple], resources: dict[str, float],
                 address: str = "auto", field: str = "cluster.address"):
        self.engine = engine
        if engine == "local":
            self.objects = [cls(*a) for a in args]
            return
        self.ray = connect(address, field)
        actor = self.ray.remote(cls).options(**ray_resources(resources))
        self.objects = [actor.remote(*a) for a in args]

    def __len__(self) -> int:
        return len(self.objects)

    def submit(self, i: int, method: str, *args):
        if self.engine == "local":
            return getattr(self.objects[i], method)(*args)
        return getattr(self.objects[i], method).remote(*args)

    def gather(self, handles: list) -> list:
        return list(handles) if self.engine == "local" else self.ray.get(list(handles))

    def close(self) -> None:
        if self.engine == "ray":
            for a in self.objects:
                self.ray.kill(a)
        self.objects = []
