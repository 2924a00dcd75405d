"""Where a stage runs: `device` (auto / cpu / cuda / cuda:N) and `dtype` (float32 / bfloat16 / auto)
of the base, expert, distillation and merge-search settings, resolved to torch objects.

`auto` device: the GPU when torch sees one (under a launcher, the local rank's: LOCAL_RANK), else the
CPU. `auto` dtype: bfloat16 on a GPU that computes in it, else float32, so a CPU run is what it
always was. A device this machine lacks is refused when the settings file is read (a field
validator: one line naming the file and the field), before any model loads.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal

import torch
from pydantic import AfterValidator

DTYPES = ("float32", "bfloat16")
DtypeName = Literal["float32", "bfloat16", "auto"]


def device_problem(name: str) -> str | None:
    """Why `name` cannot be used on this machine (one line), or None."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        return f"{name!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'"
    if name in ("auto", "cpu"):
        return None
    if not torch.cuda.is_available():
        return (f"{name!r}, but this machine has no CUDA device (torch {torch.__version__} sees none); "
                "use 'auto' or 'cpu'")
    index = _cuda_index(name)
    if index >= torch.cuda.device_count():
        return f"{name!r}, but this machine has {torch.cuda.device_count()} CUDA device(s): cuda:0 .. " \
               f"cuda:{torch.cuda.device_count() - 1}"
    return None


def _cuda_index(name: str) -> int:
    # a launcher (torchrun, deepspeed) gives each rank its GPU by LOCAL_RANK; 'cuda:N' pins one
    return int(name[5:]) if name.startswith("cuda:") else int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(name: str) -> torch.device:
    """The torch device `name` stands for on this machine (ValueError, one line, where it has none)."""
    problem = device_problem(name)
    if problem:
        raise ValueError(problem)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", _cuda_index(name))


def _checked_device(name: str) -> str:
    problem = device_problem(name)
    if problem:
        raise ValueError(problem)
    return name


# A settings field holding a device name, checked against this machine when the file is read.
DeviceName = Annotated[str, AfterValidator(_checked_device)]


def bf16_supported(device: torch.device) -> bool:
    """Whether `device` computes in bfloat16 natively (a CUDA GPU from Ampere on). CPUs are left out:
    many run bf16 products tens of times slower than fp32 (see opd.distill.precision)."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype `name` stands for on `device`: 'auto' is bfloat16 where `bf16_supported`, else float32."""
    if name == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"{name!r} is not a dtype; use 'float32', 'bfloat16' or 'auto'")
    return getattr(torch, name)


def model_device(model) -> torch.device:
    """Where `model`'s inputs must be built. A DeepSpeed engine's own `device` (deepspeed/runtime/engine.py,
    `_set_distributed_vars`: the local rank's accelerator, where `_configure_distributed_model` moves the
    module); a transformers model's `device` property; else the first parameter's."""
    dev = getattr(model, "device", None)
    return dev if isinstance(dev, torch.device) else next(model.parameters()).device


def place(model, device: torch.device, dtype: torch.dtype):
    """`model` on `device` with its floating parameters in `dtype` (in place; returned). Buffers keep their
    dtype (RoPE's frequencies stay fp32, so positions are not rounded), as DeepSpeed casts "params only"
    (deepspeed/runtime/engine.py, `_configure_distributed_model`). A no-op for a float32 model on the CPU."""
    model.to(device)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def fp32_state(model) -> dict:
    """`model`'s state dict as a float32 reader on the CPU loads it back from disk: the weights a content hash
    is taken of, so a bf16 or GPU run's hash is the one its saved model gets when it is read back. The
    state dict itself (no copy) for a float32 model on the CPU."""
    return {k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
            for k, v in model.state_dict().items()}


def dtype_tag(dtype: torch.dtype) -> str:
    """'' for float32, else '-<dtype>': appended to a float32 content hash where it keys scores (the eval
    cache), since a bf16 copy of the same weights scores a little differently."""
    return "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")
