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
everything outside its linear layers.

Gram matrices come from forward hooks on every nn.Linear of each expert, over `prompts`
unlabelled train-split prompts of that expert's capability (its manifest's), no answers. Each G_t
is the mean over the prompts' tokens, so an expert whose prompts are longer does not weigh more.
They are cached per (expert content hash, prompts) for the life of the process, so a search
computes them once per expert. mergekit methods see tensors, not data: `prepare(paths, prompts)`
computes (or finds) the Grams and binds them to the merge inputs' ids (expert names for the
in-memory merge, model paths for `run_merge`); `opd.weights.merge` calls it before either path
merges, and the method refuses, naming the input, when a Gram is missing.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Annotated

import torch
from mergekit.merge_methods import BasePolicy, InputContract, PerInput, TensorGroup, merge_method
from pydantic import Field

from opd.errors import OpdError

Tensor = torch.Tensor
PROMPTS = 64  # unlabelled train prompts per expert, the method's default
DATA_SEED = 0  # which prompts: fixed, so a merge's YAML (with `prompts`) pins its Grams
BATCH = 32


def task_average(weights: Sequence[Tensor], importance: Sequence[float] | None = None) -> Tensor:
    """The fallback: Σ_t c_t θ_t / Σ_t c_t (the plain mean when importance is None), any shape."""
    c = _importance(weights, importance)
    return sum(ci * w for ci, w in zip(c, weights)) / sum(c)


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
    shapes = {tuple(w.shape) for w in weights}
    if len(shapes) != 1:
        raise ValueError(f"regmean: expert weights differ in shape: {sorted(shapes)}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"regmean: alpha must be in [0, 1], got {alpha}")
    out_dtype = weights[0].dtype
    work = torch.promote_types(out_dtype, torch.float64)
    ws = [w.to(work) for w in weights]
    if ws[0].ndim != 2:
        return task_average(ws, importance).to(out_dtype)
    n_in = ws[0].shape[1]
    if len(grams) != len(ws) or any(g is None or tuple(g.shape) != (n_in, n_in) for g in grams):
        got = [None if g is None else tuple(g.shape) for g in grams]
        raise ValueError(f"regmean: need one ({n_in}, {n_in}) Gram per expert, got {got}")
    c = _importance(ws, importance)
    gs = [ci * scale_off_diagonal(g.to(ws[0].device, work), alpha) for ci, g in zip(c, grams)]  # c_t G_t' (in, in)
    g_sum = sum(gs)
    mean = task_average(ws, c)
    rhs = sum(w @ g for w, g in zip(ws, gs)) - mean @ g_sum  # (out, in)
    return (mean + rhs @ torch.linalg.pinv(g_sum, hermitian=True)).to(out_dtype)


def grams_from_inputs(inputs: Tensor) -> Tensor:
    """G = Xᵀ X for a layer's inputs X (..., in), every leading position one row; float64 (in, in)."""
    x = inputs.reshape(-1, inputs.shape[-1]).to(torch.float64)  # (N, in)
    return x.T @ x


def _importance(weights: Sequence[Tensor], importance: Sequence[float] | None) -> list[float]:
    c = [1.0] * len(weights) if importance is None else [float(v) for v in importance]
    if len(c) != len(weights) or any(v < 0 for v in c) or sum(c) <= 0:
        raise ValueError(f"regmean: need one non-negative importance per expert, not all zero; got {c}")
    return c


# Gram collection on unlabelled prompts.


def lab_prompts(capability: str, n: int, seed: int = DATA_SEED) -> list[str]:
    """n train-split prompts of `capability` (repeats possible in a small prompt space), no answers."""
    from opd.capabilities import get_capability

    cap = get_capability(capability)
    rng = random.Random(f"regmean|{capability}|{seed}")
    return [cap.sample(rng, "train").prompt for _ in range(n)]


@torch.no_grad()
def collect_grams(model: torch.nn.Module, tokenizer, prompts: Sequence[str], batch: int = BATCH) -> dict[str, Tensor]:
    """{'<module>.weight': mean_tokens x xᵀ} for every nn.Linear of `model`, over the prompts'
    tokens (right-padded; padding excluded). float64 (in, in) each."""
    sums: dict[str, Tensor] = {}
    mask: list[Tensor] = []  # the batch's (B, T) bool mask, read by the hooks

    def hook(name):
        def record(_module, args, _out):
            g = grams_from_inputs(args[0][mask[0]])  # (B, T, in)[mask] -> (n, in)
            sums[name] = sums[name] + g if name in sums else g
        return record

    handles = [m.register_forward_hook(hook(f"{n}.weight")) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    was_training = model.training
    model.eval()
    tokens = 0
    try:
        for i in range(0, len(prompts), batch):
            ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts[i:i + batch]]
            T = max(len(x) for x in ids)
            input_ids = torch.full((len(ids), T), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
            attn = torch.zeros((len(ids), T), dtype=torch.long)
            for r, x in enumerate(ids):
                input_ids[r, : len(x)] = torch.tensor(x)
                attn[r, : len(x)] = 1
            mask[:] = [attn.bool()]
            model(input_ids=input_ids, attention_mask=attn)
            tokens += int(attn.sum())
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {k: g / tokens for k, g in sums.items()}


_CACHE: dict[tuple, dict[str, Tensor]] = {}  # (content hash, capability, prompts, seed) -> Grams
_BOUND: dict[tuple[str, int], tuple] = {}  # (input key, prompts) -> _CACHE key


def expert_grams(path: str | Path, prompts: int = PROMPTS) -> dict[str, Tensor]:
    """The Grams of the expert at `path` on `prompts` prompts of its manifest's capability (cached)."""
    return _CACHE[_ensure(path, prompts)]


def _ensure(path: str | Path, prompts: int) -> tuple:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.manifest import load_manifest

    manifest = load_manifest(path)
    key = (manifest.content_hash, manifest.capability, prompts, DATA_SEED)
    if key not in _CACHE:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
        _CACHE[key] = collect_grams(model, tokenizer, lab_prompts(manifest.capability, prompts))
    return key


def prepare(paths: Mapping[Hashable, str | Path], shared: Mapping | None = None) -> None:
    """Compute (or find) the Grams of each input and bind them to its id and its resolved path,
    so both merge paths (ids = names in memory, ModelReferences in run_merge) find them."""
    prompts = int((shared or {}).get("prompts", PROMPTS))
    if prompts < 1:
        raise OpdError(f"regmean: prompts must be at least 1, got {prompts}")
    for input_id, path in paths.items():
        key = _ensure(path, prompts)
        _BOUND[(str(input_id), prompts)] = key
        _BOUND[(str(Path(path).resolve()), prompts)] = key


def _input_key(input_id: Hashable) -> str:
    model = getattr(input_id, "model", None)  # mergekit's ModelReference in run_merge
    return str(Path(model.path).resolve()) if model is not None else str(input_id)


def _gram(input_id: Hashable, prompts: int, name: str) -> Tensor | None:
    key = _BOUND.get((_input_key(input_id), prompts))
    if key is None:
        raise OpdError(f"regmean: no Gram matrices for merge input {_input_key(input_id)!r} (prompts={prompts}); "
                       "opd computes them from the expert's directory before merging (opd.weights.regmean.prepare, "
                       "called by opd.weights.merge.merge_candidate and run_mergekit); a plain mergekit-yaml cannot")
    return _CACHE[key].get(name)


# mergekit adapter: the inputs are the experts (no base); the Grams come from `prepare`.
_CONTRACT = InputContract(base=BasePolicy.IGNORED, min_inputs=1)


@merge_method(name="regmean", pretty_name="RegMean", reference_url="https://arxiv.org/abs/2212.09849",
              contract=_CONTRACT)
def regmean_method(group: TensorGroup, weight: PerInput[float] = 1.0,
                   alpha: Annotated[float, Field(ge=0, le=1, description="off-diagonal scale of each Gram")] = 0.9,
                   prompts: Annotated[int, Field(ge=1, description="unlabelled train prompts per expert")] = PROMPTS,
                   ) -> torch.Tensor:
    entries = group.entries
    tensors = [e.tensor for e in entries]
    grams = [_gram(e.id, prompts, group.metadata.name or "") for e in entries]
    if tensors[0].ndim != 2 or any(g is None for g in grams):
        return task_average([t.to(torch.float64) for t in tensors], weight.values_for(entries)).to(tensors[0].dtype)
    return regmean_merge(tensors, grams, alpha, weight.values_for(entries))


METHODS = (regmean_method,)
PREPARE = {"regmean": prepare}  # method -> hook(paths by input id, shared parameters), run before it merges


def register_methods() -> None:
    """Make `regmean` known to `mergekit.merge_methods.get` (once; mergekit refuses a repeat)."""
    from mergekit import merge_methods as mm

    known = {m.spec.name for m in mm.registered_methods()}
    for method in METHODS:
        if method.spec.name not in known:
            mm.register(method)
