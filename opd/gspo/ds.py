"""Run the GSPO/OPD updates under a DeepSpeed ZeRO engine (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import os


def deepspeed_wrap(spec):
    """Return `wrap(model, opt) -> (engine, opt, backward)` for `opd.gspo.trainer.train`.

    The torch optimizer is passed in (naming one in the config compiles a C++ op, see NOTES);
    gradient clipping moves into the DeepSpeed config.
    """

    def wrap(model, opt):
        import deepspeed
        import torch

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
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
