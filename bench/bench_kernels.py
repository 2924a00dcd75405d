"""Peak memory and time of the chunked heads against the naive full-logits formulas (forward + backward).

    python bench/bench_kernels.py                       # CPU: 1024 tokens by default, one thread
    python bench/bench_kernels.py --tokens 2048         # the full size (slow on a CPU)
    python bench/bench_kernels.py --device cuda         # GPU: also the Triton backend

Memory, measured honestly per device:
- CUDA: torch.cuda.max_memory_allocated() during the call minus what was allocated before it (the
  inputs), i.e. the extra bytes the op needed at its peak.
- CPU: tracemalloc does not see torch's allocator, so each variant runs in a fresh subprocess and
  reports the rise of the process's peak RSS (getrusage ru_maxrss) over its value just before the
  call; large torch buffers are mmapped and touched, so they show up in RSS. Also reported: the
  largest single tensor any op returned (a TorchDispatchMode probe, in a separate untimed run),
  which shows directly whether an [N, V] float32 tensor was ever built.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from opd_kernels import reverse_kl, reverse_kl_from_logits, selective_log_softmax, triton_available
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def make_inputs(a, device):
    # In-place scaling: a temporary copy of the weight would raise the CPU peak-RSS baseline.
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(a.tokens, a.hidden, device=device, generator=g).requires_grad_(True)
    weight = torch.randn(a.vocab, a.hidden, device=device, generator=g).mul_(0.05).requires_grad_(True)
    ids = torch.randint(0, a.vocab, (a.tokens,), device=device, generator=g)
    t_hidden = t_weight = None
    if a.op == "kl":
        t_hidden = torch.randn(a.tokens, a.hidden, device=device, generator=g)
        t_weight = torch.randn(a.vocab, a.hidden, device=device, generator=g).mul_(0.05)
    return hidden, weight, ids, t_hidden, t_weight


def step(a, variant, inputs):
    """One forward + backward of `a.op` with `variant` in {naive, torch, triton}."""
    hidden, weight, ids, t_hidden, t_weight = inputs
    if a.op == "selective":
        if variant == "naive":
            out = torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, ids[:, None])[:, 0]  # (N,)
        else:
            out = selective_log_softmax(hidden, weight, ids, chunk_size=a.chunk, backend=variant)
    elif variant == "naive":
        out = reverse_kl_from_logits(hidden @ weight.T, t_hidden @ t_weight.T)
    else:
        out = reverse_kl(hidden, weight, t_hidden, t_weight, chunk_size=a.chunk, backend=variant)
    out.sum().backward()
    hidden.grad = weight.grad = None


def measure(a, variant, device) -> dict:
    inputs = make_inputs(a, device)
    if device == "cuda":
        # Warm-up compiles the Triton kernels. Not on CPU: its own weight copy would raise the
        # peak-RSS baseline, and there is nothing to compile.
        small = argparse.Namespace(**{**vars(a), "tokens": 8})
        step(small, variant, make_inputs(small, device))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    step(a, variant, inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    with LargestTensor() as probe:
        step(a, variant, inputs)
    return {"variant": variant, "seconds": seconds, "peak_bytes": peak, "largest_tensor_bytes": probe.bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--op", choices=["selective", "kl", "both"], default="both")
    p.add_argument("--tokens", type=int, default=None, help="N (default: 2048 on CUDA, 1024 on CPU)")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: N / 16)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    a.tokens = a.tokens or (2048 if device == "cuda" else 1024)
    a.chunk = a.chunk or max(1, a.tokens // 16)

    if a.child:  # one variant in this fresh process, result as JSON on stdout
        print(json.dumps(measure(a, a.child, device)))
        return

    variants = ["naive", "torch"] + (["triton"] if device == "cuda" and triton_available() else [])
    print(f"device={device} threads={torch.get_num_threads()} tokens={a.tokens} vocab={a.vocab} "
          f"hidden={a.hidden} chunk={a.chunk}; [N,V] float32 logits = {a.tokens * a.vocab * 4 / 2**20:.0f} MiB, "
          f"[chunk,V] = {a.chunk * a.vocab * 4 / 2**20:.0f} MiB, [V,H] weight = {a.vocab * a.hidden * 4 / 2**20:.0f} MiB")
    for op in (["selective", "kl"] if a.op == "both" else [a.op]):
        a.op = op
        rows = []
        for v in variants:
            if device == "cuda":
                rows.append(measure(a, v, device))
            else:
                cmd = [sys.executable, __file__, "--device", "cpu", "--op", op, "--tokens", str(a.tokens),
                       "--vocab", str(a.vocab), "--hidden", str(a.hidden), "--chunk", str(a.chunk),
                       "--threads", str(a.threads), "--child", v]
                rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
        naive = rows[0]
        print(f"\n{op} (forward + backward)")
        print(f"{'variant':8} {'time s':>8} {'peak MiB':>9} {'largest tensor MiB':>19} {'time x naive':>13} {'peak x naive':>13}")
        for r in rows:
            print(f"{r['variant']:8} {r['seconds']:8.3f} {r['peak_bytes'] / 2**20:9.1f} "
                  f"{r['largest_tensor_bytes'] / 2**20:19.1f} {r['seconds'] / naive['seconds']:13.2f} "
                  f"{r['peak_bytes'] / max(naive['peak_bytes'], 1):13.3f}")


if __name__ == "__main__":
    main()
