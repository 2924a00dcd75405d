"""Rows of (prompt, completion) laid out for one forward that reads the hidden state predicting each
completion token: `padded` (one right-padded row each, today's layout) or `packed` (no padding, and a
group's prompt once).

`packed` puts a prompt and its group's completions into one *document*: the prompt's tokens, then
each completion but its last token (which predicts nothing). A custom attention mask (handed to the
model as a 4-D mask, which transformers uses as given: `masking_utils._preprocess_mask_arguments`)
lets a prompt token see the prompt before it and a completion token see the whole prompt and its own
earlier tokens, never another completion; position ids restart per document and continue the prompt
in every completion. Documents are packed first-fit into rows of one width, so a batch of short rows
of mixed lengths costs its real tokens, not rows x the longest. The hidden states are those of one
right-padded forward per row (same values up to float rounding, and the same gradients), at the cost
of sum(prompt) + sum(completion - 1) positions instead of rows x max(prompt + completion).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["padded", "packed"]


@dataclass(frozen=True)
class TokenRows:
    """ids, pos: (R, S); mask: (R, S) key padding mask (padded) or (R, 1, S, S) additive (packed);
    index: (N,) flat position in R*S of the hidden state that predicts each completion token, rows in
    the order given and tokens in order (the order of `cmask.bool()` selections)."""

    ids: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor | None
    index: torch.Tensor

    def to(self, device) -> TokenRows:
        return TokenRows(*(None if x is None else x.to(device) for x in (self.ids, self.mask, self.pos, self.index)))


def lay_out(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int, layout: Layout,
            dtype: torch.dtype = torch.float32) -> TokenRows:
    """Rows (prompt_ids[b], completion_ids[b]) in the given layout (an empty completion adds no token)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"lay_out: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(not p for p in prompt_ids):
        raise ValueError("lay_out: every row needs a prompt token to condition on")
    return (padded if layout == "padded" else packed)(prompt_ids, completion_ids, pad_id, dtype)


def padded(prompt_ids, completion_ids, pad_id: int, dtype: torch.dtype = torch.float32) -> TokenRows:
    """One right-padded row per (prompt, completion), positions 0..len-1 (the model's default)."""
    L = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    ids = torch.full((len(prompt_ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), L), dtype=torch.long)
    index = []
    for b, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[b, : len(p) + len(c)] = torch.tensor(list(p) + list(c))
        mask[b, : len(p) + len(c)] = 1
        index.extend(b * L + len(p) - 1 + t for t in range(len(c)))  # token t is predicted at plen-1+t
    return TokenRows(ids, mask, None, torch.tensor(index, dtype=torch.long))


def packed(prompt_ids, completion_ids, pad_id: int, dtype: torch.dtype = torch.float32,
           min_width: int = 64) -> TokenRows:
    """Documents (consecutive rows with an equal prompt share one) packed first-fit into rows of one
    width (`row_width`: one row of their own length when they fit min_width together)."""
    docs: list[list[int]] = []  # row indices of each document
    for b, p in enumerate(prompt_ids):
        if docs and list(prompt_ids[docs[-1][0]]) == list(p):
            docs[-1].append(b)
        else:
            docs.append([b])
    size = [len(prompt_ids[d[0]]) + sum(max(len(completion_ids[b]) - 1, 0) for b in d) for d in docs]
    S = row_width(size, min_width)
    place, fill = first_fit(size, S)
    R = len(fill)
    # filled as Python lists, one tensor each at the end: slicing tensors per document costs more than the
    # documents' tokens (a step lays out a few hundred documents, each of ~10 tokens)
    ids = [pad_id] * (R * S)
    pos = [0] * (R * S)
    doc = list(range(-1, -1 - R * S, -1))  # padding: a document of its own (it sees only itself)
    seg = [0] * (R * S)  # 0: prompt; g + 1: the group's g-th completion
    first = [0] * len(prompt_ids)  # flat position that predicts each row's first completion token
    start = [0] * len(prompt_ids)  # flat position of each row's completion tokens (all but the last)
    for i, d in enumerate(docs):
        p, at = [int(t) for t in prompt_ids[d[0]]], place[i]
        ids[at : at + len(p)] = p
        pos[at : at + len(p)] = range(len(p))
        doc[at : at + len(p)] = [i] * len(p)
        at += len(p)
        end = at - 1  # the prompt's last token predicts every completion's first token
        for g, b in enumerate(d):
            c = [int(t) for t in completion_ids[b]][:-1]
            first[b], start[b] = end, at
            ids[at : at + len(c)] = c
            pos[at : at + len(c)] = range(len(p), len(p) + len(c))
            doc[at : at + len(c)], seg[at : at + len(c)] = [i] * len(c), [g + 1] * len(c)
            at += len(c)
    index = []
    for b, c in enumerate(completion_ids):
        # token 0 from the prompt's last position, token t >= 1 from the completion's token t-1
        index.extend(([first[b]] if c else []) + [start[b] + t for t in range(len(c) - 1)])
    ids, pos, doc, seg = (torch.tensor(x, dtype=torch.long).view(R, S) for x in (ids, pos, doc, seg))
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool))
    same_doc = doc[:, :, None] == doc[:, None, :]  # (R, S, S): query x key
    visible = (seg[:, None, :] == 0) | (seg[:, :, None] == seg[:, None, :])  # the prompt, or its own completion
    allowed = causal & same_doc & visible
    mask = torch.zeros((R, 1, S, S), dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return TokenRows(ids, mask, pos, torch.tensor(index, dtype=torch.long))


def first_fit(size: list[int], S: int) -> tuple[list[int], list[int]]:
    """Documents of `size` tokens packed first-fit decreasing into rows of width S: each document's flat
    start (row * S + column) and each row's used width."""
    fill: list[int] = []
    place = [0] * len(size)
    for i in sorted(range(len(size)), key=lambda i: -size[i]):
        r = next((r for r, f in enumerate(fill) if f + size[i] <= S), None)
        if r is None:
            r = len(fill)
            fill.append(0)
        place[i] = r * S + fill[r]
        fill[r] += size[i]
    return place, fill


def row_width(size: list[int], min_width: int = 64) -> int:
    """The packed rows' width for documents of `size` tokens. All of them within `min_width`: one row of
    their own length. Otherwise the width in [the longest document, min_width] whose first-fit packing
    has the fewest positions (rows x width; the smaller width on a tie), since every position, padding
    too, costs the same in the linear layers and a narrower row less in attention. A fixed width of
    min_width left ~13% of the positions as padding on the lab's OPD minibatches (documents of ~23
    tokens: two fill 46 of 64)."""
    total, longest = sum(size), max(size)
    if total <= min_width or longest >= min_width:
        return max(longest, min(min_width, total))
    # min_width first (never more positions than it), then by the lower bound on positions,
    # ceil(total / S) * S: the search stops once no width can do better, once one is within 1% of the
    # tokens, or once first-fit (O(documents x rows) a width) has cost ~50k steps: a minibatch of a few
    # dozen documents tries every width, a layout of hundreds one or two
    rows = len(first_fit(size, min_width)[1])
    best, work = (rows * min_width, min_width), len(size) * rows  # (positions, width)
    for S in sorted(range(longest, min_width), key=lambda S: (-(-total // S) * S, S)):
        if -(-total // S) * S >= best[0] or best[0] * 100 <= total * 101 or work > 50_000:
            break
        rows = len(first_fit(size, S)[1])
        best, work = min(best, (rows * S, S)), work + len(size) * rows
    return best[1]


def padded_rows(ids: torch.Tensor, attn: torch.Tensor, plen: torch.Tensor, cmask: torch.Tensor) -> TokenRows:
    """Right-padded (B, L) rows as `TokenRows`: completion token t of row b is predicted at b*L + plen_b-1+t."""
    B, L = ids.shape
    at = torch.arange(B, device=ids.device)[:, None] * L + plen[:, None] - 1 + torch.arange(cmask.shape[1],
                                                                                          device=ids.device)
    return TokenRows(ids, attn, None, at[cmask.bool()])


def hidden_at(model, rows: TokenRows, last_mlp_at_index: bool = False) -> torch.Tensor:
    """Final (post-norm) hidden states that predict each completion token: (N, H). Reading hidden
    states instead of logits lets the chunked kernels apply the LM head piecewise.

    last_mlp_at_index: the last decoder layer's MLP runs only at the positions `rows.index` reads
    (`last_mlp_at`); the states read are the same up to float rounding, the others are not computed."""
    mask = rows.mask
    if mask.is_floating_point():  # an additive mask in the model's compute dtype (bf16 under DeepSpeed)
        mask = mask.to(model.get_input_embeddings().weight.dtype)
    decoder = model.get_decoder()
    with last_mlp_at(decoder, rows.index if last_mlp_at_index else None):
        h = decoder(input_ids=rows.ids, attention_mask=mask, position_ids=rows.pos).last_hidden_state
    return h.reshape(-1, h.shape[-1]).index_select(0, rows.index)  # backward: index_add, not index_put


@contextmanager
def last_mlp_at(decoder, index: torch.Tensor | None):
    """While open, the decoder's last layer runs its MLP only at the flat positions `index` (into the
    (R, S) rows; None: everywhere) and adds 0 elsewhere. Only the final states at `index` are read,
    and after the last layer's attention no position reads another, so the other positions' last MLP
    (most of a layer's products: 3 x H x I of its ~4 H^2 + 3 H I multiply-adds per position) is work
    for nothing: on the lab's OPD minibatches a quarter of the positions are prompt tokens that predict
    nothing. The MLP is per position, so the states at `index` are unchanged up to float rounding,
    and so are the gradients. A no-op for a decoder without `layers[-1].mlp` (transformers' name in
    the Llama/Qwen families: `modeling_qwen3.Qwen3DecoderLayer.forward` calls `self.mlp` on
    (R, S, H) states and adds its output to them), or under activation checkpointing."""
    layers = getattr(decoder, "layers", None)
    mlp = getattr(layers[-1], "mlp", None) if layers is not None and len(layers) else None
    # activation checkpointing reruns the layer in backward, after the hooks are gone
    if index is None or mlp is None or getattr(decoder, "gradient_checkpointing", False):
        yield
        return
    at = torch.unique(index)  # a prompt's last position predicts each of its group's first tokens
    shape = []

    def before(_module, args, kwargs):
        x = args[0]  # (R, S, H)
        shape.append(x.shape)
        return (x.reshape(-1, x.shape[-1]).index_select(0, at)[None], *args[1:]), kwargs

    def after(_module, _args, _kwargs, out):
        R, S, _ = shape.pop()
        full = out.new_zeros(R * S, out.shape[-1]).index_copy(0, at, out[0])
        return full.view(R, S, out.shape[-1])

    handles = (mlp.register_forward_pre_hook(before, with_kwargs=True),
               mlp.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
