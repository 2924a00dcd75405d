"""Triton row kernels for the chunked heads in `chunked.py` (CUDA only; imported lazily).

Each program owns one row of a float32 logits chunk z (c, V) made by a cuBLAS matmul and streams over
the vocabulary in BLOCK-wide tiles with an online logsumexp, so no exp/log-softmax copy of the chunk
is allocated; gradients are written in place into the chunk. Forward and backward both run here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _block(V: int) -> int:
    return min(4096, triton.next_power_of_2(V))


@triton.jit
def _lse_target_kernel(z_ptr, ids_ptr, lse_ptr, tgt_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    m = float("-inf")
    acc = 0.0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    t = tl.load(ids_ptr + row)
    tl.store(lse_ptr + row, m + tl.log(acc))
    tl.store(tgt_ptr + row, tl.load(base + t).to(tl.float32))


@triton.jit
def _dlogits_selective_kernel(z_ptr, ids_ptr, lse_ptr, g_ptr, V, stride, BLOCK: tl.constexpr):
    # d = g * (onehot(id) - exp(z - lse)), in place.
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    t = tl.load(ids_ptr + row)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        valid = cols < V
        x = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32)
        d = -g * tl.exp(x - lse) + tl.where(cols == t, g, 0.0)
        tl.store(base + cols, d, mask=valid)


@triton.jit
def _reverse_kl_kernel(zs_ptr, zt_ptr, kl_ptr, g_ptr, V, s_stride, t_stride, BLOCK: tl.constexpr,
                       WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_base = zs_ptr + row * s_stride
    t_base = zt_ptr + row * t_stride
    ms = float("-inf")
    acc_s = 0.0
    mt = float("-inf")
    acc_t = 0.0
    for v0 in range(0, V, BLOCK):  # pass 1: both logsumexps
        cols = v0 + tl.arange(0, BLOCK)
        valid = cols < V
        xs = tl.load(s_base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        xt = tl.load(t_base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        ms_new = tl.maximum(ms, tl.max(xs, 0))
        acc_s = acc_s * tl.exp(ms - ms_new) + tl.sum(tl.exp(xs - ms_new), 0)
        ms = ms_new
        mt_new = tl.maximum(mt, tl.max(xt, 0))
        acc_t = acc_t * tl.exp(mt - mt_new) + tl.sum(tl.exp(xt - mt_new), 0)
        mt = mt_new
    lse_s = ms + tl.log(acc_s)
    lse_t = mt + tl.log(acc_t)
    kl = 0.0
    for v0 in range(0, V, BLOCK):  # pass 2: sum_v p_s (log p_s - log p_t)
        cols = v0 + tl.arange(0, BLOCK)
        valid = cols < V
        ls = tl.load(s_base + cols, mask=valid, other=0.0).to(tl.float32) - lse_s
        lt = tl.load(t_base + cols, mask=valid, other=0.0).to(tl.float32) - lse_t
        kl += tl.sum(tl.where(valid, tl.exp(ls) * (ls - lt), 0.0), 0)
    tl.store(kl_ptr + row, kl)
    if WRITE_GRAD:  # pass 3: dKL/dz_s = g * p_s * (log p_s - log p_t - KL), in place in zs
        g = tl.load(g_ptr + row)
        for v0 in range(0, V, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            valid = cols < V
            ls = tl.load(s_base + cols, mask=valid, other=0.0).to(tl.float32) - lse_s
            lt = tl.load(t_base + cols, mask=valid, other=0.0).to(tl.float32) - lse_t
            tl.store(s_base + cols, g * tl.exp(ls) * (ls - lt - kl), mask=valid)


def _rows(z: torch.Tensor) -> torch.Tensor:
    if z.dim() != 2 or z.stride(1) != 1:
        z = z.contiguous()
    return z


def lse_target(z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z (c, V) float32, ids (c,) -> (logsumexp (c,), z[n, ids[n]] (c,))."""
    z = _rows(z)
    c, V = z.shape
    lse = torch.empty(c, dtype=torch.float32, device=z.device)
    tgt = torch.empty(c, dtype=torch.float32, device=z.device)
    _lse_target_kernel[(c,)](z, ids.contiguous(), lse, tgt, V, z.stride(0), BLOCK=_block(V), num_warps=8)
    return lse, tgt


def dlogits_selective(z: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Gradient of g * log_softmax(z)[ids] w.r.t. z (c, V), written into z and returned."""
    z = _rows(z)
    c, V = z.shape
    _dlogits_selective_kernel[(c,)](z, ids.contiguous(), lse.contiguous(), g.contiguous(), V, z.stride(0),
                                    BLOCK=_block(V), num_warps=8)
    return z


def reverse_kl(zs: torch.Tensor, zt: torch.Tensor) -> torch.Tensor:
    """KL(softmax(zs) || softmax(zt)) per row: (c, V), (c, V) -> (c,)."""
    zs, zt = _rows(zs), _rows(zt)
    c, V = zs.shape
    kl = torch.empty(c, dtype=torch.float32, device=zs.device)
    _reverse_kl_kernel[(c,)](zs, zt, kl, kl, V, zs.stride(0), zt.stride(0), BLOCK=_block(V),
                             WRITE_GRAD=False, num_warps=8)
    return kl


def dlogits_reverse_kl(zs: torch.Tensor, zt: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Gradient of g * KL(softmax(zs) || softmax(zt)) w.r.t. zs (c, V), written into zs and returned."""
    zs, zt = _rows(zs), _rows(zt)
    c, V = zs.shape
    kl = torch.empty(c, dtype=torch.float32, device=zs.device)
    _reverse_kl_kernel[(c,)](zs, zt, kl, g.float().contiguous(), V, zs.stride(0), zt.stride(0),
                             BLOCK=_block(V), WRITE_GRAD=True, num_warps=8)
    return zs
