"""Weight-space interference: how the experts' task vectors (expert − base) overlap, per layer group.

Pure functions on state dicts, no I/O. For each pair of experts (i, j) and each layer group:

- cosine: <τ_i, τ_j> / (||τ_i|| ||τ_j||) over the group's coordinates; None when either is zero there.
- sign_conflict: among the coordinates where both τ_i and τ_j are non-zero, the fraction where their
  signs differ (0: they agree wherever both moved, 1: they pull every shared weight opposite ways;
  0.5 is what independent random updates give). None when no coordinate is non-zero in both.
- norm_ratio: ||τ_i|| / ||τ_j||, row i over column j, so the matrix is reciprocal (r_ji = 1 / r_ij):
  how much more the row's expert moved the group than the column's. None when ||τ_j|| = 0.
"""

from __future__ import annotations

import math
import re

import torch

METRICS = ("cosine", "sign_conflict", "norm_ratio")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_EMBED = ("embed_tokens", "wte", "wpe", "embed_in", "word_embeddings")
_CHUNK = 1 << 20  # coordinates per matmul: (E, chunk) float64 stays small for big embeddings


def n_layers(names) -> int:
    """Transformer blocks in a state dict: 1 + the largest `layers.<i>.` index (0 when none)."""
    idx = [int(m.group(1)) for n in names if (m := _LAYER.search(n))]
    return max(idx) + 1 if idx else 0


def block_ranges(n: int) -> list[tuple[int, int]]:
    """Blocks grouped as [lo, hi): one group per block up to 3 blocks, else thirds (first gets fewer)."""
    k = min(n, 3)
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def layer_group(name: str, n_layers: int) -> str:
    """The layer group of a parameter name of an HF Qwen3/Llama-style model.

    `model.embed_tokens.weight` -> "embeddings"; `model.layers.3.mlp.up_proj.weight` -> "block 3"
    (n_layers <= 3) or "blocks 0-3" (its third); `lm_head.weight` and the final `model.norm.weight`
    -> "head"; anything else (e.g. rotary buffers) -> "other".
    """
    m = _LAYER.search(name)
    if m:
        i = int(m.group(1))
        for lo, hi in block_ranges(max(n_layers, i + 1)):
            if lo <= i < hi:
                return f"block {lo}" if hi - lo == 1 else f"blocks {lo}-{hi - 1}"
    if any(e in name for e in _EMBED):
        return "embeddings"
    if "lm_head" in name or re.search(r"(?:^|\.)(?:norm|ln_f|final_layernorm)\.", name):
        return "head"
    return "other"


def group_order(n_layers: int) -> list[str]:
    """Group names in model order (embeddings, blocks, head, other)."""
    blocks = [f"block {lo}" if hi - lo == 1 else f"blocks {lo}-{hi - 1}" for lo, hi in block_ranges(n_layers)]
    return ["embeddings", *blocks, "head", "other"]


def pair_stats(base_sd: dict, expert_sds: dict[str, dict]) -> tuple[list[str], dict[str, dict[str, torch.Tensor]]]:
    """Per layer group, sums over its coordinates that give every pairwise metric (E experts):
    dot (E, E) = Σ τ_i τ_j; both (E, E) = #(τ_i ≠ 0 and τ_j ≠ 0); agree (E, E) = Σ sign τ_i · sign τ_j,
    so the sign conflicts are (both − agree) / 2. Floating-point tensors in the base only."""
    names = list(expert_sds)
    n = n_layers(base_sd)
    stats: dict[str, dict[str, torch.Tensor]] = {}
    for key, b in base_sd.items():
        if not b.is_floating_point():
            continue
        g = stats.setdefault(layer_group(key, n), {k: torch.zeros(len(names), len(names), dtype=torch.float64)
                                                   for k in ("dot", "both", "agree")})
        flat_b = b.detach().reshape(-1)
        # each expert's tensor read once (a lazy state dict reads it from disk on every access)
        flat = [sd[key].detach().reshape(-1) for sd in expert_sds.values()]
        for lo in range(0, flat_b.numel(), _CHUNK):
            tau = torch.stack([f[lo:lo + _CHUNK].double() - flat_b[lo:lo + _CHUNK].double()
                               for f in flat])  # (E, chunk)
            s = tau.sign()
            nz = (s != 0).double()
            g["dot"] += tau @ tau.T
            g["both"] += nz @ nz.T
            g["agree"] += s @ s.T
    return names, stats


def metrics_from_stats(st: dict[str, torch.Tensor]) -> dict[str, list[list[float | None]]]:
    """The three (E, E) metric matrices of one group's sums (None where undefined; see module doc)."""
    dot, both, agree = (st[k].tolist() for k in ("dot", "both", "agree"))
    norm = [math.sqrt(max(dot[i][i], 0.0)) for i in range(len(dot))]
    idx = range(len(dot))
    return {
        "cosine": [[dot[i][j] / (norm[i] * norm[j]) if norm[i] and norm[j] else None for j in idx] for i in idx],
        "sign_conflict": [[(both[i][j] - agree[i][j]) / 2 / both[i][j] if both[i][j] else None for j in idx]
                          for i in idx],
        "norm_ratio": [[norm[i] / norm[j] if norm[j] else None for j in idx] for i in idx],
    }


def weightspace_interference(base_sd: dict, expert_sds: dict[str, dict]) -> dict:
    """{"experts": [names], "groups": [names in model order], "norms": {group: [||τ_e||]},
    <metric>: {group: (E, E) nested list}} for the metrics in METRICS; JSON-ready (None for undefined)."""
    names, stats = pair_stats(base_sd, expert_sds)
    groups = [g for g in group_order(n_layers(base_sd)) if g in stats]
    out: dict = {"experts": names, "groups": groups,
                 "norms": {g: [math.sqrt(stats[g]["dot"][i, i].item()) for i in range(len(names))] for g in groups}}
    per_group = {g: metrics_from_stats(stats[g]) for g in groups}
    for m in METRICS:
        out[m] = {g: per_group[g][m] for g in groups}
    return out
