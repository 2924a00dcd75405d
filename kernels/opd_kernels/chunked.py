"""Memory-lean log-prob and reverse-KL heads: logits are built chunk by chunk, never as one [N, V] tensor.

With N tokens and a vocabulary V of 151,936 (Qwen), float32 logits take 4*N*V bytes: 1.2 GB at
N = 2,048, and autograd would keep that plus a log-softmax copy alive until backward. Here each
chunk of `chunk_size` tokens (and, for selective_log_softmax, optionally `vocab_chunk_size` vocabulary
rows) is computed, reduced to per-token numbers and dropped; backward recomputes the chunk. Peak
extra memory is about chunk_size * V (or chunk_size * vocab_chunk_size) floats.

Row reductions on a chunk (logsumexp, target gather, softmax gradients) run in Triton when the
tensors are on CUDA and triton imports (`backend="auto"`), else in torch.

Shapes: N tokens, H hidden, V vocabulary. Results are float32.
"""

from __future__ import annotations

from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton"]


def _triton_ops(backend: Backend, device: torch.device):
    """The Triton row ops module when it should and can be used, else None (torch)."""
    if backend == "torch" or device.type != "cuda":
        if backend == "triton":
            raise RuntimeError("backend='triton' needs CUDA tensors")
        return None
    try:
        from opd_kernels import triton_kernels
    except ImportError:
        if backend == "triton":
            raise
        return None
    return triton_kernels


# ---- row ops on one chunk of float32 logits z: (c, V) -------------------------------------------


def _lse_target_torch(z: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.logsumexp(z, dim=-1), z.gather(1, ids[:, None])[:, 0]


def _dlogits_selective_torch(z, lse, ids, g, g_onehot=None) -> torch.Tensor:
    """d(g * (z[id] - lse)) / dz = g * (onehot(id) - softmax(z)), computed in place in z.

    g_onehot (default g) weights the one-hot term: zero for rows whose target lies outside this
    vocabulary block."""
    z.sub_(lse[:, None]).exp_().mul_(-g[:, None])
    z.scatter_add_(1, ids[:, None], (g if g_onehot is None else g_onehot)[:, None])
    return z


def _reverse_kl_torch(zs: torch.Tensor, zt: torch.Tensor):
    ls = torch.log_softmax(zs, dim=-1)  # (c, V)
    lt = torch.log_softmax(zt, dim=-1)
    kl = (ls.exp() * (ls - lt)).sum(-1)  # (c,)
    return kl, ls, lt


def _dlogits_reverse_kl_torch(zs, zt, g):
    """dKL/dz_s = p_s * ((log p_s - log p_t) - KL), times the incoming gradient g (c,)."""
    kl, ls, lt = _reverse_kl_torch(zs, zt)
    return ls.exp() * (ls - lt - kl[:, None]) * g[:, None]


# ---- selective log-softmax -----------------------------------------------------------------------


def selective_log_softmax_from_logits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., ids] without keeping a full log-softmax copy.

    logits: (..., V); ids: (...) -> (...) float32.
    """
    logits = logits.float()
    return logits.gather(-1, ids[..., None].long())[..., 0] - torch.logsumexp(logits, dim=-1)


def _vocab_blocks(V: int, vocab_chunk_size: int | None):
    step = V if vocab_chunk_size is None else vocab_chunk_size
    return [(v0, min(v0 + step, V)) for v0 in range(0, V, step)]


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, chunk_size, vocab_chunk_size, backend):
        N, V = hidden.shape[0], weight.shape[0]
        ops = _triton_ops(backend, hidden.device) if vocab_chunk_size is None else None
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
        out = torch.empty(N, dtype=torch.float32, device=hidden.device)
        w_full = weight.float()  # (V, H); no copy when already float32
        for s in range(0, N, chunk_size):
            h, t = hidden[s : s + chunk_size].float(), ids[s : s + chunk_size]  # (c, H), (c,)
            if vocab_chunk_size is None:
                z = h @ w_full.T  # (c, V)
                c_lse, c_tgt = ops.lse_target(z, t) if ops else _lse_target_torch(z, t)
            else:
                # Online logsumexp over vocabulary blocks (running max m, running sum of exp(z - m)).
                m = torch.full((h.shape[0],), -float("inf"), device=h.device)
                acc = torch.zeros(h.shape[0], device=h.device)
                c_tgt = torch.empty(h.shape[0], device=h.device)
                for v0, v1 in _vocab_blocks(V, vocab_chunk_size):
                    z = h @ weight[v0:v1].float().T  # (c, vb)
                    m_new = torch.maximum(m, z.max(dim=1).values)
                    acc = acc * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(1)
                    m = m_new
                    inside = (t >= v0) & (t < v1)
                    c_tgt[inside] = z[inside, t[inside] - v0]
                c_lse = m + torch.log(acc)
            lse[s : s + chunk_size] = c_lse
            out[s : s + chunk_size] = c_tgt - c_lse
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.cfg = (chunk_size, vocab_chunk_size, backend)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, ids, lse = ctx.saved_tensors
        chunk_size, vocab_chunk_size, backend = ctx.cfg
        ops = _triton_ops(backend, hidden.device) if vocab_chunk_size is None else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_all = grad_out.float()
        for s in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[s : s + chunk_size].float(), ids[s : s + chunk_size]
            g, c_lse = g_all[s : s + chunk_size], lse[s : s + chunk_size]
            for v0, v1 in _vocab_blocks(weight.shape[0], vocab_chunk_size):
                w = weight[v0:v1].float()  # (vb, H)
                z = h @ w.T  # (c, vb), recomputed instead of stored
                local = t - v0
                inside = (local >= 0) & (local < v1 - v0)
                if ops:
                    d = ops.dlogits_selective(z, c_lse, t, g)
                else:
                    # The one-hot term only lands on targets inside this block.
                    d = _dlogits_selective_torch(z, c_lse, local.clamp(0, v1 - v0 - 1), g, g * inside)
                # addmm_ accumulates in place: `grad_w += d.T @ h` would allocate a second (V, H).
                if need_h:
                    grad_h[s : s + chunk_size].addmm_(d, w)  # (c, H)
                if need_w:
                    grad_w[v0:v1].addmm_(d.T, h)  # (vb, H)
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            None, None, None, None,
        )


def selective_log_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    chunk_size: int = 1024,
    vocab_chunk_size: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """log_softmax(hidden @ weight.T)[n, ids[n]] for each token n, chunked, with autograd.

    hidden: (N, H); weight: (V, H) (the LM head); ids: (N,) -> (N,) float32. Gradients flow to
    hidden and weight; backward recomputes each chunk's logits. vocab_chunk_size also splits the
    vocabulary (online logsumexp), bounding memory by chunk_size * vocab_chunk_size.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or ids.shape != hidden.shape[:1]:
        raise ValueError(f"want hidden (N, H), weight (V, H), ids (N,); got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(ids.shape)}")
    return _SelectiveLogSoftmax.apply(hidden, weight, ids.long(), chunk_size, vocab_chunk_size, backend)


# ---- reverse KL ------------------------------------------------------------------------------------


def reverse_kl_from_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(student || teacher) over the full vocabulary: (..., V), (..., V) -> (...) float32."""
    ls = torch.log_softmax(student_logits.float(), dim=-1)
    lt = torch.log_softmax(teacher_logits.float(), dim=-1)
    return (ls.exp() * (ls - lt)).sum(-1)


def _teacher_chunk(t_hidden, t_weight, t_logits, s, e):
    if t_logits is not None:
        return t_logits[s:e].float()  # (c, V)
    return t_hidden[s:e].float() @ t_weight.float().T  # (c, V)


class _ReverseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s_hidden, s_weight, t_hidden, t_weight, t_logits, chunk_size, backend):
        ops = _triton_ops(backend, s_hidden.device)
        N = s_hidden.shape[0]
        out = torch.empty(N, dtype=torch.float32, device=s_hidden.device)
        with torch.no_grad():
            for s in range(0, N, chunk_size):
                e = min(s + chunk_size, N)
                zs = s_hidden[s:e].float() @ s_weight.float().T  # (c, V)
                zt = _teacher_chunk(t_hidden, t_weight, t_logits, s, e)
                out[s:e] = ops.reverse_kl(zs, zt) if ops else _reverse_kl_torch(zs, zt)[0]
        ctx.save_for_backward(s_hidden, s_weight, t_hidden, t_weight, t_logits)
        ctx.cfg = (chunk_size, backend)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        s_hidden, s_weight, t_hidden, t_weight, t_logits = ctx.saved_tensors
        chunk_size, backend = ctx.cfg
        ops = _triton_ops(backend, s_hidden.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(s_hidden.shape, dtype=torch.float32, device=s_hidden.device) if need_h else None
        grad_w = torch.zeros(s_weight.shape, dtype=torch.float32, device=s_weight.device) if need_w else None
        w = s_weight.float()  # (V, H)
        N = s_hidden.shape[0]
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            h = s_hidden[s:e].float()
            zs = h @ w.T  # (c, V)
            zt = _teacher_chunk(t_hidden, t_weight, t_logits, s, e)
            g = grad_out[s:e].float()
            d = ops.dlogits_reverse_kl(zs, zt, g) if ops else _dlogits_reverse_kl_torch(zs, zt, g)
            if need_h:
                grad_h[s:e] = d @ w  # (c, H)
            if need_w:
                grad_w.addmm_(d.T, h)  # (V, H), in place
        return (
            grad_h.to(s_hidden.dtype) if need_h else None,
            grad_w.to(s_weight.dtype) if need_w else None,
            None, None, None, None, None,
        )


def reverse_kl(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    *,
    teacher_logits: torch.Tensor | None = None,
    chunk_size: int = 1024,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Exact per-token KL(student || teacher) over the full vocabulary, chunked over tokens.

    student_hidden: (N, Hs); student_weight: (V, Hs). The teacher is either its final hidden states
    and LM head, teacher_hidden (N, Ht) and teacher_weight (V, Ht), or its logits (N, V) when the
    caller already holds them. -> (N,) float32. Gradients flow to the student only; the teacher is
    treated as a constant target (on-policy distillation).
    """
    if (teacher_logits is None) == (teacher_hidden is None or teacher_weight is None):
        raise ValueError("give either teacher_hidden and teacher_weight, or teacher_logits")
    if teacher_logits is not None and teacher_logits.shape != (student_hidden.shape[0], student_weight.shape[0]):
        raise ValueError(f"teacher_logits must be (N, V) = ({student_hidden.shape[0]}, {student_weight.shape[0]}), "
                         f"got {tuple(teacher_logits.shape)}")
    if teacher_weight is not None and teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"student and teacher vocabularies differ: {student_weight.shape[0]} vs {teacher_weight.shape[0]}")
    detach = [None if x is None else x.detach() for x in (teacher_hidden, teacher_weight, teacher_logits)]
    return _ReverseKL.apply(student_hidden, student_weight, *detach, chunk_size, backend)
