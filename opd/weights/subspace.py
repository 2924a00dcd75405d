"""Subspace merges of task matrices: TSV-M (Gargiulo et al., CVPR 2025) and Iso-C / Iso-CTS
(Marczak et al., ICML 2025), as pure torch functions and as mergekit methods.

A task matrix is one 2-D weight's update, Δ_t = θ_t − θ_0, shaped (m, n); r = min(m, n), T is
the number of tasks. Each function takes [Δ_1, ..., Δ_T] and returns the merged update; the
merged weight is θ_0 plus it. `alpha` scales the merged update, as the papers' α does.

Two rules go beyond the papers' code, so that no result depends on a basis the SVD is free to
choose; on task matrices of full rank whose stacked singular vectors are independent (the
papers' setting) neither changes anything:
- A singular component whose value is numerically zero (σ ≤ max(m, n)·eps·s, s the largest
  Frobenius norm among the Δ_t and Σ_t Δ_t) spans no direction a task chose: it is dropped, and
  the spectrum means below run over the components kept.
- Orthogonalisation is the polar factor over the column space: orth(X) = P_ρ Q_ρᵀ from the thin
  SVD X = P S Qᵀ, keeping the ρ singular values above max(shape)·eps·S_max. For X of full rank
  this is the papers' P Qᵀ; for a repeated direction ([u, u] → [u/√2, u/√2]) it adds no
  arbitrary new one.

Fallback: a tensor that is not a matrix (norms, biases: ndim ≠ 2) is merged as alpha · mean_t Δ_t,
the rule the papers' code uses for what it does not decompose. The mergekit methods apply the
same rule to vocabulary matrices (embeddings, lm_head): a token's row is a lookup, not a linear
map with a spectrum, and its update is usually confined to the tokens a task saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated

import torch
from mergekit.merge_methods import BasePolicy, InputContract, PerNonBase, TensorGroup, merge_method
from pydantic import Field

Tensor = torch.Tensor


def task_mean(deltas: Sequence[Tensor], alpha: float = 1.0) -> Tensor:
    """The fallback: alpha · (1/T) Σ_t Δ_t, for any shape."""
    return alpha * torch.stack(list(deltas)).mean(0)


def tsv_m(deltas: Sequence[Tensor], alpha: float = 1.0, rank_fraction: float | None = None) -> Tensor:
    """Task Singular Vectors merge (TSV-M).

    Each task keeps its top k = max(1, ⌊r·f⌋) singular components, f = rank_fraction (default 1/T):
    Δ_t ≈ U_t,k diag(σ_t,k) V_t,kᵀ. With U = [U_1,k … U_T,k] (m, Tk), σ = [σ_1,k … σ_T,k] (Tk,)
    and V = [V_1,k … V_T,k] (n, Tk), the tasks' singular vectors are decorrelated by replacing
    U and V with their nearest orthonormal matrices, U⊥ = orth(U), V⊥ = orth(V):

        merged = alpha · U⊥ diag(σ) V⊥ᵀ                                  (m, n)

    Orthogonal task matrices (disjoint row and column spaces) merge to their sum, truncated.
    """
    ds, out_dtype = _promote(deltas)
    if ds[0].ndim != 2:
        return task_mean(ds, alpha).to(out_dtype)
    r = min(ds[0].shape)
    f = 1 / len(ds) if rank_fraction is None else rank_fraction
    if not 0 < f <= 1:
        raise ValueError(f"tsv_m: rank_fraction must be in (0, 1], got {f}")
    k = max(1, int(r * f))
    tol = _tolerance(ds)
    us, ss, vhs = [], [], []
    for d in ds:
        u, s, vh = _svd(d, full_matrices=False)  # (m, r), (r,), (r, n)
        keep = s[:k] > tol
        us.append(u[:, :k][:, keep])
        ss.append(s[:k][keep])
        vhs.append(vh[:k][keep])
    s_cat = torch.cat(ss)  # (c,), c ≤ Tk
    if not len(s_cat):
        return torch.zeros_like(ds[0]).to(out_dtype)
    u_perp = _orthogonalise(torch.cat(us, 1))  # (m, c)
    vh_perp = _orthogonalise(torch.cat(vhs, 0))  # (c, n)
    return (alpha * (u_perp * s_cat) @ vh_perp).to(out_dtype)


def iso_c(deltas: Sequence[Tensor], alpha: float = 1.0) -> Tensor:
    """Isotropic merge in the common subspace (Iso-C).

    The task-arithmetic sum M = Σ_t Δ_t = U diag(σ) Vᵀ keeps its singular vectors; its spectrum is
    flattened to the mean σ̄ of the kept singular values:

        merged = alpha · σ̄ U Vᵀ                                          (m, n)

    so every direction the sum spans gets the same gain, and no task's weaker directions are
    drowned by another's dominant ones.
    """
    ds, out_dtype = _promote(deltas)
    if ds[0].ndim != 2:
        return task_mean(ds, alpha).to(out_dtype)
    u, s, vh = _svd(sum(ds), full_matrices=False)  # (m, r), (r,), (r, n)
    keep = s > _tolerance(ds)
    if not keep.any():
        return torch.zeros_like(ds[0]).to(out_dtype)
    return (alpha * s[keep].mean() * u[:, keep] @ vh[keep]).to(out_dtype)


def iso_cts_dims(r: int, n_tasks: int, common_space_fraction: float) -> tuple[int, int]:
    """(k, s): the common subspace's size and each task's, with k + T·s = r.

    The papers' code rounds the task-specific share to a multiple of T: s = round((r − ⌊r·f⌋)/T);
    capping s at ⌊r/T⌋ keeps k ≥ 0 where that rounds up past r.
    """
    s = min(r // n_tasks, round((r - int(r * common_space_fraction)) / n_tasks))
    return r - n_tasks * s, s


def iso_cts(deltas: Sequence[Tensor], alpha: float = 1.0, common_space_fraction: float = 0.8) -> Tensor:
    """Isotropic merge in common and task-specific subspaces (Iso-CTS).

    1. Common subspace: the top k singular components of M = Σ_t Δ_t, (U_c, σ_c, V_c), with k from
       `iso_cts_dims` (about common_space_fraction · r).
    2. Task-specific subspaces: each task with the common column space projected out,
       Δ̄_t = (I − U_c U_cᵀ) Δ_t, keeps its top s components (Ū_t, σ̄_t, V̄_t), s = (r − k)/T.
    3. U = [U_c, Ū_1 … Ū_T], V = [V_c, V̄_1 … V̄_T] (r columns each) are orthogonalised,
       U⊥ = orth(U), V⊥ = orth(V), and the spectrum σ = [σ_c, σ̄_1 … σ̄_T] is flattened:

        merged = alpha · mean(σ) U⊥ V⊥ᵀ                                   (m, n)

    common_space_fraction = 1 is Iso-C. The order of the blocks does not matter: orth commutes
    with a permutation of columns, and the flat spectrum sums the same rank-1 terms.
    """
    if not 0 <= common_space_fraction <= 1:
        raise ValueError(f"iso_cts: common_space_fraction must be in [0, 1], got {common_space_fraction}")
    ds, out_dtype = _promote(deltas)
    if ds[0].ndim != 2:
        return task_mean(ds, alpha).to(out_dtype)
    k, s_task = iso_cts_dims(min(ds[0].shape), len(ds), common_space_fraction)
    tol = _tolerance(ds)
    u, s, vh = _svd(sum(ds), full_matrices=False)  # (m, r), (r,), (r, n)
    keep = s[:k] > tol
    u_c = u[:, :k][:, keep]  # (m, k') common column space
    us, ss, vhs = [u_c], [s[:k][keep]], [vh[:k][keep]]
    for d in ds:
        ut, st, vht = _svd(d - u_c @ (u_c.T @ d), full_matrices=False)
        keep = st[:s_task] > tol
        us.append(ut[:, :s_task][:, keep])
        ss.append(st[:s_task][keep])
        vhs.append(vht[:s_task][keep])
    s_cat = torch.cat(ss)
    if not len(s_cat):
        return torch.zeros_like(ds[0]).to(out_dtype)
    u_perp = _orthogonalise(torch.cat(us, 1))  # (m, c)
    vh_perp = _orthogonalise(torch.cat(vhs, 0))  # (c, n)
    return (alpha * s_cat.mean() * u_perp @ vh_perp).to(out_dtype)


def _promote(deltas: Sequence[Tensor]) -> tuple[list[Tensor], torch.dtype]:
    """The deltas in a dtype torch's SVD takes (float32 at least), and the dtype to return."""
    if not deltas:
        raise ValueError("a subspace merge needs at least one task matrix")
    shapes = {tuple(d.shape) for d in deltas}
    if len(shapes) != 1:
        raise ValueError(f"task matrices differ in shape: {sorted(shapes)}")
    work = torch.promote_types(deltas[0].dtype, torch.float32)
    return [d.to(work) for d in deltas], deltas[0].dtype


def _tolerance(ds: list[Tensor]) -> float:
    """Below this a singular value is numerical noise (torch.linalg.matrix_rank's rule, with a
    scale shared by the tasks and their sum so that every SVD of one layer uses the same cut)."""
    scale = max([torch.linalg.matrix_norm(d).item() for d in ds] + [torch.linalg.matrix_norm(sum(ds)).item()])
    return max(ds[0].shape) * torch.finfo(ds[0].dtype).eps * scale


def _svd(x: Tensor, full_matrices: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """torch.linalg.svd, retried in float64 when LAPACK's gesdd fails to converge. It does on
    ill-conditioned inputs with many repeated singular values: Iso-CTS's stacked bases of bf16-stored
    experts at 0.5B did (bench/bench_scale.py). The factors come back in x's dtype."""
    try:
        return torch.linalg.svd(x, full_matrices=full_matrices)
    except torch.linalg.LinAlgError:
        if x.dtype == torch.float64:
            raise
        return tuple(t.to(x.dtype) for t in torch.linalg.svd(x.double(), full_matrices=full_matrices))


def _orthogonalise(x: Tensor) -> Tensor:
    """The polar factor of x over its column space: P_ρ Q_ρᵀ from x = P S Qᵀ, ρ = numerical rank."""
    p, s, qh = _svd(x, full_matrices=False)
    rank = int((s > max(x.shape) * torch.finfo(x.dtype).eps * s.max()).sum()) if len(s) else 0
    return p[:, :rank] @ qh[:rank]


# mergekit adapters: Δ_t = weight_t · (expert_t − base); the merged tensor is base + merged Δ.
_VOCAB_NAMES = ("embed", "lm_head", "wte", "wpe", "word_embeddings")
_CONTRACT = InputContract(base=BasePolicy.REQUIRED, min_non_base=1)
Alpha = Annotated[float, Field(description="scale of the merged task matrix")]


def is_vocabulary(name: str) -> bool:
    """Whether a tensor's name says it is a vocabulary matrix (embedding, lm_head)."""
    return any(v in name for v in _VOCAB_NAMES)


def decomposes(group: TensorGroup) -> bool:
    """Whether a tensor is merged by its spectrum: a 2-D weight that is not a vocabulary matrix."""
    name = group.metadata.name or ""
    vocab = group.metadata.vocabulary_axis is not None or is_vocabulary(name)
    return group.base.tensor.ndim == 2 and not vocab


def _merge(fn, group: TensorGroup, weight: PerNonBase[float], alpha: float, **kw) -> Tensor:
    base = group.base.tensor
    entries = group.non_base
    deltas = [w * (e.tensor - base) for e, w in zip(entries, weight.values_for(entries))]
    merged = fn(deltas, alpha=alpha, **kw) if decomposes(group) else task_mean(deltas, alpha)
    return base + merged.to(base.dtype)


@merge_method(name="tsv_m", pretty_name="TSV-M", reference_url="https://arxiv.org/abs/2412.00081",
              contract=_CONTRACT)
def tsv_m_merge(group: TensorGroup, weight: PerNonBase[float] = 1.0, alpha: Alpha = 1.0) -> torch.Tensor:
    return _merge(tsv_m, group, weight, alpha)


@merge_method(name="iso_c", pretty_name="Iso-C", reference_url="https://arxiv.org/abs/2502.04959",
              contract=_CONTRACT)
def iso_c_merge(group: TensorGroup, weight: PerNonBase[float] = 1.0, alpha: Alpha = 1.0) -> torch.Tensor:
    return _merge(iso_c, group, weight, alpha)


@merge_method(name="iso_cts", pretty_name="Iso-CTS", reference_url="https://arxiv.org/abs/2502.04959",
              contract=_CONTRACT)
def iso_cts_merge(group: TensorGroup, weight: PerNonBase[float] = 1.0, alpha: Alpha = 1.0,
                  common_space_fraction: Annotated[float, Field(ge=0, le=1)] = 0.8) -> torch.Tensor:
    return _merge(iso_cts, group, weight, alpha, common_space_fraction=common_space_fraction)


METHODS = (tsv_m_merge, iso_c_merge, iso_cts_merge)


# Streamed: the same merges with the task matrices read one at a time (opd.weights.lazy), for a
# matrix whose T copies do not fit a merge's run. What is held does not grow with T: one task
# matrix, their running sum, and the singular factors kept, r columns in all (TSV-M: k = r/T per
# task; Iso-CTS: the common k plus s = (r - k)/T per task). The operations and their order are
# those of `tsv_m`, `iso_c` and `iso_cts` on the list (its sums are `sum(ds)`, in order), so the
# merged matrix is the same tensor; the price is reading each task matrix twice for Iso-CTS.


def merge_streamed(inp, method: str, params: dict) -> Tensor:
    """mergekit method `method` (tsv_m, iso_c, iso_cts) on one decomposed matrix of `inp`
    (opd.weights.lazy.TensorInputs), Δ_t = weight_t · (expert_t − base) read one at a time;
    `params`: plain values (weight: {expert id: value}, alpha, common_space_fraction)."""
    base = inp.read(inp.base)
    experts = inp.experts

    def delta(t: int) -> Tensor:
        e = experts[t]
        return params["weight"][e] * (inp.read(e) - base)

    alpha = params["alpha"]
    if method == "tsv_m":
        merged = tsv_m_streamed(delta, len(experts), alpha)
    elif method == "iso_c":
        merged = iso_cts_streamed(delta, len(experts), alpha, 1.0, iso_c_rule=True)
    else:
        merged = iso_cts_streamed(delta, len(experts), alpha, params["common_space_fraction"])
    return base + merged.to(base.dtype)


def _work(d: Tensor, shape: tuple | None) -> Tensor:
    """One task matrix in the dtype the SVD takes (as `_promote`), its shape checked against `shape`."""
    if shape is not None and tuple(d.shape) != shape:
        raise ValueError(f"task matrices differ in shape: {sorted({shape, tuple(d.shape)})}")
    return d.to(torch.promote_types(d.dtype, torch.float32))


def _norms_and_sum(delta: Callable[[int], Tensor], n_tasks: int) -> tuple[Tensor, float, torch.dtype]:
    """One pass: Σ_t Δ_t (in order), `_tolerance`'s cut for the T matrices, and their dtype."""
    total, norms, shape, out_dtype = None, [], None, None
    for t in range(n_tasks):
        raw = delta(t)
        out_dtype = out_dtype or raw.dtype
        d = _work(raw, shape)
        shape = tuple(d.shape)
        norms.append(torch.linalg.matrix_norm(d).item())
        total = d if total is None else total + d
        del d, raw
    scale = max(norms + [torch.linalg.matrix_norm(total).item()])
    return total, max(shape) * torch.finfo(total.dtype).eps * scale, out_dtype


def tsv_m_streamed(delta: Callable[[int], Tensor], n_tasks: int, alpha: float = 1.0,
                   rank_fraction: float | None = None) -> Tensor:
    """`tsv_m([delta(0), ..., delta(T-1)], alpha, rank_fraction)`, reading each Δ_t once and keeping
    its top k singular factors, not Δ_t (the cut at the tolerance is applied once all are read)."""
    if n_tasks < 1:
        raise ValueError("a subspace merge needs at least one task matrix")
    first = delta(0)
    if first.ndim != 2:
        return task_mean([delta(t) for t in range(n_tasks)], alpha)
    r = min(first.shape)
    f = 1 / n_tasks if rank_fraction is None else rank_fraction
    if not 0 < f <= 1:
        raise ValueError(f"tsv_m: rank_fraction must be in (0, 1], got {f}")
    k = max(1, int(r * f))
    out_dtype, shape = first.dtype, tuple(first.shape)
    del first
    total, norms, factors = None, [], []
    for t in range(n_tasks):
        d = _work(delta(t), shape)
        norms.append(torch.linalg.matrix_norm(d).item())
        total = d if total is None else total + d
        u, s, vh = _svd(d, full_matrices=False)  # (m, r), (r,), (r, n)
        factors.append((u[:, :k].clone(), s[:k].clone(), vh[:k].clone()))  # copies: the full factors go
        del d, u, s, vh
    tol = max(shape) * torch.finfo(total.dtype).eps * max(norms + [torch.linalg.matrix_norm(total).item()])
    del total
    us, ss, vhs = [], [], []
    for u, s, vh in factors:
        keep = s > tol
        us.append(u[:, keep])
        ss.append(s[keep])
        vhs.append(vh[keep])
    s_cat = torch.cat(ss)
    if not len(s_cat):
        return torch.zeros(shape, dtype=out_dtype)
    u_perp = _orthogonalise(torch.cat(us, 1))  # (m, c)
    vh_perp = _orthogonalise(torch.cat(vhs, 0))  # (c, n)
    return (alpha * (u_perp * s_cat) @ vh_perp).to(out_dtype)


def iso_cts_streamed(delta: Callable[[int], Tensor], n_tasks: int, alpha: float = 1.0,
                     common_space_fraction: float = 0.8, iso_c_rule: bool = False) -> Tensor:
    """`iso_cts([delta(0), ...], alpha, common_space_fraction)` (with `iso_c_rule`: `iso_c`), reading
    the Δ_t once for their sum and the tolerance, and again, one at a time, for the task-specific
    factors after the common subspace is projected out."""
    if not 0 <= common_space_fraction <= 1:
        raise ValueError(f"iso_cts: common_space_fraction must be in [0, 1], got {common_space_fraction}")
    if n_tasks < 1:
        raise ValueError("a subspace merge needs at least one task matrix")
    first = delta(0)
    if first.ndim != 2:
        return task_mean([delta(t) for t in range(n_tasks)], alpha)
    del first
    total, tol, out_dtype = _norms_and_sum(delta, n_tasks)
    u, s, vh = _svd(total, full_matrices=False)  # (m, r), (r,), (r, n)
    del total
    if iso_c_rule:
        keep = s > tol
        if not keep.any():
            return torch.zeros((u.shape[0], vh.shape[1]), dtype=out_dtype)
        return (alpha * s[keep].mean() * u[:, keep] @ vh[keep]).to(out_dtype)
    shape = (u.shape[0], vh.shape[1])
    k, s_task = iso_cts_dims(min(shape), n_tasks, common_space_fraction)
    keep = s[:k] > tol
    u_c = u[:, :k][:, keep].clone()  # (m, k') common column space
    us, ss, vhs = [u_c], [s[:k][keep].clone()], [vh[:k][keep].clone()]
    del u, s, vh
    for t in range(n_tasks):
        d = _work(delta(t), shape)
        ut, st, vht = _svd(d - u_c @ (u_c.T @ d), full_matrices=False)
        keep = st[:s_task] > tol
        us.append(ut[:, :s_task][:, keep].clone())
        ss.append(st[:s_task][keep].clone())
        vhs.append(vht[:s_task][keep].clone())
        del d, ut, st, vht
    s_cat = torch.cat(ss)
    if not len(s_cat):
        return torch.zeros(shape, dtype=out_dtype)
    u_perp = _orthogonalise(torch.cat(us, 1))  # (m, c)
    vh_perp = _orthogonalise(torch.cat(vhs, 0))  # (c, n)
    return (alpha * s_cat.mean() * u_perp @ vh_perp).to(out_dtype)
