"""Run the GSPO/OPD updates under a DeepSpeed ZeRO engine (gloo on CPU, NCCL on GPUs).

Single process: `python scripts/train_expert.py spec.yaml` with `deepspeed:` in the spec; the
rendezvous variables are filled in here. Several ranks: a launcher sets them, e.g.
`torchrun --standalone --nproc_per_node 2 scripts/train_expert.py spec.yaml` (tests/test_deepspeed.py).
"""

from __future__ import annotations

import os
import socket

# What torchrun and the deepspeed launcher export for every rank.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
            from opd.errors import OpdError

            raise OpdError("DeepSpeed: RANK and WORLD_SIZE are set but MASTER_PORT is not; launch with "
                           "torchrun or the deepspeed launcher, which set all of " + ", ".join(LAUNCHER_VARS))
        os.environ["MASTER_PORT"] = str(_free_port())
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def deepspeed_wrap(spec):
    """Return `wrap(model, opt) -> (engine, opt, backward)` for `opd.gspo.trainer.train`.

    The torch optimizer is passed in (naming one in the config compiles a C++ op, see NOTES);
    gradient clipping moves into the DeepSpeed config. Each rank trains on its own rollouts and
    ZeRO averages the gradients, so every rank must call `backward` the same number of times.
    """

    def wrap(model, opt):
        import deepspeed
        import torch

        init_process_env()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(dist_backend=backend)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": spec.gspo.grad_clip,
            "zero_optimization": {"stage": 2},
            **(spec.deepspeed or {}),
        }
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

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
    import torch

    if isinstance(opt, torch.optim.Optimizer):  # plain torch: no DeepSpeed import on this path
        opt.load_state_dict(state)
        return
    import torch.distributed as dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(opt, DeepSpeedZeroOptimizer):
        raise TypeError(f"load_optimizer_state: {type(opt).__name__} is neither a torch nor a ZeRO-1/2 optimizer")

    rank, world = dist.get_rank(), dist.get_world_size()
    opt.load_state_dict([state if r == rank else None for r in range(world)], load_from_fp32_weights=True)
