"""In-process rollouts with transformers `generate` (KV cache, batched, left padding, one prefill per
prompt shared by its samples): the CPU default."""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache

from opd.rl.packing import Layout, last_mlp_at, lay_out
from opd.rollout.base import Rollout, SamplingParams, cut_at_stop, stop_token_ids


def _in_eval_mode(method):
    """Run `method` with the engine's model in eval mode, handed back as it was. A model already in eval
    mode (the OPD loop's sampler copy) is not switched: train() walks every module, and transformers
    re-checks its hub kernels there, on every call."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        training = self.model.training
        if training:
            self.model.eval()
        try:
            return method(self, *args, **kwargs)
        finally:
            if training:
                self.model.train()

    return wrapper


class EmbeddedEngine:
    """Samples from `model` itself, so `sync_weights` on the same object is free.

    model: a transformers causal LM; tokenizer: its tokenizer (prompts are encoded without special
    tokens, as the lab trains them). batch_size: sequences per `generate` call (prompts x n); a
    prompt's n samples always share one call, which prefills the prompt once for all of them.
    compact_every: tokens per `generate` call, after which the rows that have stopped leave the batch
    (None: one call to the end). prefill: "padded" (left-padded prompts) or "packed" (no padding).
    Both options sample the same distribution as the defaults, with the same greedy answers; on a
    CPU, where every row costs its compute, they skip the work of padding and of finished rows.
    """

    def __init__(self, model, tokenizer, batch_size: int = 256, compact_every: int | None = None,
                 prefill: Layout = "padded"):
        self.model = model
        self.compact_every = compact_every
        self.prefill = prefill
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[-1]

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, params: SamplingParams) -> list[list[Rollout]]:
        """`n` samples per prompt; result[i][j] is sample j of prompts[i]. See `Rollout` for logprobs."""
        if not prompts:
            return []
        encoded = self.tokenizer(prompts, add_special_tokens=False).input_ids
        per_call = max(1, self.batch_size // n)  # whole groups per `generate` call
        out: list[list[Rollout]] = []
        # fork_rng keeps the caller's global RNG untouched while making a seeded call repeatable.
        with torch.random.fork_rng(devices=[]):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(prompts), per_call):
                chunk = encoded[start : start + per_call]
                samples = self._generate_groups(chunk, n, params)  # prompt-major: n rows per prompt
                texts = self.tokenizer.batch_decode([ids for ids, _ in samples], skip_special_tokens=True)
                for k, p_ids in enumerate(chunk):
                    rows = range(k * n, (k + 1) * n)
                    out.append([Rollout(prompts[start + k], list(p_ids), samples[r][0], texts[r], samples[r][1])
                                for r in rows])
        return out

    @_in_eval_mode
    def _generate_groups(self, prompt_ids: list[list[int]], n: int, params: SamplingParams):
        """`n` samples of each prompt: [(completion_ids, logprobs)] prompt-major.

        Each prompt is prefilled once, not `n` times: a forward over all but its last token (left-padded
        rows, or with `prefill="packed"` the prompts packed without padding) fills a KV cache that is
        repeated for its `n` rows, and `generate` continues from that cache. With `compact_every`,
        `generate` runs that many tokens at a time and only the rows without a stop token go on, their
        cache rows selected: a batch of short and long answers then stops computing the short ones once
        they have ended, instead of carrying them as padding to the longest.
        """
        device = next(self.model.parameters()).device
        L = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompt_ids), L), dtype=torch.long)
        for r, p in enumerate(prompt_ids):  # left padding: every prompt ends at column L-1
            input_ids[r, L - len(p) :] = torch.tensor(p)
            attn[r, L - len(p) :] = 1
        input_ids, attn = input_ids.to(device), attn.to(device)
        cache = None
        if L > 1 and self.prefill == "packed":
            cache = self._packed_prefill(prompt_ids, L, device)
        elif L > 1:
            pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)  # (U, L): as `generate` derives them
            cache = self.model(input_ids=input_ids[:, :-1], attention_mask=attn[:, :-1], position_ids=pos[:, :-1],
                               use_cache=True).cache
        if cache is not None:
            cache.batch_repeat_interleave(n)  # (U, ...) -> (U*n, ...)
        greedy = params.temperature == 0.0
        sample_kwargs = {} if greedy else {
            # top_k is always passed: 0 disables it, whereas None would fall back to the model's
            # generation_config default (50 in many checkpoints) and silently truncate sampling.
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        }
        ids, mask = input_ids.repeat_interleave(n, dim=0), attn.repeat_interleave(n, dim=0)
        rows = torch.arange(len(ids), device=device)  # the rows still sampling, as rows of the result
        new_ids: list[list[int]] = [[] for _ in range(len(ids))]
        new_lps: list[list[float]] = [[] for _ in range(len(ids))]
        stop = torch.tensor(self.stop_ids, device=device)
        left = params.max_new_tokens
        while True:
            gen = self.model.generate(
                input_ids=ids, attention_mask=mask, cache=cache, do_sample=not greedy,
                max_new_tokens=min(self.compact_every or left, left), eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id, output_logits=True, return_dict_in_generate=True, **sample_kwargs,
            )
            new = gen.sequences[:, ids.shape[1]:]  # (a, t)
            # `logits` are the raw model outputs before temperature/top-p/top-k: log_softmax of them is
            # the temperature-1 policy that training recomputes, so the ratio starts at exactly 1.
            logits = torch.stack(gen.logits, dim=1).float()  # (a, t, V)
            lps = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None])[..., 0]  # (a, t)
            for r, t_ids, t_lp in zip(rows.tolist(), new.tolist(), lps.tolist(), strict=True):
                new_ids[r] += t_ids
                new_lps[r] += t_lp
            left -= new.shape[1]
            going = ~torch.isin(new, stop).any(1)  # (a,): no stop token yet
            if left <= 0 or not going.any():
                break
            # compaction: only the rows still sampling go on, from the cache (every token but the last)
            keep = going.nonzero().squeeze(1)
            cache = gen.cache
            cache.batch_select_indices(keep)
            ids, rows = gen.sequences[keep], rows[keep]
            mask = torch.cat([mask[keep], torch.ones_like(new[keep])], dim=1)
        stop_ids = set(self.stop_ids)
        results = []
        for ids_, lp in zip(new_ids, new_lps, strict=True):
            ids_ = cut_at_stop(ids_, stop_ids)
            results.append((ids_, lp[: len(ids_)]))
        return results

    def _packed_prefill(self, prompt_ids: list[list[int]], L: int, device) -> DynamicCache:
        """The KV cache of every prompt but its last token, left-padded to L-1 columns as the padded
        prefill leaves it, from one forward over the prompts packed without padding (opd.rl.packing).

        Each prompt is laid out as a one-token "prompt" and the rest as its "completion": the packed
        layout then places its tokens at positions 0..len-2 (the last token, which `generate` feeds
        itself, is left out) under a causal mask within the prompt alone, and its index names the flat
        position of each. The keys and values there are the padded forward's, up to float rounding;
        the padding columns hold any key, as the attention mask hides them."""
        dtype = next(self.model.parameters()).dtype
        laid = lay_out([p[:1] for p in prompt_ids], [p[1:] for p in prompt_ids], self.pad_id, "packed", dtype)
        take = torch.zeros(len(prompt_ids), L - 1, dtype=torch.long)  # (U, L-1) flat position of each column
        at = 0
        for r, p in enumerate(prompt_ids):  # prompt r's len-1 cached tokens end at column L-2
            take[r, L - len(p):] = laid.index[at : at + len(p) - 1]
            at += len(p) - 1
        laid, take = laid.to(device), take.to(device)
        decoder = self.model.get_decoder()
        with last_mlp_at(decoder, laid.index[:0]):  # only the cache is read: the last MLP's output is not
            out = decoder(input_ids=laid.ids, attention_mask=laid.mask, position_ids=laid.pos, use_cache=True)
        R, S = laid.ids.shape

        def left_padded(x):  # (R, H, S, D) -> (U, H, L-1, D)
            flat = x.transpose(1, 2).reshape(R * S, *x.shape[1:2], x.shape[-1])  # (R*S, H, D)
            return flat[take].transpose(1, 2).contiguous()

        return DynamicCache([(left_padded(layer.keys), left_padded(layer.values)) for layer in out.cache.layers],
                            config=self.model.config)

    @torch.no_grad()
    @_in_eval_mode
    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of each completion token given its prompt and the earlier tokens."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
        device = next(self.model.parameters()).device
        out: list[list[float]] = []
        for start in range(0, len(prompt_ids), self.batch_size):
            ps, cs = prompt_ids[start : start + self.batch_size], completion_ids[start : start + self.batch_size]
            if any(len(p) == 0 for p in ps):
                raise ValueError("score: every prompt needs at least one token to condition on")
            seqs = [list(p) + list(c) for p, c in zip(ps, cs, strict=True)]
            T = max(len(s) for s in seqs)
            # Right padding keeps positions 0..len-1 for every row, exactly as in training.
            ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long)
            attn = torch.zeros((len(seqs), T), dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s)
                attn[r, : len(s)] = 1
            logits = self.model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, V): predicts token t+1
            tok_lp = logp.gather(-1, ids[:, 1:, None].to(device))[..., 0]  # (B, T-1)
            for r, (p, c) in enumerate(zip(ps, cs, strict=True)):
                out.append(tok_lp[r, len(p) - 1 : len(p) - 1 + len(c)].tolist())
        return out

    def sync_weights(self, model) -> None:
        """Copy `model`'s weights in (nothing to do when it is the engine's own model)."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())
