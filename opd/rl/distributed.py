"""Run the GSPO and OPD updates under a DeepSpeed ZeRO engine (gloo on CPU, NCCL on GPUs).

`deepspeed:` in an expert spec or a distillation run (a DeepSpeed config fragment, merged over
ZeRO-2 defaults) switches it on. One process needs no launcher (the rendezvous variables are
filled in here). Several ranks on one machine, with DeepSpeed's own launcher (`--no_local_rank`:
the scripts take no `--local_rank` argument; the rank comes from the environment):

    deepspeed --num_gpus 2 --no_local_rank scripts/train_expert.py experts/count.yaml
    deepspeed --num_gpus 2 --no_local_rank --module opd.distill merge_recipes/distill/lab4.yaml

On a machine without GPUs `--num_gpus N` starts N CPU ranks (gloo): the launcher counts CPU
"devices" by NUMA node, and `--num_gpus` overrides that count. `torchrun --standalone
--nproc_per_node N scripts/train_expert.py ...` works too (tests/test_deepspeed.py runs both
trainers on 2 CPU ranks under the deepspeed launcher). Each rank samples its own prompts, ZeRO
averages the gradients, each rank checkpoints to its own file (`rank_path`), rank 0 writes. In OPD
rank 0 alone evaluates and sends its scores to the others, so the keep-best decision is the same on
every rank; they wait in a collective meanwhile, so an evaluation longer than DeepSpeed's 10-minute
process-group timeout needs `DEEPSPEED_TIMEOUT` (minutes) raised.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.distributed as dist
from pydantic import AfterValidator, ValidationError

from opd.errors import OpdError

# What torchrun and the deepspeed launcher export for every rank.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# The loop owns these: it passes a torch optimizer (naming one here compiles a C++ op, see NOTES),
# sets the learning rate itself each step, and steps once per backward.
OWNED_KEYS = ("optimizer", "scheduler", "gradient_accumulation_steps", "train_batch_size",
              "train_micro_batch_size_per_gpu", "gradient_clipping")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_env() -> tuple[int, int]:
    """Make the rendezvous variables complete; returns (rank, world_size).

    Under a launcher all five are set and left alone. A plain process becomes a world of one on a
    free port: a fixed port would make two single-process runs on one machine (parallel tests, two
    experts trained side by side) collide in the gloo rendezvous.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if os.environ["WORLD_SIZE"] != "1":
            raise OpdError("DeepSpeed: RANK and WORLD_SIZE are set but MASTER_PORT is not; launch with "
                           "torchrun or the deepspeed launcher, which set all of " + ", ".join(LAUNCHER_VARS))
        os.environ["MASTER_PORT"] = str(_free_port())
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def init_distributed() -> tuple[int, int]:
    """Join the process group (once; later calls are no-ops); returns (rank, world_size)."""
    import deepspeed  # lazy: deepspeed (seconds, optional on CPU): only a run with a `deepspeed:` fragment pays

    init_process_env()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    return dist.get_rank(), dist.get_world_size()


def zero_config(grad_clip: float, fragment: dict | None) -> dict:
    """The DeepSpeed config: ZeRO-2 defaults and the loop's settings, `fragment` merged over them
    (nested mappings key by key, so `{zero_optimization: {overlap_comm: true}}` keeps stage 2)."""
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": grad_clip, "zero_optimization": {"stage": 2}}
    return _merge(base, fragment or {})


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _checked_fragment(fragment: dict | None) -> dict | None:
    if fragment is not None:
        check_fragment(fragment)
    return fragment


def check_fragment(fragment: dict) -> None:
    """Refuse a config fragment the loops cannot run, in one line (ValueError): keys the loop owns,
    a ZeRO stage other than 1 or 2 (stage 3 partitions the weights the rollout engine samples
    from), or what DeepSpeed's own config parser rejects."""
    owned = [k for k in OWNED_KEYS if k in fragment]
    if owned:
        raise ValueError(f"{', '.join(owned)}: set by the loop (torch AdamW, its lr schedule, one step per "
                         "backward, grad_clip), not in the DeepSpeed fragment")
    cfg = zero_config(1.0, fragment)
    if not isinstance(cfg["zero_optimization"], dict):
        raise ValueError("zero_optimization: expected a mapping, e.g. {stage: 2}")
    stage = cfg["zero_optimization"].get("stage")
    if stage not in (1, 2):
        raise ValueError(f"zero_optimization.stage: {stage!r}; ZeRO stage 1 or 2 (default 2)")
    # lazy: deepspeed, as in init_distributed: a spec without a fragment never gets here
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(cfg)
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']} "
                         f"(DeepSpeed's {e.title})") from None
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def deepspeed_wrap(grad_clip: float, fragment: dict | None = None):
    """Return `wrap(model, opt) -> (engine, opt, backward)` for the GSPO and OPD loops.

    The torch optimizer is passed in (naming one in the config compiles a C++ op, see NOTES);
    gradient clipping moves into the DeepSpeed config. Each rank trains on its own rollouts and
    ZeRO averages the gradients, so every rank must call `backward` the same number of times.
    The loss must come from the engine's forward (`engine(...)`), which arms ZeRO's backward hooks.
    """

    def wrap(model, opt):
        import deepspeed  # lazy: deepspeed, as in init_distributed

        init_distributed()
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                                    config=zero_config(grad_clip, fragment))

        def backward(loss):
            engine.backward(loss)
            engine.step()
            return engine.get_global_grad_norm() or 0.0

        return engine, ds_opt, backward

    return wrap


def load_optimizer_state(opt, state: dict) -> None:
    """Restore what `opt.state_dict()` returned, for a torch optimizer or a DeepSpeed ZeRO-1/2 one.

    A ZeRO optimizer's state is this rank's partition (fp32 master weights and Adam moments of
    the flat groups), not a torch optimizer's per-parameter state: it can only go back into the
    same kind of engine, after `wrap`. `state` is this rank's own; the list DeepSpeed takes is
    indexed by data-parallel rank.
    """
    if isinstance(opt, torch.optim.Optimizer):  # plain torch: no DeepSpeed import on this path
        opt.load_state_dict(state)
        return
    # lazy: deepspeed, as in init_distributed (a plain torch optimizer returned above)
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(opt, DeepSpeedZeroOptimizer):
        raise TypeError(f"load_optimizer_state: {type(opt).__name__} is neither a torch nor a ZeRO-1/2 optimizer")

    rank, world = dist.get_rank(), dist.get_world_size()
    opt.load_state_dict([state if r == rank else None for r in range(world)], load_from_fp32_weights=True)


def zero_checkpoint_globals() -> list:
    """The DeepSpeed classes inside a ZeRO-1/2 optimizer's `state_dict()`, for
    `torch.serialization.safe_globals` around `torch.load(..., weights_only=True)`."""
    # lazy: deepspeed, as in init_distributed: only a ZeRO checkpoint's load asks for these
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum  # lazy: deepspeed, as above
    from deepspeed.utils.tensor_fragment import fragment_address  # lazy: deepspeed, as above

    return [LossScaler, ZeroStageEnum, fragment_address]


def rank_path(path: Path, rank: int) -> Path:
    """Rank 0's checkpoint is `path` (a one-rank run's file); rank r's sits beside it."""
    return path if rank == 0 else path.with_name(f"{path.stem}-rank{rank}{path.suffix}")


# Collectives of the data-parallel loops; only called when the world has several ranks.

def rank0_value(obj):
    """Rank 0's `obj` on every rank (a decision all ranks must share: keep-best, stop)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def ranks_sum(n: int) -> int:
    return _all_reduce(n, "SUM")


def ranks_min(n: int) -> int:
    return _all_reduce(n, "MIN")


def _all_reduce(n: int, op: str) -> int:
    # NCCL reduces only CUDA tensors (each rank's current device, which DeepSpeed set to its local GPU)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return int(t)


def common_step(steps: list[int]) -> int | None:
    """The latest of `steps` (this rank's resumable checkpoint steps) that every rank holds."""
    every: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(steps))
    shared = set(every[0]).intersection(*every[1:])
    return max(shared) if shared else None


def optimizer_step(loss, opt, params, grad_clip: float, backward=None) -> float:
    """One update from `loss`: backward, clip, step with a torch optimizer, or the DeepSpeed engine's
    `backward` from `deepspeed_wrap` (which clips and steps itself). Returns the gradient norm."""
    if backward is not None:
        return backward(loss)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    return gn


# A spec field holding a DeepSpeed config fragment (or None), checked by `check_fragment` when the
# spec is loaded: the expert spec and the distillation run share it.
DeepSpeedFragment = Annotated[dict[str, Any] | None, AfterValidator(_checked_fragment)]
