"""What the search measures against: a scorer that scores state dicts in-process on one model
object, and each capability's reference score (its owning expert's, else the base's)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from opd.devices import place
from opd.evaluation.api import Score, evaluate
from opd.evaluation.backends import evaluate_on_disk
from opd.io import state_dict_hash
from opd.merge.interference import MIN_GAIN_Z, gain_z
from opd.merge.strategies import MergeInputs
from opd.weights.lazy import load_into


class Scorer:
    """Scores state dicts on one reusable model object (no model rebuilt, no subprocess)."""

    def __init__(self, inputs: MergeInputs, batch_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, scoring=None):
        """Scores on `device` in `dtype`: on the base model itself on the CPU in float32, else on a copy
        there (the base stays on the CPU in float32, where the merges read it). `scoring` (the recipe's):
        vllm / sglang score each candidate from disk."""
        device = torch.device(device)
        self.scoring = scoring
        self.model = inputs.base_model if (device.type, dtype) == ("cpu", torch.float32) else \
            place(copy.deepcopy(inputs.base_model), device, dtype)
        self.base_sd = inputs.base_sd
        self.tokenizer, self.caps, self.batch_size = inputs.tokenizer, inputs.capabilities, batch_size
        self.calls = 0

    def score(self, sd: dict, split: str, limit: int | None = None, caps: list[str] | None = None) -> dict[str, Score]:
        # tensor by tensor (sd may be lazy); a tied lm_head follows the embedding. The merged weights stay on
        # the CPU in float32: copy_ moves each onto the scorer's device and dtype
        load_into(self.model, sd)
        self.calls += 1
        if self.scoring is not None and self.scoring.backend != "hf":
            return evaluate_on_disk(self.model, self.tokenizer, self.scoring, caps or self.caps, split, limit,
                                    state_dict_hash(self.model))
        return evaluate(self.model, self.tokenizer, caps or self.caps, split, limit=limit,
                        batch_size=self.batch_size, model_hash=state_dict_hash(self.model))


@dataclass
class References:
    """Per-capability reference scores: the owning expert's, else the base's."""

    screen: dict[str, float] = field(default_factory=dict)
    val: dict[str, float] = field(default_factory=dict)
    test: dict[str, float] = field(default_factory=dict)
    base: dict[str, dict[str, Score]] = field(default_factory=dict)  # split -> cap -> score
    experts: dict[str, dict[str, dict[str, Score]]] = field(default_factory=dict)  # split -> expert -> cap
    # The capabilities whose expert beats the base on full val (MIN_GAIN_Z): the min/mean objectives and
    # OPD's keep-best checkpoint count only these (all capabilities when none does).
    counted: list[str] = field(default_factory=list)
    owner: dict[str, str] = field(default_factory=dict)  # capability -> the expert its reference is


def score_references(inputs: MergeInputs, scorer: Scorer, screen_limit: int | None) -> References:
    refs = References()
    for split in ("val", "test"):
        refs.base[split] = scorer.score(scorer.base_sd, split)
        refs.experts[split] = {e: scorer.score(sd, split) for e, sd in inputs.expert_sds.items()}
    owner = {}
    for e, m in inputs.manifests.items():
        for cap in m.tasks:  # a task several experts list is owned by the best of them on val
            if cap in inputs.capabilities:
                best = owner.get(cap)
                if best is None or refs.experts["val"][e][cap].score > refs.experts["val"][best][cap].score:
                    owner[cap] = e
    for cap in inputs.capabilities:
        e = owner.get(cap)
        val, test = (refs.experts["val"][e], refs.experts["test"][e]) if e else (refs.base["val"], refs.base["test"])
        refs.val[cap], refs.test[cap] = val[cap].score, test[cap].score
        sd = inputs.expert_sds[e] if e else scorer.base_sd
        refs.screen[cap] = scorer.score(sd, "val", screen_limit, [cap])[cap].score if screen_limit else refs.val[cap]
    refs.owner = owner
    b = refs.base["val"]
    refs.counted = [c for c in inputs.capabilities if owner.get(c) and gain_z(
        refs.experts["val"][owner[c]][c].score, refs.experts["val"][owner[c]][c].stderr, b[c].score, b[c].stderr)
        >= MIN_GAIN_Z] or list(inputs.capabilities)
    return refs
