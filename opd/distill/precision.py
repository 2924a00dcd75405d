"""Which dtype samples and scores fastest on this machine: `inference_dtype: auto`.

bf16 halves the bytes a matrix product reads, but only hardware with bf16 arithmetic turns that into
speed: a CPU with AVX512-BF16 or AMX, or a GPU. On a CPU without it (AVX2 alone, e.g. many AMD EPYC
and older Xeon machines) oneDNN falls back to reference kernels and a bf16 product runs tens of
times slower than fp32 (measured here: 192 x 192 @ 192 x 512 in 0.9 ms fp32, 44 ms bf16, on an AMD
EPYC with AVX2). So `auto` times one product of the model's width in each dtype and takes bf16 only
where it is faster.
"""

from __future__ import annotations

import functools
import time

import torch

from opd.devices import bf16_supported


def _seconds(dtype: torch.dtype, width: int, device: torch.device, repeats: int = 5) -> float:
    a = torch.randn(256, width, device=device).to(dtype)
    b = torch.randn(width, 4 * width, device=device).to(dtype)
    a @ b  # warm-up: oneDNN builds its kernel on the first call
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


@functools.cache
def fastest_inference_dtype(width: int, device: str = "cpu") -> torch.dtype:
    """bfloat16 where a (256, width) @ (width, 4 width) product runs faster in it than in float32 on
    `device` (best of 5 each), else float32. Cached per (width, device): the answer is the machine's."""
    dev = torch.device(device)
    if dev.type == "cuda" and not bf16_supported(dev):
        return torch.float32
    return torch.bfloat16 if _seconds(torch.bfloat16, width, dev) < _seconds(torch.float32, width, dev) else torch.float32


def resolve_inference_dtype(name: str | None, model) -> torch.dtype:
    """The dtype the sampler and the stacked teachers run in: `name` ('float32', 'bfloat16', or 'auto':
    `fastest_inference_dtype` at the model's width), or the model's own when None."""
    own = next(model.parameters()).dtype
    if name is None:
        return own
    if name == "auto":
        device = next(model.parameters()).device
        return fastest_inference_dtype(model.config.hidden_size, str(device))
    return getattr(torch, name)
