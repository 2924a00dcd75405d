"""AdaMerging on WUDI: per-tensor merge coefficients learnt on unlabelled prompts, as pure torch
functions, the fit, and a mergekit method.

AdaMerging (Yang et al., ICLR 2024, "AdaMerging: Adaptive Model Merging for Multi-Task Learning")
keeps task arithmetic's form, θ = θ_0 + Σ_t λ_t τ_t, but learns one coefficient per task and per
layer (its "layer-wise" variant) by gradient descent on unlabelled test inputs. opd's version:

    θ_k = θ_0,k + a_k · S_k + Σ_t λ_t,k · τ_t,k          for every tensor k of the state dict,

- S_k: the WUDI merge's update of tensor k (opd.weights.wudi, alpha 1, the closed-form solve, with
  its `data` term on RegMean's Grams over `prompts` prompts), the start AdaMerging adjusts. A linear
  combination of the τ_t alone cannot express WUDI's per-input-direction mixing (at ten experts a
  trial of the same fit from task arithmetic, λ = 0.3 and no S, kept far less on lab10's val).
- a_k starts at 1 and λ_t,k at 0, so step 0 is the WUDI merge; T + 1 scalars per tensor in all
  (`granularity: tensor`), or T + 1 per output row of each tensor (`row`: per element of a 1-D one).
- The objective is not AdaMerging's prediction entropy but distillation from each expert on its own
  unlabelled data: the mean over experts t of the per-token KL(expert_t ‖ merged), on `samples`
  train prompts of t's capability (from its manifest) followed by t's own greedy completion, over
  the completion's positions (the stop token's included). No answers, no verifier: the prompts are
  unlabelled and each expert writes its own completions, as for RegMean's `inputs: completion`.
- Adam, `fit_steps` steps of rate `fit_lr`; each step takes `fit_batch` sequences of every expert,
  drawn with a generator seeded by `fit_seed`. Deterministic for a given machine and thread count.
  (Named `fit_*` so that they do not collide with OPD's `steps` and `lr` in `adamerging+opd`.)

Every tensor gets coefficients, norms and vocabulary matrices included (S_k there is WUDI's
fallback, the mean task vector). A tied lm_head is the embedding, one tensor.

The fit needs the base and the experts' directories: `prepare(paths, shared, per_model, base)` runs
it (or finds it in the process's cache, keyed by the inputs' content hashes and the settings) and
binds the coefficients to the merge inputs' ids (expert names in memory, model paths in run_merge);
the mergekit method then merges each tensor from its inputs with those coefficients, and refuses,
naming the input, when `prepare` did not run. A plain `mergekit-yaml` cannot run it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Literal, get_args

import torch
from mergekit.merge_methods import BasePolicy, InputContract, TensorGroup, merge_method, merge_state_dicts
from pydantic import Field
from torch.func import functional_call

from opd.display import display, step_bar
from opd.errors import OpdError
from opd.io import state_dict_hash
from opd.model_inputs import expert_record
from opd.weights import regmean, wudi
from opd.weights.state import merge_keys

Tensor = torch.Tensor
STEPS, LR, BATCH, SAMPLES, DATA, SEED = 300, 1e-2, 8, 128, 1.0, 0
Granularity = Literal["tensor", "row"]
GRANULARITY = "tensor"
DATA_SEED = 1  # which train prompts the fit sees: not RegMean's (seed 0), fixed so a YAML pins them


def combine(base: Tensor, start: Tensor, deltas: Sequence[Tensor], a: Tensor | float,
            lams: Tensor | Sequence) -> Tensor:
    """θ_0 + a · S + Σ_t λ_t τ_t for one tensor: base θ_0, start update S, task vectors τ_t (all one
    shape), a and one λ_t per task vector, each a scalar or (granularity `row`) one value per output
    row, shaped (rows, 1, ...) to broadcast. Differentiable in a and the λ."""
    if not isinstance(lams, Tensor):
        lams = torch.stack([torch.as_tensor(x, dtype=base.dtype) for x in lams]) if len(lams) else torch.zeros(0)
    if len(deltas) != len(lams):
        raise ValueError(f"adamerging: {len(deltas)} task vectors but {len(lams)} coefficients")
    out = base + a * start
    for lam, d in zip(lams, deltas):
        out = out + lam * d
    return out


def token_kl(teacher_lp: Tensor, student_logits: Tensor, mask: Tensor) -> Tensor:
    """Mean over the masked positions of KL(teacher ‖ student) = Σ_v p_v (log p_v − log q_v):
    teacher log-probs and student logits (B, T, V), mask (B, T) of 0/1."""
    student_lp = torch.log_softmax(student_logits.float(), dim=-1)
    kl = torch.nn.functional.kl_div(student_lp, teacher_lp, reduction="none", log_target=True).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def completion_batch(model, tokenizer, capability: str, n: int, seed: int = DATA_SEED) -> tuple[Tensor, ...]:
    """`n` train prompts of `capability` and `model`'s greedy completions of them, padded: (ids,
    attention mask, completion mask, prompt lengths), and `model`'s log-probs at the completion's
    positions (B, Tc, V): the targets of the fit."""
    # lazy: opd.rl.batch loads transformers and huggingface_hub
    from opd.rl.batch import completion_logits, pad_sequences

    prompts, completions = regmean.lab_completions(model, tokenizer, capability, n, seed)
    ids, attn, cmask, plen = pad_sequences(prompts, completions, tokenizer.pad_token_id)
    with torch.no_grad():
        lp = torch.log_softmax(completion_logits(model, ids, attn, plen, cmask.shape[1]).float(), -1)
    return ids, attn, cmask, plen, lp


def merged_params(base: Mapping[str, Tensor], start: Mapping[str, Tensor], deltas: Sequence[Mapping[str, Tensor]],
                  a: Mapping[str, Tensor], lam: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`combine` for every tensor k of `base`, with a[k] and λ[k]."""
    return {k: combine(base[k], start[k], [d[k] for d in deltas], a[k], lam[k]) for k in base}


def objective(model: torch.nn.Module, params: Mapping[str, Tensor], data: Sequence[tuple[Tensor, ...]],
              rows: Sequence[Tensor] | None = None) -> Tensor:
    """The fit's loss: the mean over experts of `token_kl` between each expert's `completion_batch`
    targets and `model` run with the weights `params` (all its rows, or `rows[t]` of expert t's)."""
    from opd.rl.batch import completion_logits  # lazy: opd.rl.batch loads transformers and huggingface_hub

    def merged(**kw):
        return functional_call(model, dict(params), (), kw)

    loss = 0.0
    for t, (ids, attn, cmask, plen, target) in enumerate(data):
        r = rows[t] if rows is not None else torch.arange(len(ids))
        logits = completion_logits(merged, ids[r], attn[r], plen[r], cmask.shape[1])
        loss = loss + token_kl(target[r], logits, cmask[r])
    return loss / len(data)


def coefficient_shape(tensor: Tensor, granularity: str) -> tuple[int, ...]:
    """One coefficient for the tensor (`tensor`), or one per output row (`row`), shaped to broadcast."""
    if granularity == "tensor" or tensor.ndim == 0:
        return ()
    return (tensor.shape[0],) + (1,) * (tensor.ndim - 1)


def fit(model: torch.nn.Module, base: Mapping[str, Tensor], start: Mapping[str, Tensor],
        deltas: Sequence[Mapping[str, Tensor]], data: Sequence[tuple[Tensor, ...]], steps: int = STEPS,
        lr: float = LR, batch: int = BATCH, seed: int = SEED, granularity: str = GRANULARITY,
        progress=None) -> tuple[dict[str, Tensor], dict[str, Tensor], list[float]]:
    """Learn a and λ (T, ...) of each tensor of `base` (a state dict `model` takes), for the start
    updates `start` and the T experts' task vectors `deltas`, each with its `completion_batch` in
    `data`: Adam on the mean of the experts' `token_kl`. Returns {tensor: a}, {tensor: λ} and the loss
    of each step. `progress(step, loss)` is called after each step."""
    shapes = {k: coefficient_shape(v, granularity) for k, v in base.items()}
    a = {k: torch.ones(sh, requires_grad=True) for k, sh in shapes.items()}
    lam = {k: torch.zeros((len(deltas), *sh), requires_grad=True) for k, sh in shapes.items()}
    opt = torch.optim.Adam([*a.values(), *lam.values()], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        rows = [torch.randint(len(d[0]), (min(batch, len(d[0])),), generator=gen) for d in data]
        loss = objective(model, merged_params(base, start, deltas, a, lam), data, rows)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, losses[-1])
    return {k: v.detach() for k, v in a.items()}, {k: v.detach() for k, v in lam.items()}, losses


# The process's fits: key -> ({tensor: a}, {tensor: λ (T, ...)}, canonical expert paths in λ's order);
# and what each merge input id (a name or a path) resolves to.
_FITS: dict[tuple, tuple[dict[str, Tensor], dict[str, Tensor], list[str]]] = {}
_BASE_ID = object()  # the base's id in the start's merge: never an expert's name or path
_CANON: dict[str, str] = {}
_BOUND: dict[tuple, tuple] = {}  # (frozenset of canonical expert paths, settings) -> fit key


def _settings(shared: Mapping | None) -> tuple:
    shared = dict(shared or {})
    out = []
    for name, kind, default, low in (("data", float, DATA, 0.0), ("prompts", int, regmean.PROMPTS, 1),
                                     ("samples", int, SAMPLES, 1), ("fit_steps", int, STEPS, 0),
                                     ("fit_lr", float, LR, 0.0), ("fit_batch", int, BATCH, 1),
                                     ("fit_seed", int, SEED, 0)):
        v = shared.get(name, default)
        ok = not isinstance(v, bool) and isinstance(v, int | float) and (kind is float or isinstance(v, int))
        if not ok or v < low:
            what = "an integer" if kind is int else "a number"
            raise OpdError(f"adamerging: {name} must be {what} of at least {low:g} for every tensor (the "
                           f"coefficients are fitted once for the whole model), got {v!r}")
        out.append(kind(v))
    inputs = shared.get("inputs", regmean.INPUTS)
    if inputs not in ("prompt", "completion"):
        raise OpdError(f"adamerging: inputs must be 'prompt' or 'completion', got {inputs!r}")
    granularity = shared.get("granularity", GRANULARITY)
    if granularity not in get_args(Granularity):
        raise OpdError(f"adamerging: granularity must be one of {list(get_args(Granularity))}, got {granularity!r}")
    return (*out, inputs, granularity)


def prepare(paths: Mapping[Hashable, str | Path], shared: Mapping | None = None,
            per_model: Mapping | None = None, base: str | Path | None = None) -> None:
    """Fit the coefficients for the base at `base` and the experts at `paths` (input id -> directory),
    or find the fit in the process's cache, and bind it to the inputs' ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers is slow to import

    if base is None:
        raise OpdError("adamerging needs the base model's directory to fit its coefficients")
    settings = _settings(shared)
    data, prompts, samples, steps, lr, batch, seed, inputs, granularity = settings
    canons = {i: str(Path(p).resolve()) for i, p in paths.items()}
    order = sorted(set(canons.values()))
    manifests = {c: expert_record(c) for c in order}
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    key = (state_dict_hash(base_model), tuple(manifests[c].content_hash for c in order), settings)
    wudi.prepare(paths, {"data": data, "prompts": prompts, "inputs": inputs})  # the start's Grams, by these ids
    if key not in _FITS:
        tokenizer = AutoTokenizer.from_pretrained(base)
        base_sd = {k: v for k, v in merge_keys(base_model.state_dict()).items() if v.is_floating_point()}
        experts, batches = [], []
        for c in order:
            model = AutoModelForCausalLM.from_pretrained(c, dtype=torch.float32).eval()
            sd = merge_keys(model.state_dict())
            experts.append({k: sd[k].detach() for k in base_sd})
            batches.append(completion_batch(model, tokenizer, manifests[c].capability, samples, DATA_SEED))
        ids = {c: i for i, c in canons.items()}
        start = _start(base_sd, dict(zip((ids[c] for c in order), experts)), data, prompts, inputs)
        # Memory (docs/memory.md): the fit differentiates through θ = base + Σ λ_t τ_t over the whole
        # model, so it holds every expert's task vector at once, N models: the one merge method that
        # does not stream. Each expert's tensors become its task vector in place, so that is N, not 2N.
        deltas = experts
        for e in deltas:
            for k in base_sd:
                e[k] = e[k] - base_sd[k]
        del experts, model, sd
        with _fit_bar(steps, len(order)) as progress:
            a, lam, _ = fit(base_model, base_sd, start, deltas, batches, steps, lr, batch, seed, granularity,
                            progress)
        _FITS[key] = (a, lam, order)
    for i, c in canons.items():
        _CANON[regmean._input_key(i)] = _CANON[c] = c
    _BOUND[(frozenset(order), settings)] = key


@contextmanager
def _fit_bar(steps: int, experts: int) -> Iterator[Callable[[int, float], None]]:
    """The fit's section of the live display (opd.display): its steps and the mean KL of the last."""
    bar = step_bar()
    task = bar.add_task(f"adamerging fit ({experts} experts)", total=steps, info="")

    def progress(step: int, loss: float) -> None:
        bar.update(task, completed=step, info=f"KL {loss:.3f}")

    with display.section("adamerging", lambda: bar):
        yield progress


def _start(base: Mapping[str, Tensor], experts: Mapping[Hashable, Mapping[str, Tensor]], data: float, prompts: int,
           inputs: str) -> dict[str, Tensor]:
    """WUDI's update of every tensor, as the mergekit method computes it (opd.weights.wudi): `experts`
    by the merge input ids whose Grams `wudi.prepare` bound."""
    models = {_BASE_ID: dict(base), **{i: dict(e) for i, e in experts.items()}}
    with torch.no_grad():
        merged = merge_state_dicts(models, "wudi", parameters={"alpha": 1.0, "solver": "exact", "data": data,
                                                               "prompts": prompts, "inputs": inputs}, base=_BASE_ID)
    return {k: merged[k] - base[k] for k in base}


def coefficients(ids: Sequence[Hashable], shared: Mapping | None, name: str) -> tuple[Tensor, Tensor]:
    """(a, λ of each input in `ids`' order, stacked) of tensor `name`, fitted by `prepare`."""
    canons = []
    for i in ids:
        c = _CANON.get(regmean._input_key(i))
        if c is None:
            raise OpdError(f"adamerging: no fitted coefficients for merge input {regmean._input_key(i)!r}; opd fits "
                           "them from the base and expert directories before merging (opd.weights.adamerging."
                           "prepare, called by opd.weights.merge.merge_candidate and run_mergekit); a plain "
                           "mergekit-yaml cannot")
        canons.append(c)
    key = _BOUND.get((frozenset(canons), _settings(shared)))
    if key is None:
        raise OpdError(f"adamerging: no fit for this set of experts and settings {_settings(shared)}; "
                       "opd.weights.adamerging.prepare fits it before the merge")
    a, lam, order = _FITS[key]
    if name not in a:
        raise OpdError(f"adamerging: tensor {name!r} was not in the base the coefficients were fitted on")
    return a[name], lam[name][[order.index(c) for c in canons]]


_CONTRACT = InputContract(base=BasePolicy.REQUIRED, min_non_base=1)


@merge_method(name="adamerging", pretty_name="AdaMerging (on WUDI)", reference_url="https://arxiv.org/abs/2310.02575",
              contract=_CONTRACT)
def adamerging_merge(
    group: TensorGroup,
    data: Annotated[float, Field(ge=0, description="the WUDI start's data term")] = DATA,
    prompts: Annotated[int, Field(ge=1, description="prompts per expert for the WUDI start's Grams")] = regmean.PROMPTS,
    inputs: wudi.InputsParam = regmean.INPUTS,
    samples: Annotated[int, Field(ge=1, description="train prompts per expert the fit distils on")] = SAMPLES,
    fit_steps: Annotated[int, Field(ge=0, description="Adam steps of the fit")] = STEPS,
    fit_lr: Annotated[float, Field(ge=0, description="the fit's learning rate")] = LR,
    fit_batch: Annotated[int, Field(ge=1, description="sequences per expert per step")] = BATCH,
    fit_seed: Annotated[int, Field(ge=0, description="seed of the fit's minibatches")] = SEED,
    granularity: Annotated[Granularity, Field(description="one coefficient per tensor, or per output row")]
    = GRANULARITY,
) -> torch.Tensor:
    base = group.base.tensor
    entries = group.non_base
    name = group.metadata.name or ""
    shared = {"data": data, "prompts": prompts, "inputs": inputs, "samples": samples, "fit_steps": fit_steps,
              "fit_lr": fit_lr, "fit_batch": fit_batch, "fit_seed": fit_seed, "granularity": granularity}
    a, lams = coefficients([e.id for e in entries], shared, name)
    deltas = [e.tensor - base for e in entries]
    start = wudi.update(group, deltas, data=data, prompts=prompts, inputs=inputs)
    return combine(base, start, deltas, a, lams).to(base.dtype)


METHODS = (adamerging_merge,)
# method -> hook(paths, shared parameters, per-model parameters, base), run before it merges
PREPARE = {"adamerging": prepare}
# Parameters that hold for the whole model (one fit): never searched per layer group.
WHOLE_MODEL = frozenset({"data", "fit_lr"})
