"""WUDI-Merging (Cheng et al., ICML 2025, "Whoever Started the Interference Should End It: Guiding
Data-Free Model Merging via Task Vectors"), with an optional data term, as pure torch functions and
a mergekit method.

A linear layer's task vector τ_i = W_i − W_0 is shaped (out, in). The paper shows that the rows of
τ_i approximately span the inputs task i feeds that layer, so they can stand in for those inputs:
the merged update τ_m should act on them as τ_i does. Data-free WUDI minimises

    Σ_i (1/‖τ_i‖²_F) ‖(τ_m − τ_i) τ_iᵀ‖²_F,

whose gradient vanishes where

    τ_m Σ_i G_i = Σ_i τ_i G_i,        G_i = τ_iᵀ τ_i / ‖τ_i‖²_F         (in, in), trace 1.

The paper runs Adam on the objective from the task-arithmetic sum; `solver: exact` solves this
linear system instead, which is the objective's optimum (the point Adam approaches), with a ridge
λ = RIDGE · tr(Σ_i G_i) / in on the diagonal, so that the system is well posed when the τ_i's rows do
not span the input space. Along such a direction the right-hand side is zero too, so the ridge puts
0 there (the minimum-norm optimum); along an eigendirection of Σ_i G_i with eigenvalue μ it shrinks
the optimum by μ / (μ + λ), about one part in 10⁶ on a layer whose task vectors spread their energy
over its inputs. A task vector that is zero (the expert left the layer alone) has no G_i of its own.

`solver: adam` is the paper's own procedure (its released code, `get_merge_vector`): τ_m starts at
the task-arithmetic sum Σ_i τ_i and takes `steps` Adam steps of learning rate `lr` (betas 0.9, 0.999)
on the objective, whose gradient 2 (τ_m Σ_i G_i − Σ_i τ_i G_i) needs only the two sums above. Adam
moves each entry by about `lr` a step, so `steps` × `lr` bounds how far τ_m leaves the sum, and the
result is not the optimum: on lab10's layer 3 down_proj (entries ~1e-2), data-free, the paper's 300
steps at 2e-5 end 18.6 (Frobenius) from the exact solve, against 19.0 for the sum itself.

Data-aware WUDI (`data` = d > 0) adds each expert's own inputs X_i (n_i, in) to its G_i,

    G_i = τ_iᵀ τ_i / ‖τ_i‖²_F + d · X_iᵀ X_i / tr(X_iᵀ X_i),

the minimiser of Σ_i [‖(τ_m − τ_i) τ_iᵀ‖² / ‖τ_i‖² + d ‖(τ_m − τ_i) X_iᵀ‖² / ‖X_i‖²]. The second
term is RegMean's least squares on the experts' inputs (opd.weights.regmean), so d interpolates:
d = 0 is WUDI, d → ∞ RegMean (alpha 1) with each expert's Gram scaled to trace 1. X_iᵀX_i is RegMean's
Gram of expert i's inputs to the layer on unlabelled train prompts of its capability, collected and
cached by opd.weights.regmean (`prompts`, `inputs` as there; `prepare` below runs its `prepare` when
d > 0). A matrix with no Gram (not an nn.Linear's weight) merges data-free.

The merged weight is W_0 + alpha · τ_m, τ_i = weight_i · (W_i − W_0) (mergekit's per-expert `weight`,
as for TSV-M).

Fallback, the rule TSV-M and Iso-C use (opd.weights.subspace): a tensor that is not a matrix (norms,
biases) and a vocabulary matrix (embeddings, lm_head: a token's row is a lookup, not a linear map of
an input) merge as alpha · mean_i τ_i.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

import torch
from mergekit.merge_methods import BasePolicy, InputContract, PerNonBase, TensorGroup, merge_method
from pydantic import Field

from opd.errors import OpdError
from opd.weights import regmean
from opd.weights.subspace import Alpha, decomposes, task_mean

Tensor = torch.Tensor
Solver = Literal["exact", "adam"]
LR, STEPS = 2e-5, 300  # solver adam: the paper's code's learning rate and iterations
RIDGE = 1e-6  # λ = RIDGE · tr(Σ_i G_i) / in: the relative ridge of the exact solve


def wudi_gram(delta: Tensor, gram: Tensor | None = None, data: float = 0.0) -> Tensor:
    """G = τᵀτ / ‖τ‖²_F + data · XᵀX / tr(XᵀX) for one task vector τ (out, in) and its inputs' Gram
    XᵀX (in, in); a zero τ (or Gram) contributes no term. Returned in τ's dtype, (in, in)."""
    g = delta.T @ delta  # (in, in)
    norm = torch.trace(g)  # ‖τ‖²_F
    g = g / norm if norm > 0 else torch.zeros_like(g)
    if data:
        x = gram.to(delta)
        tr = torch.trace(x)
        if tr > 0:
            g = g + data * x / tr
    return g


def wudi(
    deltas: Sequence[Tensor],
    alpha: float = 1.0,
    grams: Sequence[Tensor | None] | None = None,
    data: float = 0.0,
    solver: str = "exact",
    ridge: float = RIDGE,
    lr: float = LR,
    steps: int = STEPS,
) -> Tensor:
    """WUDI's merged update of T task vectors τ_i (out, in): alpha · τ_m, τ_m solving (`solver: exact`)

        τ_m (Σ_i G_i + λ I) = Σ_i τ_i G_i,   λ = ridge · tr(Σ_i G_i) / in,

    or (`solver: adam`) `steps` Adam steps of rate `lr` from τ_m = Σ_i τ_i on the objective (`adam`);
    G_i = `wudi_gram(τ_i, grams[i], data)`; `grams` (one (in, in) input Gram per expert) are needed
    only when data > 0. All τ_i zero: zero. A tensor that is not 2-D merges as alpha · mean_i τ_i
    (grams ignored). Computed in float64 at least; returned in the task vectors' dtype.
    """
    if solver not in get_args(Solver):
        raise ValueError(f"wudi: solver must be one of {list(get_args(Solver))}, got {solver!r}")
    if not data >= 0:
        raise ValueError(f"wudi: data must be >= 0, got {data}")
    if not (lr >= 0 and steps >= 0):
        raise ValueError(f"wudi: lr and steps must be >= 0, got lr={lr}, steps={steps}")
    if not deltas:
        raise ValueError("wudi needs at least one task vector")
    ds, out_dtype = regmean.in_float64("wudi", "task vectors", deltas)
    if ds[0].ndim != 2:
        return task_mean(ds, alpha).to(out_dtype)
    n_in = ds[0].shape[1]
    if data:
        if (
            grams is None
            or len(grams) != len(ds)
            or any(g is None or tuple(g.shape) != (n_in, n_in) for g in grams)
        ):
            got = None if grams is None else [None if g is None else tuple(g.shape) for g in grams]
            raise ValueError(f"wudi: data > 0 needs one ({n_in}, {n_in}) input Gram per expert, got {got}")
    gs = [wudi_gram(d, g, data) for d, g in zip(ds, grams if data else [None] * len(ds))]  # (in, in) each
    g_sum = sum(gs)
    trace = torch.trace(g_sum)
    if trace == 0:  # nothing to merge: every τ_i (and its data term) is zero
        return torch.zeros_like(ds[0]).to(out_dtype)
    rhs = sum(d @ g for d, g in zip(ds, gs))  # (out, in)
    if solver == "adam":
        return (alpha * adam(sum(ds), g_sum, rhs, lr, steps)).to(out_dtype)
    lam = ridge * trace / n_in
    eye = torch.eye(n_in, dtype=ds[0].dtype, device=ds[0].device)
    merged = torch.linalg.solve(g_sum + lam * eye, rhs, left=False)  # X (Σ G + λ I) = rhs
    return (alpha * merged).to(out_dtype)


def adam(start: Tensor, g_sum: Tensor, rhs: Tensor, lr: float = LR, steps: int = STEPS) -> Tensor:
    """`steps` Adam steps (torch.optim.Adam, betas 0.9 and 0.999, eps 1e-8) of rate `lr` from `start`
    (out, in) on the quadratic whose gradient is 2 (X Σ_i G_i − Σ_i τ_i G_i): `g_sum` (in, in), `rhs`
    (out, in). Returns X, detached, in `start`'s dtype."""
    x = torch.nn.Parameter(start.clone())
    opt = torch.optim.Adam([x], lr=lr)
    for _ in range(steps):
        x.grad = 2 * (x.detach() @ g_sum - rhs)  # (out, in)
        opt.step()
    return x.detach()


def objective(
    merged: Tensor, deltas: Sequence[Tensor], inputs: Sequence[Tensor] | None = None, data: float = 0.0
) -> Tensor:
    """The loss WUDI minimises at τ_m = `merged` (out, in): Σ_i ‖(τ_m − τ_i) τ_iᵀ‖² / ‖τ_i‖², plus
    data · Σ_i ‖(τ_m − τ_i) X_iᵀ‖² / ‖X_i‖² with the experts' inputs X_i (n_i, in) (scalar)."""
    loss = sum(((merged - d) @ d.T).square().sum() / d.square().sum() for d in deltas if d.any())
    if data:
        loss = loss + data * sum(
            ((merged - d) @ x.T).square().sum() / x.square().sum() for d, x in zip(deltas, inputs)
        )
    return loss


# mergekit adapter: τ_i = weight_i · (expert_i − base); the merged tensor is base + merged τ.
_CONTRACT = InputContract(base=BasePolicy.REQUIRED, min_non_base=1)
SolverParam = Annotated[
    Solver, Field(description="how the least squares is solved: its closed form, or the paper's Adam from the sum")
]
Lr = Annotated[float, Field(ge=0, description="solver adam: the learning rate")]
Steps = Annotated[int, Field(ge=0, description="solver adam: the number of steps")]
Data = Annotated[
    float, Field(ge=0, description="weight of each expert's unit-trace input Gram (0: data-free)")
]
Prompts = Annotated[int, Field(ge=1, description="unlabelled train prompts per expert (data > 0)")]
InputsParam = Annotated[regmean.Inputs, Field(description="Grams over the prompt, or with the completion")]


def needs_data(data: Any) -> bool:
    """Whether a merge with this `data` setting reads the experts' Grams: any value but a scalar 0
    (a per-layer-group value, as the in-memory merge or a mergekit YAML carries it, may)."""
    return not isinstance(data, int | float) or data != 0


def prepare(paths: Mapping, shared: Mapping | None = None, per_model: Mapping | None = None,
            base: str | None = None) -> None:
    """Before a data-aware merge (data > 0): the experts' Grams, through RegMean's `prepare` (computed
    once per expert and settings, cached for the process) and bound to the merge inputs' ids. `paths`:
    the experts' (input id -> directory), never the base's."""
    shared = dict(shared or {})
    data = shared.get("data", 0.0)
    if isinstance(data, int | float) and data < 0:
        raise OpdError(f"wudi: data must be >= 0, got {data}")
    if needs_data(data):
        # the data term's Grams are RegMean's, held as RegMean holds them (on disk, read a layer at a
        # time: opd.weights.regmean, docs/memory.md); data-free WUDI needs nothing beyond the tensors
        settings = {
            "prompts": shared.get("prompts", regmean.PROMPTS),
            "inputs": shared.get("inputs", regmean.INPUTS),
        }
        regmean.prepare(paths, settings)


@merge_method(
    name="wudi", pretty_name="WUDI", reference_url="https://arxiv.org/abs/2503.08099", contract=_CONTRACT
)
def wudi_merge(
    group: TensorGroup,
    weight: PerNonBase[float] = 1.0,
    alpha: Alpha = 1.0,
    solver: SolverParam = "exact",
    data: Data = 0.0,
    prompts: Prompts = regmean.PROMPTS,
    inputs: InputsParam = regmean.INPUTS,
    lr: Lr = LR,
    steps: Steps = STEPS,
) -> torch.Tensor:
    base = group.base.tensor
    entries = group.non_base
    deltas = [w * (e.tensor - base) for e, w in zip(entries, weight.values_for(entries))]
    return base + update(group, deltas, alpha, solver, data, prompts, inputs, lr, steps).to(base.dtype)


def update(group: TensorGroup, deltas: Sequence[Tensor], alpha: float = 1.0, solver: str = "exact",
           data: float = 0.0, prompts: int = regmean.PROMPTS, inputs: str = regmean.INPUTS, lr: float = LR,
           steps: int = STEPS) -> Tensor:
    """The merged update of one mergekit tensor group from its task vectors `deltas`: `wudi` for a
    matrix that decomposes (with the inputs' Grams when data > 0 and they exist), the mean otherwise."""
    if not decomposes(group):
        return task_mean(deltas, alpha)
    grams = None
    if data:
        stats = regmean.input_stats([e.id for e in group.non_base], prompts, inputs, method="wudi")
        grams = [s.get(group.metadata.name or "") for s in stats]
    if grams is None or any(g is None for g in grams):
        return wudi(deltas, alpha, solver=solver, lr=lr, steps=steps)
    return wudi(deltas, alpha, grams, data, solver, lr=lr, steps=steps)


METHODS = (wudi_merge,)
# method -> hook(paths, shared parameters, per-model parameters), run before it merges
PREPARE = {"wudi": prepare}
