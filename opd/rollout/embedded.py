"""In-process rollouts with transformers `generate` (KV cache, batched, left padding): the CPU default."""

from __future__ import annotations

import torch

from opd.rollout.base import Rollout, SamplingParams, cut_at_stop, stop_token_ids


class EmbeddedEngine:
    """Samples from `model` itself, so `sync_weights` on the same object is free.

    model: a transformers causal LM; tokenizer: its tokenizer (prompts are encoded without special
    tokens, as the lab trains them). batch_size: sequences per `generate` call (prompts x n).
    """

    def __init__(self, model, tokenizer, batch_size: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[-1]

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, params: SamplingParams) -> list[list[Rollout]]:
        """`n` samples per prompt; result[i][j] is sample j of prompts[i]. See `Rollout` for logprobs."""
        encoded = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        flat = [(i, ids) for i, ids in enumerate(encoded) for _ in range(n)]  # prompt-major order
        out: list[list[Rollout]] = [[] for _ in prompts]
        # fork_rng keeps the caller's global RNG untouched while making a seeded call repeatable.
        with torch.random.fork_rng(devices=[]):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(flat), self.batch_size):
                chunk = flat[start : start + self.batch_size]
                for (i, p_ids), (c_ids, lps) in zip(chunk, self._generate_batch([c[1] for c in chunk], params), strict=True):
                    text = self.tokenizer.decode(c_ids)
                    out[i].append(Rollout(prompts[i], list(p_ids), c_ids, text, lps))
        return out

    def _generate_batch(self, prompt_ids: list[list[int]], params: SamplingParams):
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        L = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompt_ids), L), dtype=torch.long)
        for r, p in enumerate(prompt_ids):  # left padding: every prompt ends at column L-1
            input_ids[r, L - len(p) :] = torch.tensor(p)
            attn[r, L - len(p) :] = 1
        greedy = params.temperature == 0.0
        sample_kwargs = {} if greedy else {
            # top_k is always passed: 0 disables it, whereas None would fall back to the model's
            # generation_config default (50 in many checkpoints) and silently truncate sampling.
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        }
        gen = self.model.generate(
            input_ids=input_ids.to(device), attention_mask=attn.to(device),
            do_sample=not greedy, max_new_tokens=params.max_new_tokens,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
            output_logits=True, return_dict_in_generate=True, **sample_kwargs,
        )
        new = gen.sequences[:, L:]  # (B, T_new)
        # `logits` are the raw model outputs before temperature/top-p/top-k: log_softmax of them is
        # the temperature-1 policy that training recomputes, so the ratio starts at exactly 1.
        logits = torch.stack(gen.logits, dim=1).float()  # (B, T_new, V)
        lps = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None])[..., 0]  # (B, T_new)
        self.model.train(was_training)
        results = []
        for r in range(new.shape[0]):
            ids = cut_at_stop(new[r].tolist(), set(self.stop_ids))
            results.append((ids, lps[r, : len(ids)].tolist()))
        return results

    @torch.no_grad()
    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of each completion token given its prompt and the earlier tokens."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
        was_training = self.model.training
        self.model.eval()
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
        self.model.train(was_training)
        return out

    def sync_weights(self, model) -> None:
        """Copy `model`'s weights in (nothing to do when it is the engine's own model)."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())
