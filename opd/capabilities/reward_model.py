"""A small reward model for a learned-reward capability: fitted, saved with its manifest, loaded and scored.

The model is transformers' `AutoModelForSequenceClassification` with one label on a Qwen3 config
(Qwen3ForSequenceClassification: a linear score head read at the last non-pad token,
transformers/modeling_layers.py GenericForSequenceClassification): the lab base with that value head
(`init: base`), or a small one from scratch on the lab's tokenizer (`init: scratch`). It is fitted with
the Bradley-Terry loss (opd.rl.preference_loss, loop in opd.rl.reward_fit) on the pairs the
capability's hidden rule generates. It sees few pairs on purpose: its mistakes are what a policy
trained on it can exploit.

Its directory holds the HF model, its tokenizer and `manifest.json` (kind `reward_model`, the
capability, the content hash of its weights, the content hash of its tokenizer, the settings, the
held-out accuracy). A policy may only use it when the tokenizer hashes agree: the score of a text
depends on how it was split into ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from opd.capabilities import get_capability, list_capabilities
from opd.capabilities.preference import LearnedRewardCapability
from opd.errors import OpdError
from opd.io import atomic_dir, atomic_write_json, state_dict_hash, tokenizer_hash
from opd.rollout import SamplingParams, get_engine

KIND = "reward_model"
DEFAULT_ROOT = Path("runs/reward_models")


def default_dir(capability: str) -> Path:
    """Where a capability's reward model lives unless a spec names another directory."""
    return DEFAULT_ROOT / capability


class ClassifierShape(BaseModel):
    """The reward model's Qwen3 shape (the lab model's fields, opd.lab.model.ModelShape, smaller)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(64, gt=0, description="width of the residual stream")
    num_hidden_layers: int = Field(2, gt=0, description="transformer blocks")
    num_attention_heads: int = Field(2, gt=0, description="query heads")
    num_key_value_heads: int = Field(1, gt=0, description="key/value heads (GQA)")
    intermediate_size: int = Field(128, gt=0, description="MLP width")
    max_position_embeddings: int = Field(64, gt=0, description="longest prompt + answer, in tokens")


class RewardModelSettings(BaseModel):
    """How a reward model is fitted (`python scripts/train_reward_model.py`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    capability: str = Field(description="a learned-reward capability (opd.capabilities.preference)")
    pairs: int = Field(1500, gt=0, description="training pairs, drawn from the train split's prompts")
    heldout_pairs: int = Field(500, gt=0, description="held-out pairs, drawn from the val split's prompts")
    spurious: float | None = Field(None, ge=0, le=1, description="share of pairs carrying the capability's "
                                   "spurious cue; default: the capability's own")
    steps: int = Field(300, gt=0, description="optimizer steps (minibatches of pairs)")
    batch_size: int = Field(64, gt=0, description="pairs per step")
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate")
    seed: int = Field(0, description="seed for the pairs, the initial weights and the minibatch order")
    init: Literal["scratch", "base"] = Field("base", description="'base': the lab model with a value head (the "
                                             "base's weights under a fresh one-label score head); 'scratch': a "
                                             "fresh classifier of `shape`")
    shape: ClassifierShape = Field(default_factory=ClassifierShape, description="the classifier's Qwen3 shape "
                                   "(init: scratch)")
    threads: int = Field(1, gt=0, description="torch CPU threads")


def learned_reward_capability(name: str):
    cap = get_capability(name)
    if not isinstance(cap, LearnedRewardCapability):
        known = [c for c in list_capabilities() if isinstance(get_capability(c), LearnedRewardCapability)]
        raise OpdError(f"capability {name!r} has no reward model (it is verified); learned-reward capabilities: "
                       f"{', '.join(known)}")
    return cap


def build_classifier(shape: ClassifierShape, tokenizer, seed: int):
    """A fresh one-label Qwen3 sequence classifier of `shape` on `tokenizer`'s ids."""
    # opd.expert.spec imports this module (default_dir); checking a spec must not load transformers
    from transformers import AutoModelForSequenceClassification, Qwen3Config  # lazy: transformers (~0.85 s)

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads, intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config)


def base_classifier(base_dir: Path, seed: int):
    """The model at `base_dir` with a value head: its Qwen3 body under a fresh one-label score head
    (transformers loads the body's weights by name and initialises `score`, which the causal LM lacks)."""
    # lazy: transformers, as in build_classifier
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging  # lazy: transformers, as above

    torch.manual_seed(seed)
    # transformers warns that `score` is missing from the checkpoint (utils/loading_report.py): it is the
    # new head, missing by design
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(level)


def encode(tokenizer, prompts: list[str], answers: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded prompt ids followed by answer ids (B, T), as the policy's text is split: prompt and
    answer encoded apart (opd.lab.data.encode_sft). The classifier reads the last non-pad token."""
    rows = [tokenizer(p, add_special_tokens=False).input_ids + tokenizer(a, add_special_tokens=False).input_ids
            for p, a in zip(prompts, answers)]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def scores(model, tokenizer, prompts, answers) -> torch.Tensor:
    return model(**encode(tokenizer, prompts, answers)).logits[:, 0]  # (B,)


def heldout_accuracy(model, tokenizer, pairs) -> dict:
    """Share of `pairs` the model ranks right, overall and per kind of rejected answer."""
    model.eval()
    with torch.no_grad():
        right = []
        for i in range(0, len(pairs), 256):
            chunk = pairs[i: i + 256]
            c = scores(model, tokenizer, [p.prompt for p in chunk], [p.chosen for p in chunk])
            r = scores(model, tokenizer, [p.prompt for p in chunk], [p.rejected for p in chunk])
            right += (c > r).tolist()
    by_kind: dict[str, list[bool]] = {}
    for p, ok in zip(pairs, right):
        by_kind.setdefault(p.kind, []).append(ok)
    return {"accuracy": sum(right) / len(right), "n": len(right),
            "by_kind": {k: {"accuracy": sum(v) / len(v), "n": len(v)} for k, v in sorted(by_kind.items())}}


def write_reward_model(out: Path, model, tokenizer, manifest: dict) -> None:
    """The model, its tokenizer and `manifest` into `out`, atomically (a killed run leaves nothing)."""
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / "manifest.json", manifest)


class RewardModel:
    """A loaded reward model: `score(prompts, completions)` -> sigmoid of its logit, in (0, 1)."""

    def __init__(self, path: Path, model, tokenizer, manifest: dict):
        self.path, self.model, self.tokenizer, self.manifest = path, model.eval(), tokenizer, manifest

    @torch.no_grad()
    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        """One reward per (prompt, completion), read from the completion's first line, stripped (what
        the hidden rule reads)."""
        answers = [c.split("\n", 1)[0].strip() for c in completions]
        return torch.sigmoid(scores(self.model, self.tokenizer, prompts, answers)).tolist()


def check_reward_model(path: str | Path, capability: str, tokenizer, field: str = "reward_model") -> dict:
    """The manifest of the reward model at `path`, after checking that it exists, is `capability`'s and
    was trained on `tokenizer` (same `opd.io.tokenizer_hash`); else one line naming the file, the field
    and the fix. Reads no weights."""
    p = Path(path)
    mf = p / "manifest.json"
    fix = f"train it with `python scripts/train_reward_model.py --capability {capability} --base <the base> --out {p}`"
    if not mf.is_file():
        raise OpdError(f"field '{field}': {mf} is missing: capability {capability!r} learns from a reward model "
                       f"and none is at {p}; {fix}")
    try:
        m = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise OpdError(f"field '{field}': {mf} is unreadable ({type(e).__name__}); {fix}") from None
    if m.get("kind") != KIND or m.get("capability") != capability:
        raise OpdError(f"field '{field}': {mf} holds kind {m.get('kind')!r} for capability {m.get('capability')!r}, "
                       f"not a reward model for {capability!r}; {fix}")
    want = tokenizer_hash(tokenizer)
    if m.get("tokenizer_hash") != want:
        raise OpdError(f"field '{field}': {mf} field 'tokenizer_hash' is {m.get('tokenizer_hash')!r}, but the "
                       f"policy's tokenizer hashes to {want!r}: the reward model was trained on another tokenizer; "
                       f"{fix}")
    return m


def load_reward_model(path: str | Path, capability: str, tokenizer) -> RewardModel:
    """`check_reward_model`, then the model itself (CPU, float32)."""
    from transformers import AutoModelForSequenceClassification  # lazy: transformers, as in build_classifier

    m = check_reward_model(path, capability, tokenizer)
    model = AutoModelForSequenceClassification.from_pretrained(Path(path), dtype=torch.float32)
    if state_dict_hash(model) != m["content_hash"]:
        raise OpdError(f"field 'reward_model': {Path(path) / 'manifest.json'} field 'content_hash' does not match "
                       f"the weights beside it; retrain it with `python scripts/train_reward_model.py "
                       f"--capability {capability}`")
    return RewardModel(Path(path), model, tokenizer, m)


def greedy_reward(reward_model: RewardModel, model, tokenizer, capability: str, prompts: list[str]) -> float:
    """The reward model's mean score of `model`'s greedy answers to `prompts` (rendered as the capability
    renders them, answered with lm-eval's token budget for opd's tasks): given the val prompts lm-eval
    screens with, the same answers the hidden rule scores there, so the two curves compare."""
    cap = get_capability(capability)
    texts = [cap.render(p, tokenizer) for p in prompts]
    engine = get_engine("embedded", model=model, tokenizer=tokenizer)
    # max_gen_toks of opd's lm-eval tasks (opd.evaluation.tasks.task_yaml)
    groups = engine.generate(texts, 1, SamplingParams(temperature=0.0, max_new_tokens=cap.max_new_tokens + 2))
    got = reward_model.score(texts, [g[0].text for g in groups])
    return sum(got) / max(1, len(got))
