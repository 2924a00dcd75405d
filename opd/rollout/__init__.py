"""Rollout engines: sample completions with per-token log-probs, score given completions.

`get_engine("embedded", model=..., tokenizer=...)` runs transformers in process (the CPU default);
`get_engine("sglang", base_url=..., tokenizer=...)` talks to an SGLang server over HTTP.
"""

from opd.rollout.base import ENGINES, Rollout, RolloutEngine, SamplingParams, get_engine

__all__ = ["ENGINES", "Rollout", "RolloutEngine", "SamplingParams", "get_engine"]
