"""All in-process teachers as one stacked model: a single vectorised forward scores every row under
its routed teachers, instead of one forward per teacher for the sampled log-probs and another for
the full estimator's hidden states.

The teachers share one architecture (they are experts of one base), so their decoder weights stack
into (K, ...) tensors and `torch.func.vmap` over `functional_call` runs all K at once. Rows are
grouped by teacher and padded to the largest group, R rows each: the forward is (K, R, L).
The result is each row's *mixed* full-vocabulary target, log-softmax(sum_k w_kb log pi_k), which
gives sum_k w_k KL(pi_s || pi_k) up to a per-token constant (logged back, never differentiated).
"""

from __future__ import annotations

import copy

import torch
from torch.func import functional_call, stack_module_state, vmap

from opd.distill.teachers import Teacher, lm_head_weight
from opd.errors import OpdError
from opd.rl.packing import last_mlp_at, lay_out

# Beyond this many bytes of (K, R, T, V) teacher log-probs the loop falls back to per-teacher
# hidden states and the chunked kernel (a real vocabulary of 150k makes the dense targets too big).
DENSE_BUDGET = 512 * 2**20


# Tokens per forward of the packed scoring: a batch's rows go through a teacher in chunks of about this
# many, not all at once, so each layer's activations stay in cache. On the lab's 2-core EPYC (1 thread) one
# MLP over 7,040 positions ran at 47 GFLOPS and over 640 at 56 (the elementwise ops between the products
# are memory-bound once a layer's activations outgrow the cache).
CHUNK_TOKENS = 640


def chunk_rows(rows: list[int], prompts: list[list[int]], completions: list[list[int]], tokens: int
               ) -> list[list[int]]:
    """`rows` in consecutive chunks of about `tokens` prompt and completion tokens, cut only between rows
    with different prompts (a group's prompt is laid out once, in one chunk)."""
    out: list[list[int]] = []
    used = 0
    for i, b in enumerate(rows):
        new_prompt = i == 0 or prompts[b] != prompts[rows[i - 1]]
        if new_prompt and (not out or used >= tokens):
            out.append([])
            used = 0
        out[-1].append(b)
        used += len(completions[b]) + (len(prompts[b]) if new_prompt else 0)
    return out


def check_same_architecture(teachers: dict[str, Teacher], student=None) -> None:
    """Refuse teachers (and a student) that do not share one architecture and vocabulary: one line
    naming the first teacher that differs and how."""
    models = {n: t.model for n, t in teachers.items() if t.model is not None}
    if student is not None:
        models = {"<student>": student, **models}
    if len(models) < 2:
        return
    ref_name, ref = next(iter(models.items()))
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    for name, m in models.items():
        if m.config.model_type != ref.config.model_type:
            raise OpdError(f"teacher {name!r}: architecture {m.config.model_type} differs from {ref_name}'s "
                           f"{ref.config.model_type}; OPD teachers must share the student's architecture")
        shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
        if shapes != ref_shapes:
            diff = sorted(set(shapes.items()) ^ set(ref_shapes.items()))[0]
            what = "vocabulary" if "embed" in diff[0] or "lm_head" in diff[0] else "shape"
            raise OpdError(f"teacher {name!r}: its {what} differs from {ref_name}'s ({diff[0]} "
                           f"{shapes.get(diff[0])} vs {ref_shapes.get(diff[0])}); OPD teachers must share the "
                           "student's architecture and vocabulary")


def _module_on(template: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of the meta-device `template` whose parameters and buffers are `tensors` (by name), not copies."""
    one = copy.deepcopy(template)
    for name, t in tensors.items():
        owner, _, attr = name.rpartition(".")
        mod = one.get_submodule(owner)
        if attr in mod._parameters:
            mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[attr] = t
    return one.eval()


class TeacherBank:
    """The teachers `names` (all in process, one architecture) as stacked weights, in `dtype` (default: the
    teachers' own; buffers such as RoPE's frequencies keep theirs). The heads' log-softmax and the mixed
    targets are computed in fp32 whatever the dtype."""

    def __init__(self, teachers: dict[str, Teacher], names: list[str], dtype: torch.dtype | None = None):
        models = [teachers[n].model for n in names]
        if any(m is None for m in models):
            raise ValueError("TeacherBank needs every teacher in process")
        check_same_architecture({n: teachers[n] for n in names})
        decoders = [m.get_decoder() for m in models]
        params, buffers = stack_module_state(decoders)  # name -> (K, ...)
        self.params = {k: v.detach().to(dtype) for k, v in params.items()}
        self.buffers = buffers
        self.heads = torch.stack([lm_head_weight(m).detach() for m in models]).to(dtype)  # (K, V, H)
        template = copy.deepcopy(decoders[0]).to("meta")  # the decoder's own attention implementation
        skeleton = copy.deepcopy(decoders[0]).to("meta")
        # sdpa has no vmap batching rule on CPU (a slow per-sample fallback); eager attention is plain
        # matmuls and a softmax, which vmap batches.
        skeleton.config._attn_implementation = "eager"
        self.skeleton = skeleton
        # One teacher at a time (the packed path): a decoder per teacher whose parameters are views of the
        # stacked ones (no copy), called as a module: functional_call would swap ~100 tensors in and out
        # of one skeleton per call.
        self.plain = [_module_on(template, {**{n: v[k] for n, v in self.params.items()},
                                            **{n: v[k] for n, v in buffers.items()}}) for k in range(len(models))]
        self.names = list(names)

    def fits(self, rows_per_teacher: int, T: int) -> bool:
        K, V, _ = self.heads.shape
        return K * rows_per_teacher * T * V * 4 <= DENSE_BUDGET

    def fits_tokens(self, pair_tokens: int) -> bool:
        """Whether the packed path's (teacher, token) full-vocabulary log-probs fit DENSE_BUDGET."""
        return pair_tokens * self.heads.shape[1] * 4 <= DENSE_BUDGET

    def _hidden(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """(K, R, L) right-padded rows, row r of slice k for teacher k -> final hidden states (K, R, L, H)."""
        L = ids.shape[-1]
        causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=ids.device))
        allowed = causal & attn.bool()[..., None, None, :]  # (K, R, 1, L, L)
        mask = torch.zeros(allowed.shape, dtype=self.heads.dtype, device=ids.device)
        mask.masked_fill_(~allowed, torch.finfo(mask.dtype).min)  # additive, as eager attention adds it
        pos = torch.arange(L, device=ids.device).expand(ids.shape)  # right padding: positions 0..len-1
        return self._forward(ids, mask, pos)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids, pos (K, R, S) and additive masks (K, R, 1, S, S), slice k for teacher k -> (K, R, S, H)."""

        def one(p, b, i, m, ps):
            return functional_call(self.skeleton, (p, b), (), {"input_ids": i, "attention_mask": m,
                                                               "position_ids": ps}).last_hidden_state

        return vmap(one)(self.params, self.buffers, ids, mask, pos)

    @torch.no_grad()
    def score_packed(self, prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                     targets: torch.Tensor, cmask: torch.Tensor, weights: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`score` on the packed layout (opd.rl.packing): each teacher's routed rows packed into its own
        rows, a group's prompt once, those padded to one (R, S) for the stacked forward.

        prompts, completions: each row's token ids; targets, cmask: (B, T); weights: (K, B).
        Returns target (N, V) and log_z (N,) over the real tokens (row-major, as `cmask.bool()`
        selects them), and teacher_lp (K, B, T) (0 where unrouted and on padding).
        """
        K, B = weights.shape
        real = cmask.bool()
        tok_index = torch.full(real.shape, -1, dtype=torch.long, device=real.device)
        tok_index[real] = torch.arange(int(real.sum()), device=real.device)
        served = {k: weights[k].nonzero().squeeze(1) for k in range(K)}
        served = {k: rows for k, rows in served.items() if len(rows)}  # each teacher's rows
        hidden = {}
        for k, rows in served.items():  # forwards per teacher on its own packed rows (no cross-teacher padding)
            parts = []
            for part in chunk_rows(rows.tolist(), prompts, completions, CHUNK_TOKENS):
                t = lay_out([prompts[b] for b in part], [completions[b] for b in part], pad_id, "packed",
                            self.heads.dtype).to(weights.device)
                with last_mlp_at(self.plain[k], t.index):  # only the states at t.index are read
                    h = self.plain[k](input_ids=t.ids, attention_mask=t.mask, position_ids=t.pos,
                                      use_cache=False).last_hidden_state
                parts.append(h.reshape(-1, h.shape[-1]).index_select(0, t.index))  # (n, H)
            hidden[k] = torch.cat(parts)  # (n_k, H): rows in order, tokens in order
        mixed = torch.zeros(int(real.sum()), self.heads.shape[1], device=weights.device)
        teacher_lp = torch.zeros(K, B, cmask.shape[1], device=weights.device)
        for k, rows in served.items():
            hk = hidden[k]
            lp = torch.log_softmax(hk.float() @ self.heads[k].float().T, -1)  # (n_k, V)
            sel = real[rows]  # (b, T)
            row_of_tok = rows[:, None].expand(-1, sel.shape[1])[sel]  # (n_k,)
            mixed.index_add_(0, tok_index[rows][sel], weights[k, row_of_tok][:, None] * lp)
            tl = torch.zeros(sel.shape, device=weights.device)
            tl[sel] = lp.gather(-1, targets[rows][sel][:, None])[:, 0]
            teacher_lp[k, rows] = tl
        log_z = torch.logsumexp(mixed, -1)  # (N,): 0 for a token with one teacher
        return mixed - log_z[:, None], log_z, teacher_lp

    @torch.no_grad()
    def score(self, ids: torch.Tensor, attn: torch.Tensor, plen: torch.Tensor, targets: torch.Tensor,
              weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every routed (teacher, row) pair in one forward.

        ids, attn: (B, L) right-padded prompt+completion; plen: (B,); targets: (B, T) sampled tokens;
        weights: (K, B) teacher k's share of row b (columns sum to 1, 0 where unrouted).
        Returns target (B, T, V) log-probs of the normalised geometric mixture, log_z (B, T) its
        normaliser (sum_k w_k KL_k = KL(s || target) - log_z), and teacher_lp (K, B, T) each
        teacher's log-prob of the sampled token (0 where unrouted).
        """
        K, B = weights.shape
        T = targets.shape[1]
        pair_k, pair_b = weights.nonzero(as_tuple=True)  # (P,) each
        counts = torch.bincount(pair_k, minlength=K)
        R = int(counts.max())
        # slot of each pair within its teacher's group: rank among the pairs of the same teacher
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(pair_k), device=weights.device) - starts[pair_k]
        rows = torch.zeros(K, R, dtype=torch.long, device=ids.device)  # padding slots re-run row 0
        rows[pair_k, slot] = pair_b
        h = self._hidden(ids[rows], attn[rows])  # (K, R, L, H)
        pos = (plen[rows][..., None] - 1 + torch.arange(T, device=ids.device)).clamp(max=ids.shape[1] - 1)  # (K, R, T)
        hc = h.gather(2, pos[..., None].expand(-1, -1, -1, h.shape[-1]))  # (K, R, T, H)
        lp = torch.log_softmax(torch.einsum("krth,kvh->krtv", hc.float(), self.heads.float()), -1)  # (K, R, T, V)
        lp_pairs = lp[pair_k, slot]  # (P, T, V)
        mixed = torch.zeros(B, T, lp.shape[-1], device=lp.device)
        mixed.index_add_(0, pair_b, weights[pair_k, pair_b][:, None, None] * lp_pairs)
        log_z = torch.logsumexp(mixed, -1)  # (B, T): 0 for a row with one teacher
        teacher_lp = torch.zeros(K, B, T, device=lp.device)
        teacher_lp[pair_k, pair_b] = lp_pairs.gather(-1, targets[pair_b][..., None])[..., 0]
        return mixed - log_z[..., None], log_z, teacher_lp
