"""RegMean (Jin et al., ICLR 2023): per-layer least-squares merging on the experts' own inputs,
as pure torch functions, the Gram-matrix collection on unlabelled lab prompts, and a mergekit method.

For a linear layer y = W x, W shaped (out, in), and expert t with inputs X_t (n_t, in), RegMean
picks the W that reproduces every expert's outputs on its own inputs,

    min_W Σ_t c_t ‖X_t Wᵀ − X_t W_tᵀ‖²   →   W = (Σ_t c_t W_t G_t)(Σ_t c_t G_t)⁻¹,  G_t = X_tᵀX_t (in, in),

with c_t a per-expert importance (mergekit's `weight`, default 1). The paper conditions the
inverse by shrinking each Gram's off-diagonal entries, G_t' = α G_t + (1 − α) diag(G_t), and
uses G_t' above: α = 1 is the exact least squares, α = 0 a per-input-feature average of the
experts' columns weighted by each expert's input energy in that feature.

Where Σ_t c_t G_t' is singular (an input direction no expert's prompts excite) the data say nothing
about W along it; there the merge keeps the plain average W̄ = Σ c_t W_t / Σ c_t:

    W = W̄ + (Σ_t c_t W_t G_t' − W̄ G) G⁺,   G = Σ_t c_t G_t'     (out, in)

which is the formula above whenever G is invertible (W̄ G G⁻¹ = W̄).

Fallback: a tensor that is not a linear layer's weight (norms, embeddings, biases, anything with
no Gram) is merged as the plain weighted average Σ c_t θ_t / Σ c_t, the paper's rule for
everything outside its linear layers (unless `embeddings` or `norms` below say `regmean`). A tied
lm_head is no tensor of its own: it is the embedding, averaged with it by default.

Grams come from forward hooks on every nn.Linear of each expert (and its embedding's token counts
and its RMSNorms' input moments), over `prompts` unlabelled train-split prompts of that expert's
capability (its manifest's), no answers. Each G_t is the mean over the tokens, so an expert whose
sequences are longer does not weigh more. They are cached per (expert content hash, prompts,
inputs) for the life of the process, so a search computes them once per expert. mergekit methods
see tensors, not data: `prepare(paths, shared, per_model)` computes (or finds) the statistics and
binds them to the merge inputs' ids (expert names for the in-memory merge, model paths for
`run_merge`); `opd.weights.merge` calls it before either path merges, and the method refuses,
naming the input, when a Gram is missing.

Settings (the method's shared parameters; a recipe searches or fixes them, the export YAML pins them):

- `inputs`: which tokens the statistics are taken over. `prompt`: the prompts alone (the paper's
  unlabelled inputs). `completion`: each prompt followed by the expert's own greedy completion (up to
  its capability's max_new_tokens + 2, as lm-eval generates; the stop token, never fed back, left
  out). Still unlabelled: no answer and no verifier, the expert writes it. The least squares then
  fits the positions at which an answer is produced, which on the lab's short prompts are most of
  what the model does.
- `propagate`: where each expert's inputs come from. `expert`: its own forward pass (RegMean).
  `merged`: RegMean++ (Nguyen et al., 2025, arXiv 2508.03121): block by block, the inputs of block l
  are the partially merged model's (blocks < l already merged) on the expert's tokens, passed through
  the expert's own block l; its Grams merge block l, which then feeds block l + 1. The final norm and
  an untied head take the merged blocks' outputs through each expert's own tail. These statistics
  depend on the whole set, its importances, `alpha` and the rules below, so `prepare` computes them
  per merge (a few forward passes per block on the lab) and keeps the last few sets.
- `embeddings`: `average` (the paper's fallback) or `regmean`: the token embedding as the linear
  map one-hot(v) → E[v], whose input Gram is diag(share of the expert's tokens that are v), and, when
  the output head is tied to it, also as that head (input: the final hidden state), the two roles'
  least squares summed per token (`regmean_embedding`).
- `norms`: `average` or `regmean`: an RMSNorm's weight γ is the diagonal linear map x̂ → γ ⊙ x̂; its
  least squares weights each feature by the experts' input energy in it (`regmean_diagonal`).
"""

from __future__ import annotations

import atexit
import copy
import os
import random
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal, get_args

import torch
from mergekit.io.tensor_writer import TensorWriter
from mergekit.merge_methods import BasePolicy, InputContract, PerInput, TensorGroup, merge_method
from pydantic import Field

from opd.capabilities import get_capability
from opd.errors import OpdError
from opd.io import pid_alive
from opd.model_inputs import expert_record
from opd.rollout.base import SamplingParams
from opd.rollout.embedded import EmbeddedEngine
from opd.weights.lazy import LazyStateDict

Tensor = torch.Tensor
PROMPTS = 64  # unlabelled train prompts per expert, the method's default
DATA_SEED = 0  # which prompts: fixed, so a merge's YAML (with `prompts`) pins its Grams
BATCH = 32
Inputs = Literal["prompt", "completion"]
Propagate = Literal["expert", "merged"]
Rule = Literal["average", "regmean"]
INPUTS, PROPAGATE, RULE = "completion", "expert", "average"  # the method's defaults
HEAD = "@head"  # stats key suffix: `<embedding>.weight@head` is the Gram of a tied head's inputs


def task_average(weights: Sequence[Tensor], importance: Sequence[float] | None = None) -> Tensor:
    """The fallback: Σ_t c_t θ_t / Σ_t c_t (the plain mean when importance is None), any shape."""
    c = _importance(weights, importance)
    return sum(ci * w for ci, w in zip(c, weights)) / sum(c)


def in_float64(method: str, what: str, tensors: Sequence[Tensor]) -> tuple[list[Tensor], torch.dtype]:
    """`tensors` (one shape, else a one-line ValueError naming `method`) promoted to at least float64 for
    the solve, and the dtype to return the merged tensor in."""
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"{method}: {what} differ in shape: {sorted(shapes)}")
    out_dtype = tensors[0].dtype
    work = torch.promote_types(out_dtype, torch.float64)
    return [t.to(work) for t in tensors], out_dtype


def scale_off_diagonal(gram: Tensor, alpha: float) -> Tensor:
    """G' = α G + (1 − α) diag(G): the paper's conditioning, shrinking only off-diagonal entries."""
    return alpha * gram + (1 - alpha) * torch.diag_embed(torch.diagonal(gram))


def regmean_merge(weights: Sequence[Tensor], grams: Sequence[Tensor | None], alpha: float = 0.9,
                  importance: Sequence[float] | None = None) -> Tensor:
    """RegMean of T experts' weights W_t (out, in) with their input Grams G_t (in, in).

    Returns W = W̄ + (Σ_t c_t W_t G_t' − W̄ G) G⁺ with G_t' = `scale_off_diagonal(G_t, alpha)`,
    G = Σ_t c_t G_t', W̄ the c-weighted average, G⁺ the pseudo-inverse (numerical rank, as
    torch.linalg.pinv): for G invertible, (Σ_t c_t W_t G_t')(Σ_t c_t G_t')⁻¹. A tensor that is not
    2-D merges as `task_average` (grams ignored, may be None). Computed in float64 at least;
    returned in the weights' dtype.
    """
    if not weights:
        raise ValueError("regmean needs at least one expert's weight")
    ws, out_dtype = in_float64("regmean", "expert weights", weights)
    if not 0 <= alpha <= 1:
        raise ValueError(f"regmean: alpha must be in [0, 1], got {alpha}")
    if ws[0].ndim != 2:
        return task_average(ws, importance).to(out_dtype)
    n_in = ws[0].shape[1]
    if len(grams) != len(ws) or any(g is None or tuple(g.shape) != (n_in, n_in) for g in grams):
        got = [None if g is None else tuple(g.shape) for g in grams]
        raise ValueError(f"regmean: need one ({n_in}, {n_in}) Gram per expert, got {got}")
    c = _importance(ws, importance)
    gs = [ci * scale_off_diagonal(g.to(ws[0].device, ws[0].dtype), alpha) for ci, g in zip(c, grams)]  # c_t G_t' (in, in)
    g_sum = sum(gs)
    mean = task_average(ws, c)
    rhs = sum(w @ g for w, g in zip(ws, gs)) - mean @ g_sum  # (out, in)
    return (mean + rhs @ torch.linalg.pinv(g_sum, hermitian=True)).to(out_dtype)


def grams_from_inputs(inputs: Tensor) -> Tensor:
    """G = Xᵀ X for a layer's inputs X (..., in), every leading position one row; (in, in) in STATS_DTYPE
    at least (float64 inputs stay float64)."""
    x = inputs.reshape(-1, inputs.shape[-1])
    x = x.to(torch.promote_types(x.dtype, STATS_DTYPE))  # (N, in)
    return x.T @ x


def regmean_embedding(weights: Sequence[Tensor], freqs: Sequence[Tensor], head_grams: Sequence[Tensor] | None = None,
                      alpha: float = 0.9, importance: Sequence[float] | None = None) -> Tensor:
    """RegMean of T experts' token embeddings E_t (V, d), optionally tied to the output head.

    The lookup is the linear map one-hot(v) → E[v], whose input Gram is diag(n_t), n_t (V,) the share
    of expert t's tokens that are v. A tied head computes logits E h from the final hidden state h,
    whose Gram is G_t (d, d). Row v of the merge minimises both roles' squared errors on the experts'
    own inputs,

        Σ_t c_t [n_tv ‖e − E_t[v]‖² + (e − E_t[v]) G_t' (e − E_t[v])ᵀ]
        →  e_v = (Σ_t c_t E_t[v] (G_t' + n_tv I)) (Σ_t c_t (G_t' + n_tv I))⁺,

    G_t' = `scale_off_diagonal(G_t, alpha)`. Without head Grams (an untied embedding) this is
    e_v = Σ_t c_t n_tv E_t[v] / Σ_t c_t n_tv, the per-token average weighted by how often each expert's
    inputs use v. As in `regmean_merge`, directions the data leave free keep the c-weighted average
    ē_v (a token no expert uses, untied: ē_v). Solved for all rows at once from one eigendecomposition
    G = Σ_t c_t G_t' = U diag(λ) Uᵀ: row v's matrix is U diag(λ + m_v) Uᵀ, m_v = Σ_t c_t n_tv.
    Returned in the weights' dtype.
    """
    if not weights or len(freqs) != len(weights) or (head_grams is not None and len(head_grams) != len(weights)):
        raise ValueError("regmean_embedding: need one weight, one token frequency vector (and one head Gram if "
                         "tied) per expert")
    if not 0 <= alpha <= 1:
        raise ValueError(f"regmean: alpha must be in [0, 1], got {alpha}")
    out_dtype = weights[0].dtype
    work = torch.promote_types(out_dtype, torch.float64)
    ws = [w.to(work) for w in weights]  # (V, d) each
    V, d = ws[0].shape
    if any(tuple(w.shape) != (V, d) for w in ws) or any(tuple(n.shape) != (V,) for n in freqs):
        raise ValueError(f"regmean_embedding: need (V, d) = {(V, d)} weights and ({V},) token frequencies")
    c = _importance(ws, importance)
    mean = task_average(ws, c)  # (V, d)
    ns = [ci * n.to(ws[0].device, work) for ci, n in zip(c, freqs)]  # c_t n_t (V,)
    m = sum(ns)  # (V,)
    b = sum(n[:, None] * w for n, w in zip(ns, ws))  # Σ_t c_t n_tv E_t[v] (V, d)
    g_sum = torch.zeros(d, d, dtype=work, device=ws[0].device)
    if head_grams is not None:
        if any(tuple(g.shape) != (d, d) for g in head_grams):
            raise ValueError(f"regmean_embedding: need one ({d}, {d}) head Gram per expert")
        gs = [ci * scale_off_diagonal(g.to(ws[0].device, work), alpha) for ci, g in zip(c, head_grams)]
        g_sum = sum(gs)
        b = b + sum(w @ g for w, g in zip(ws, gs))
    lam, u = torch.linalg.eigh(g_sum)  # (d,), (d, d)
    denom = lam[None, :] + m[:, None]  # (V, d): the eigenvalues of each row's matrix
    # pinv's cut: singular values below d · eps · the largest count as zero
    tol = d * torch.finfo(work).eps * denom.abs().amax(dim=1, keepdim=True)
    keep = denom.abs() > tol
    inv = torch.where(keep, 1 / torch.where(keep, denom, torch.ones_like(denom)), torch.zeros_like(denom))
    resid = (b - mean @ g_sum - m[:, None] * mean) @ u  # (V, d), in the eigenbasis
    return (mean + (resid * inv) @ u.T).to(out_dtype)


def regmean_diagonal(weights: Sequence[Tensor], moments: Sequence[Tensor],
                     importance: Sequence[float] | None = None) -> Tensor:
    """RegMean of an elementwise scale γ_t (d,), e.g. an RMSNorm's weight (y = γ ⊙ x̂): the linear map
    diag(γ). Restricted to diagonal maps the least squares Σ_t c_t ‖(γ − γ_t) ⊙ x̂‖² splits per feature,

        γ_j = Σ_t c_t s_tj γ_tj / Σ_t c_t s_tj,   s_t (d,) = the mean of x̂_j² over expert t's inputs

    (its input Gram's diagonal; alpha does not act on it). A feature no expert's inputs reach keeps the
    c-weighted average. Returned in the weights' dtype.
    """
    if not weights or len(moments) != len(weights):
        raise ValueError("regmean_diagonal: need one weight and one moment vector per expert")
    out_dtype = weights[0].dtype
    work = torch.promote_types(out_dtype, torch.float64)
    ws = [w.to(work) for w in weights]
    if any(w.ndim != 1 or w.shape != ws[0].shape for w in ws) or any(s.shape != ws[0].shape for s in moments):
        raise ValueError(f"regmean_diagonal: need 1-D weights and moments of one shape, got {tuple(ws[0].shape)}")
    c = _importance(ws, importance)
    ss = [ci * s.to(ws[0].device, work) for ci, s in zip(c, moments)]
    total = sum(ss)
    num = sum(s * w for s, w in zip(ss, ws))
    mean = task_average(ws, c)
    return torch.where(total > 0, num / torch.where(total > 0, total, torch.ones_like(total)), mean).to(out_dtype)


def merge_tensor(weights: Sequence[Tensor], stats: Sequence[Tensor | None], alpha: float = 0.9,
                 importance: Sequence[float] | None = None, embeddings: str = RULE, norms: str = RULE,
                 head_grams: Sequence[Tensor] | None = None) -> Tensor:
    """One tensor's merge, chosen by the shapes of its statistics (one per expert, None: none):
    a matrix with Grams (in, in): `regmean_merge`; a matrix with token frequencies (V,) (an embedding):
    `regmean_embedding` if `embeddings` is "regmean" (with the tied head's Grams, if any); a vector with
    moments of its own shape (a norm): `regmean_diagonal` if `norms` is "regmean"; anything else the
    weighted average. Both merge paths (opd's in memory, mergekit's run_merge) and RegMean++'s block
    by block merge call it, so they agree tensor for tensor."""
    w0 = weights[0]
    if stats and all(s is not None for s in stats):
        s0 = stats[0]
        if w0.ndim == 2 and s0.ndim == 2:
            return regmean_merge(weights, stats, alpha, importance)
        if w0.ndim == 2 and s0.ndim == 1 and embeddings == "regmean":
            return regmean_embedding(weights, stats, head_grams, alpha, importance)
        if w0.ndim == 1 and tuple(s0.shape) == tuple(w0.shape) and norms == "regmean":
            return regmean_diagonal(weights, stats, importance)
    return task_average([w.to(torch.float64) for w in weights], importance).to(w0.dtype)


def merge_streamed(inp, params: Mapping, budget: int) -> Tensor | None:
    """RegMean on one tensor of `inp` (opd.weights.lazy.TensorInputs over the experts), reading one
    expert's weight and statistic at a time: `merge_tensor`'s result, holding running sums instead of
    N weights and Grams. `params`: the method's plain values (weight: {input id: value}, alpha, the
    statistics' settings). A linear layer's weight: `regmean_merge` as sums over the experts,
    Σ c_t G_t', Σ c_t W_t, Σ W_t c_t G_t' (float64; (in, in) and (out, in) each, whatever N). Anything
    merged as the weighted average: by blocks of rows within `budget` bytes. None (the caller merges
    the whole group) for the embedding and norm rules `regmean`, which stay whole."""
    ids = inp.ids
    importance = [params["weight"][i] for i in ids]
    settings = _Settings({k: params[k] for k in ("prompts", "inputs", "propagate", "alpha", "embeddings", "norms")})
    stats = STORE.for_merge(ids, settings, importance)
    name, alpha = inp.name, params["alpha"]
    shapes = [_stat_shape(s, name) for s in stats]
    if all(sh is not None for sh in shapes):
        if len(inp.shape) == 2 and len(shapes[0]) == 2:
            return _regmean_streamed(inp, [s for s in stats], alpha, importance)
        if len(inp.shape) == 2 and len(shapes[0]) == 1 and settings[4] == "regmean":
            return None
        if len(inp.shape) == 1 and shapes[0] == tuple(inp.shape) and settings[5] == "regmean":
            return None
    return _average_rows(inp, importance, budget)


def _stat_shape(stats: Mapping[str, Tensor], name: str) -> tuple | None:
    """A statistic's shape without reading it from disk (None: the expert has none for `name`)."""
    if name not in stats:
        return None
    shape = getattr(stats, "shape", None)  # a LazyStateDict reads it from the header
    return tuple(shape(name)) if shape is not None else tuple(stats[name].shape)


def _regmean_streamed(inp, stats: Sequence[Mapping[str, Tensor]], alpha: float, importance: Sequence[float]) -> Tensor:
    """`regmean_merge` over the experts of `inp`, one expert's W_t and G_t read at a time: the same
    operations in the same order (its sums start from the first term, as Python's `sum` adds to 0)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"regmean: alpha must be in [0, 1], got {alpha}")
    c = _importance(inp.ids, importance)
    n_in = inp.shape[1]
    w_sum = g_sum = wg_sum = None
    out_dtype = None
    for ci, i, s in zip(c, inp.ids, stats):
        w = inp.read(i)
        if tuple(w.shape) != tuple(inp.shape):
            raise ValueError(f"regmean: expert weights differ in shape: {sorted({tuple(inp.shape), tuple(w.shape)})}")
        out_dtype = out_dtype or w.dtype
        w = w.to(torch.promote_types(out_dtype, torch.float64))  # (out, in)
        g = s[inp.name]
        if tuple(g.shape) != (n_in, n_in):
            raise ValueError(f"regmean: need one ({n_in}, {n_in}) Gram per expert, got {tuple(g.shape)}")
        g = ci * scale_off_diagonal(g.to(w.device, w.dtype), alpha)  # c_t G_t' (in, in)
        g_sum = g if g_sum is None else g_sum + g
        cw = ci * w
        w_sum = cw if w_sum is None else w_sum + cw
        wg = w @ g  # (out, in)
        wg_sum = wg if wg_sum is None else wg_sum + wg
        del w, g, cw, wg
    mean = w_sum / sum(c)
    rhs = wg_sum - mean @ g_sum  # (out, in)
    return (mean + rhs @ torch.linalg.pinv(g_sum, hermitian=True)).to(out_dtype)


def _average_rows(inp, importance: Sequence[float], budget: int) -> Tensor:
    """`merge_tensor`'s fallback, the weighted average in float64, a block of rows at a time."""
    c = _importance(inp.ids, importance)
    step = inp.row_step(budget, 3 * len(inp.ids))  # a block's height shrinks as N grows
    out = None  # filled block by block: a concatenation would hold the tensor twice
    for lo in range(0, inp.shape[0], step):
        acc, out_dtype = None, None
        for ci, i in zip(c, inp.ids):
            w = inp.rows(i, lo, lo + step)
            out_dtype = out_dtype or w.dtype
            t = ci * w.to(torch.float64)
            acc = t if acc is None else acc + t
        block = (acc / sum(c)).to(out_dtype)
        if out is None:
            out = torch.empty(tuple(inp.shape), dtype=out_dtype)
        out[lo:lo + block.shape[0]] = block
    return out


def _importance(weights: Sequence[Tensor], importance: Sequence[float] | None) -> list[float]:
    c = [1.0] * len(weights) if importance is None else [float(v) for v in importance]
    if len(c) != len(weights) or any(v < 0 for v in c) or sum(c) <= 0:
        raise ValueError(f"regmean: need one non-negative importance per expert, not all zero; got {c}")
    return c


# Gram collection on unlabelled prompts.


def lab_prompts(capability: str, n: int, seed: int = DATA_SEED) -> list[str]:
    """n train-split prompts of `capability` (repeats possible in a small prompt space), no answers."""

    cap = get_capability(capability)
    rng = random.Random(f"regmean|{capability}|{seed}")
    return [cap.sample(rng, "train").prompt for _ in range(n)]


def lab_sequences(model, tokenizer, capability: str, n: int, inputs: str = INPUTS,
                  seed: int = DATA_SEED) -> list[list[int]]:
    """The token ids the statistics are taken over: `n` train prompts of `capability`, each followed,
    for inputs="completion", by `model`'s greedy completion without its last token (the stop, or the
    last of max_new_tokens + 2: generation never feeds it back)."""
    if inputs == "prompt":
        return [tokenizer(p, add_special_tokens=False).input_ids for p in lab_prompts(capability, n, seed)]
    return [p + c[:-1] for p, c in zip(*lab_completions(model, tokenizer, capability, n, seed))]


def lab_completions(model, tokenizer, capability: str, n: int,
                    seed: int = DATA_SEED) -> tuple[list[list[int]], list[list[int]]]:
    """The token ids of `n` train prompts of `capability` and of `model`'s greedy completion of each,
    its stop token included (up to the capability's max_new_tokens + 2 tokens, as lm-eval generates)."""

    prompts = lab_prompts(capability, n, seed)
    params = SamplingParams(temperature=0.0, max_new_tokens=get_capability(capability).max_new_tokens + 2)
    rollouts = EmbeddedEngine(model, tokenizer, batch_size=BATCH * 4).generate(prompts, 1, params)
    return [list(r.prompt_ids) for (r,) in rollouts], [list(r.completion_ids) for (r,) in rollouts]


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the hooked block has run (RegMean++'s prefix)."""


def _is_rms_norm(module) -> bool:
    weight = getattr(module, "weight", None)
    return hasattr(module, "variance_epsilon") and isinstance(weight, torch.Tensor) and weight.ndim == 1


@torch.no_grad()
def collect_stats(model: torch.nn.Module, sequences: Sequence[Sequence[int]], pad_id: int, batch: int = BATCH,
                  hooked: Callable[[str], bool] | None = None, stop: torch.nn.Module | None = None) -> dict[str, Tensor]:
    """Each hooked module's input statistics over the sequences' tokens (right-padded; padding
    excluded), each the mean over those tokens, in STATS_DTYPE (float32), keyed by its weight's name:
    nn.Linear `<m>.weight`: the Gram x xᵀ (in, in); nn.Embedding: the share of tokens that are each id
    (V,); RMSNorm (a 1-D weight and `variance_epsilon`): the mean of x̂² per feature (d,), x̂ the
    normalised input (one row per leading position, e.g. per head for Qwen3's q_norm).
    `hooked(module name)` picks the modules (default all); `stop`: end each pass after this module ran."""
    sums: dict[str, Tensor] = {}
    mask: list[Tensor] = []  # the batch's (B, T) bool mask, read by the hooks

    def add(name, value):
        sums[name] = sums[name] + value if name in sums else value

    def linear(name):
        def record(_module, args, _out):
            add(name, grams_from_inputs(args[0][mask[0]]))  # (B, T, in)[mask] -> (n, in)
        return record

    def embedding(name, size):
        def record(_module, args, _out):
            add(name, torch.bincount(args[0][mask[0]], minlength=size).to(STATS_DTYPE))  # (V,)
        return record

    def norm(name, eps):
        def record(_module, args, _out):
            x = args[0][mask[0]].to(torch.float64)  # (n, ..., d)
            x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            add(name, x_hat.pow(2).reshape(-1, x.shape[-1]).sum(0).to(STATS_DTYPE))  # (d,)
        return record

    def halt(_module, _args, _out):
        raise _Stop

    handles = []
    for n, m in model.named_modules():
        if hooked is not None and not hooked(n):
            continue
        if isinstance(m, torch.nn.Linear):
            handles.append(m.register_forward_hook(linear(f"{n}.weight")))
        elif isinstance(m, torch.nn.Embedding):
            handles.append(m.register_forward_hook(embedding(f"{n}.weight", m.num_embeddings)))
        elif _is_rms_norm(m):
            handles.append(m.register_forward_hook(norm(f"{n}.weight", m.variance_epsilon)))
    if stop is not None:
        handles.append(stop.register_forward_hook(halt))
    was_training = model.training
    model.eval()
    tokens = 0
    try:
        for i in range(0, len(sequences), batch):
            ids = sequences[i:i + batch]
            T = max(len(x) for x in ids)
            input_ids = torch.full((len(ids), T), pad_id, dtype=torch.long)  # (B, T)
            attn = torch.zeros((len(ids), T), dtype=torch.long)
            for r, x in enumerate(ids):
                input_ids[r, : len(x)] = torch.tensor(x)
                attn[r, : len(x)] = 1
            mask[:] = [attn.bool()]
            try:
                model(input_ids=input_ids, attention_mask=attn)
            except _Stop:
                pass
            tokens += int(attn.sum())
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {k: g.div_(tokens) for k, g in sums.items()}  # in place: the sums are this call's own tensors


@torch.no_grad()
def collect_grams(model: torch.nn.Module, tokenizer, prompts: Sequence[str], batch: int = BATCH) -> dict[str, Tensor]:
    """`collect_stats` over the prompts' tokens: {'<module>.weight': mean_tokens x xᵀ} for every
    nn.Linear of `model` (float32 (in, in)), and the embeddings' and RMSNorms' statistics."""
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    return collect_stats(model, ids, tokenizer.pad_token_id, batch)


def tied_head(model: torch.nn.Module) -> tuple[str, str] | None:
    """(input embedding's weight name, output head's weight name) when the head shares the embedding's
    weight (tie_word_embeddings), else None."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None or get_out() is None or get_out().weight is not get_in().weight:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return f"{names[id(get_in())]}.weight", f"{names[id(get_out())]}.weight"


def _blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder blocks: (their ModuleList's name, it), the list of num_hidden_layers modules."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return name, m
    raise OpdError(f"regmean propagate=merged: no list of the {n} decoder blocks in {type(model).__name__}")


@torch.no_grad()
def merged_stats(models: Sequence[torch.nn.Module], sequences: Sequence[Sequence[Sequence[int]]],
                 own: Sequence[Mapping[str, Tensor]], pad_id: int, alpha: float, importance: Sequence[float],
                 embeddings: str = RULE, norms: str = RULE, batch: int = BATCH) -> list[dict[str, Tensor]]:
    """RegMean++'s statistics: per expert, `own` (its own forward pass's, `collect_stats`) with every
    block's and the tail's replaced by those taken on the partially merged model's inputs.

    A working copy starts with the merged embedding (from `own`: with a tied head, that role's Gram is
    the expert's own, since the tensor is needed before any block runs). For l = 0 .. L-1, expert t's
    block l is put in place of the copy's, its tokens are run through the copy up to that block, the
    block's statistics recorded; then the copy's block l becomes the merge (`merge_tensor`) of the
    experts' blocks l with them. Last, the final norm and an untied head: each expert's own tail on
    the merged blocks' outputs. The mergekit method merges with these statistics and gets the copy's
    tensors, as both paths call `merge_tensor`."""
    work = copy.deepcopy(models[0])
    prefix, blocks = _blocks(work)
    expert_blocks = [_blocks(m)[1] for m in models]
    stats = [dict(s) for s in own]
    sds = [m.state_dict() for m in models]
    params = dict(work.named_parameters())  # unique tensors: a tied head appears once, as the embedding

    def merge_into(names):
        for n in names:
            heads = [s.get(n + HEAD) for s in stats]
            merged = merge_tensor([sd[n] for sd in sds], [s.get(n) for s in stats], alpha, importance, embeddings,
                                  norms, heads if all(h is not None for h in heads) else None)
            params[n].copy_(merged)

    def block_of(name):
        return name.startswith(f"{prefix}.")

    embed = getattr(work, "get_input_embeddings", lambda: None)()
    pre = [n for n, p in params.items() if not block_of(n) and embed is not None and p is embed.weight]
    merge_into(pre)
    for layer, block in enumerate(blocks):
        within = f"{prefix}.{layer}."
        for t in range(len(models)):
            blocks[layer] = expert_blocks[t][layer]
            try:
                stats[t].update(collect_stats(work, sequences[t], pad_id, batch, lambda n, w=within: n.startswith(w),
                                              stop=blocks[layer]))
            finally:
                blocks[layer] = block
        merge_into([n for n in params if n.startswith(within)])
    post = [n for n in params if not block_of(n) and n not in pre]
    kept = {n: params[n].detach().clone() for n in post}
    for t in range(len(models)):
        for n in post:
            params[n].copy_(sds[t][n])
        # the embedding's counts come back the same; the tied head's own Gram stays under HEAD
        stats[t].update(collect_stats(work, sequences[t], pad_id, batch, lambda n: not block_of(n)))
    for n in post:
        params[n].copy_(kept[n])
    return stats


# What the process keeps, and what it costs (docs/memory.md). Per expert and settings, its statistics:
# for every nn.Linear a float32 Gram (in, in) (STATS_DTYPE), plus an embedding's token shares (V,) and
# each RMSNorm's moments (d,): 4 · Σ_linear in² bytes, e.g. 4 · (6·h² + i²) per Qwen3 block of hidden
# h, intermediate i (q, k, v, o, gate, up see h inputs, down sees i; q/k/v and gate/up see the same
# input, but each keeps its own Gram). They grow with the number of experts, as the method needs, but
# live on disk (a safetensors file per expert in a temporary directory) and are read a tensor at a
# time (opd.weights.lazy.LazyStateDict): the streamed merge (`merge_streamed`) reads one expert's
# weight and Gram at a time and keeps running sums, so it holds one layer's sums, not N Grams. The
# models are not kept: RegMean++ (propagate=merged) loads the experts again from their directories
# for its block-by-block passes, and holds them all while it runs, with their statistics in memory.
STATS_DTYPE = torch.float32  # the statistics' dtype; the solve runs in float64 (`regmean_merge`)
MERGED_KEEP = 4  # RegMean++ statistics depend on every setting: keep the last few sets


class _Settings(tuple):
    """The shared parameters the statistics depend on, checked (OpdError names the bad one)."""

    def __new__(cls, shared: Mapping | None):
        shared = dict(shared or {})
        prompts = shared.get("prompts", PROMPTS)
        if isinstance(prompts, bool) or not isinstance(prompts, int) or prompts < 1:
            raise OpdError(f"regmean: prompts must be an integer of at least 1, got {prompts!r}")
        values = {}
        for name, kind, default in (("inputs", Inputs, INPUTS), ("propagate", Propagate, PROPAGATE),
                                    ("embeddings", Rule, RULE), ("norms", Rule, RULE)):
            values[name] = shared.get(name, default)
            if values[name] not in get_args(kind):
                raise OpdError(f"regmean: {name} must be one of {list(get_args(kind))}, got {values[name]!r}")
        alpha = shared.get("alpha", 0.9)
        if values["propagate"] == "merged" and (isinstance(alpha, bool) or not isinstance(alpha, int | float)):
            raise OpdError(f"regmean propagate=merged needs one alpha for every tensor, got {alpha!r}")
        return super().__new__(cls, (prompts, values["inputs"], values["propagate"], alpha if values["propagate"]
                                     == "merged" else None, values["embeddings"], values["norms"]))


def _merged_key(settings: tuple, members: Sequence[tuple[str, float]]) -> tuple:
    return (*settings, tuple(members))


def _merged_key(settings: tuple, members: Sequence[tuple[str, float]]) -> tuple:
    return (*settings, tuple(members))


def _input_key(input_id: Hashable) -> str:
    model = getattr(input_id, "model", None)  # mergekit's ModelReference in run_merge
    return str(Path(model.path).resolve()) if model is not None else str(input_id)


def sweep_dead_spills() -> None:
    """Remove the spill directories of RegMean processes that died by a signal, where atexit does not
    run (SIGTERM, SIGKILL): each holds ~N x the model's float32 statistics, and they had filled a disk.
    A directory is opd-regmean-<pid>-<random>; one whose process is gone is removed."""
    for p in Path(tempfile.gettempdir()).glob("opd-regmean-*-*"):
        parts = p.name.split("-")
        if len(parts) == 4 and parts[2].isdigit() and not pid_alive(int(parts[2])):
            shutil.rmtree(p, ignore_errors=True)


class StatsStore:
    """The statistics a process has computed, and which merge inputs they are bound to.

    One store (`STORE`) serves the process: a search computes each expert's statistics once. Tests
    and tools that need a clean slate call `clear()`, or make a store of their own."""

    def __init__(self, merged_keep: int = MERGED_KEEP):
        self.merged_keep = merged_keep
        self.stats: dict[tuple, Mapping[str, Tensor]] = {}  # (content hash, capability, prompts, seed, inputs) -> stats
        self.seqs: dict[tuple, list[list[int]]] = {}  # same key -> the token ids they were taken over
        self.models: dict[tuple, tuple[str, int]] = {}  # same key -> (model directory, pad id), for RegMean++
        self.canon: dict[str, str] = {}  # merge input id or path -> its resolved path
        self.bound: dict[tuple[str, int, str], tuple] = {}  # (resolved path, prompts, inputs) -> stats key
        self.merged: OrderedDict[tuple, dict[str, dict[str, Tensor]]] = OrderedDict()  # RegMean++ set -> path -> stats
        self.spill_dir: Path | None = None

    def clear(self) -> None:
        """Forget every statistic and binding (the spill files stay until the process ends)."""
        for d in (self.stats, self.seqs, self.models, self.canon, self.bound, self.merged):
            d.clear()

    def ensure(self, path: str | Path, prompts: int, inputs: str = INPUTS) -> tuple:
        """The key of the statistics of the expert at `path` (computed now if new to the store)."""
        from transformers import (  # lazy: transformers' Auto classes add ~0.45 s; only the statistics pass loads models
            AutoModelForCausalLM,
            AutoTokenizer,
        )


        manifest = expert_record(path)
        key = (manifest.content_hash, manifest.capability, prompts, DATA_SEED, inputs)
        if key not in self.stats:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path)
            seqs = lab_sequences(model, tokenizer, manifest.capability, prompts, inputs)
            stats = collect_stats(model, seqs, tokenizer.pad_token_id)
            tied = tied_head(model)
            if tied is not None and tied[1] in stats:
                stats[tied[0] + HEAD] = stats[tied[1]]
            del model
            self.stats[key], self.seqs[key] = self._spill(stats), seqs
            self.models[key] = (str(path), tokenizer.pad_token_id)
        return key

    def _spill(self, stats: dict[str, Tensor]) -> Mapping[str, Tensor]:
        """The statistics written to a safetensors file of the store's spill directory, and a lazy
        mapping over it: read a tensor at a time, so the store does not hold N experts' Grams in memory."""
        if self.spill_dir is None:
            sweep_dead_spills()
            self.spill_dir = Path(tempfile.mkdtemp(prefix=f"opd-regmean-{os.getpid()}-"))
            atexit.register(shutil.rmtree, self.spill_dir, True)
        d = self.spill_dir / f"stats-{len(list(self.spill_dir.iterdir()))}"
        # a tied head's Gram is the head's own tensor under a second name, and safetensors refuses shared
        # storage: that alias alone is copied. Written in shards of 64 MiB (mergekit's TensorWriter), each
        # statistic dropped once written, so serialising does not copy all of them at once.
        seen = set()
        names = list(stats)
        with TensorWriter(str(d), max_shard_size=64 << 20) as w:
            for k in names:
                v = stats.pop(k)
                w.save_tensor(k, v.clone() if v.data_ptr() in seen else v)
                seen.add(v.data_ptr())
                del v
        return LazyStateDict(d, names=names, dtype=None)

    def prepare(self, paths: Mapping[Hashable, str | Path], shared: Mapping | None = None,
                per_model: Mapping[Hashable, Mapping] | None = None, base: str | Path | None = None) -> None:
        """See the module function `prepare`."""
        settings = _Settings(shared)
        prompts, inputs, propagate, alpha, embeddings, norms = settings
        members, keys = [], []
        for input_id, path in paths.items():
            canon = str(Path(path).resolve())
            key = self.ensure(path, prompts, inputs)
            self.canon[str(input_id)] = self.canon[canon] = canon
            self.bound[(canon, prompts, inputs)] = key
            weight = (per_model or {}).get(input_id, {}).get("weight", 1.0)
            if propagate == "merged" and (isinstance(weight, bool) or not isinstance(weight, int | float)):
                raise OpdError(f"regmean propagate=merged needs one weight per expert, got {weight!r} for {input_id!r}")
            members.append((canon, weight))
            keys.append(key)
        if propagate != "merged":
            return
        mkey = _merged_key(settings, members)
        if mkey not in self.merged:
            from transformers import (
                AutoModelForCausalLM,  # lazy: transformers' Auto classes add ~0.45 s; only the statistics pass loads models
            )

            models = [AutoModelForCausalLM.from_pretrained(self.models[k][0], dtype=torch.float32).eval() for k in keys]
            stats = merged_stats(models, [self.seqs[k] for k in keys], [self.stats[k] for k in keys],
                                 self.models[keys[0]][1], float(alpha), [float(w) for _, w in members], embeddings,
                                 norms)
            del models
            self.merged[mkey] = {canon: s for (canon, _), s in zip(members, stats)}
            while len(self.merged) > self.merged_keep:
                self.merged.popitem(last=False)
        self.merged.move_to_end(mkey)

    def resolve(self, input_id: Hashable, prompts: int, inputs: str, method: str = "regmean") -> str:
        """The resolved path `prepare` bound merge input `input_id` to (OpdError if none)."""
        canon = self.canon.get(_input_key(input_id))
        if canon is None or (canon, prompts, inputs) not in self.bound:
            raise OpdError(f"{method}: no Gram matrices for merge input {_input_key(input_id)!r} (prompts={prompts}, "
                           f"inputs={inputs}); opd computes them from the expert's directory before merging "
                           "(opd.weights.regmean.prepare, called by opd.weights.merge.merge_candidate and "
                           "run_mergekit); a plain mergekit-yaml cannot")
        return canon

    def input_stats(self, ids: Sequence[Hashable], prompts: int = PROMPTS, inputs: str = INPUTS,
                    method: str = "regmean") -> list[Mapping[str, Tensor]]:
        """See the module function `input_stats`."""
        return [self.stats[self.bound[(c, prompts, inputs)]]
                for c in (self.resolve(i, prompts, inputs, method) for i in ids)]

    def for_merge(self, ids: Sequence[Hashable], settings: tuple, weights: Sequence[float]) -> list[Mapping[str, Tensor]]:
        """Each input's statistics for these settings (RegMean++'s for the set when propagate=merged)."""
        prompts, inputs, propagate = settings[:3]
        if propagate != "merged":
            return self.input_stats(ids, prompts, inputs)
        canons = [self.resolve(i, prompts, inputs) for i in ids]
        mkey = _merged_key(settings, list(zip(canons, weights)))
        if mkey not in self.merged:
            raise OpdError(f"regmean propagate=merged: no statistics for this set of inputs and settings {settings}; "
                           "opd.weights.regmean.prepare computes them before the merge, with the same weights")
        return [self.merged[mkey][c] for c in canons]


STORE = StatsStore()  # the process's statistics: a search computes each expert's once


def expert_grams(path: str | Path, prompts: int = PROMPTS, inputs: str = INPUTS) -> Mapping[str, Tensor]:
    """The statistics of the expert at `path` on `prompts` prompts of its manifest's capability (cached)."""
    return STORE.stats[STORE.ensure(path, prompts, inputs)]


def prepare(paths: Mapping[Hashable, str | Path], shared: Mapping | None = None,
            per_model: Mapping[Hashable, Mapping] | None = None, base: str | Path | None = None) -> None:
    """Compute (or find) the statistics of each input and bind them to its id and its resolved path,
    so both merge paths (ids = names in memory, ModelReferences in run_merge) find them. For
    propagate=merged, also RegMean++'s statistics of the whole set with its importances (each input's
    `weight` in `per_model`, default 1; a single number, as the block-by-block merge needs)."""
    STORE.prepare(paths, shared, per_model, base)


def input_stats(ids: Sequence[Hashable], prompts: int = PROMPTS, inputs: str = INPUTS,
                method: str = "regmean") -> list[Mapping[str, Tensor]]:
    """Each merge input's own statistics (its forward pass's, bound by `prepare`), for a method that
    reads them by input id: RegMean, and WUDI's data term (opd.weights.wudi). OpdError, naming
    `method` and the input, where `prepare` did not run for it with these settings."""
    return STORE.input_stats(ids, prompts, inputs, method)


# mergekit adapter: the inputs are the experts (no base); the statistics come from `prepare`.
_CONTRACT = InputContract(base=BasePolicy.IGNORED, min_inputs=1)


@merge_method(name="regmean", pretty_name="RegMean", reference_url="https://arxiv.org/abs/2212.09849",
              contract=_CONTRACT)
def regmean_method(group: TensorGroup, weight: PerInput[float] = 1.0,
                   alpha: Annotated[float, Field(ge=0, le=1, description="off-diagonal scale of each Gram")] = 0.9,
                   prompts: Annotated[int, Field(ge=1, description="unlabelled train prompts per expert")] = PROMPTS,
                   inputs: Annotated[Inputs, Field(description="statistics over the prompt, or the prompt and the "
                                                   "expert's own greedy completion")] = INPUTS,
                   propagate: Annotated[Propagate, Field(description="each expert's inputs from its own forward "
                                                         "pass (RegMean), or block by block from the partially "
                                                         "merged model's (RegMean++)")] = PROPAGATE,
                   embeddings: Annotated[Rule, Field(description="token embedding (and a tied head): the average, "
                                                     "or least squares on token counts and head inputs")] = RULE,
                   norms: Annotated[Rule, Field(description="RMSNorm weights: the average, or per-feature least "
                                                "squares")] = RULE,
                   ) -> torch.Tensor:
    entries = group.entries
    tensors = [e.tensor for e in entries]
    importance = weight.values_for(entries)
    name = group.metadata.name or ""
    settings = _Settings({"prompts": prompts, "inputs": inputs, "propagate": propagate, "alpha": alpha,
                          "embeddings": embeddings, "norms": norms})
    stats = STORE.for_merge([e.id for e in entries], settings, importance)
    heads = [s.get(name + HEAD) for s in stats]
    return merge_tensor(tensors, [s.get(name) for s in stats], alpha, importance, embeddings, norms,
                        heads if all(h is not None for h in heads) else None)


METHODS = (regmean_method,)
PREPARE = {"regmean": prepare}  # method -> hook(paths, shared parameters, per-model parameters), run before it merges
