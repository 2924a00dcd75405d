"""Expert specs: the YAML in experts/<name>.yaml that `scripts/train_expert.py` trains from."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from opd.capabilities import get_capability
from opd.config import load_yaml_model
from opd.paths import NAME_PATTERN
from opd.rl.distributed import DeepSpeedFragment
from opd.tracking import REPORT_TO_HELP, ReportTo


class GSPOConfig(BaseModel):
    """GSPO settings (Zheng et al., 2025). Library defaults follow the paper."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts_per_step: int = Field(16, gt=0, le=4096, description="prompts (groups) per rollout batch")
    group_size: int = Field(8, gt=1, le=1024, description="samples per prompt; advantages are normalised within a group")
    updates_per_batch: int = Field(4, gt=0, description="minibatch updates per rollout batch (ratios leave 1 after the first)")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate")
    eps_low: float = Field(3e-4, ge=0, description="lower clip: ratio floor is 1 - eps_low")
    eps_high: float = Field(4e-4, ge=0, description="upper clip: ratio ceiling is 1 + eps_high")
    level: Literal["sequence", "token"] = Field("sequence", description="'sequence' = GSPO, 'token' = GSPO-token")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL penalty to the initial policy (0 = off)")
    temperature: float = Field(1.0, gt=0, description="rollout sampling temperature")
    max_temperature: float = Field(1.5, gt=0, description="ceiling when temperature is raised to revive stalled groups")
    max_new_tokens: int | None = Field(None, gt=0, le=32768, description="default: the capability's own")
    drop_zero_variance: bool = Field(True, description="drop groups whose samples all got the same reward")
    min_informative: float = Field(0.5, ge=0, le=1, description="resample prompts until this share of groups has mixed rewards")
    max_resample: int = Field(2, ge=0, description="extra rollout rounds allowed per step to reach min_informative")
    grad_clip: float = Field(1.0, gt=0)
    recompute_old_logprobs: bool = Field(True, description="old logprobs from the trainer, not the engine (engine mismatch is logged)")
    tis_cap: float | None = Field(None, gt=0, description="truncated importance sampling: weight each sample by "
                                  "min(pi_trainer / pi_engine, tis_cap) (GSPO-token: each token); None = off")

    @model_validator(mode="after")
    def _check_tis(self):
        if self.tis_cap is not None and not self.recompute_old_logprobs:
            raise ValueError("tis_cap needs recompute_old_logprobs: true (the clip uses the trainer's old "
                             "logprobs, the engine's enter only through the TIS weight)")
        return self


class ExpertSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, pattern=NAME_PATTERN, description="expert name (one path component: "
                             "letters, digits, _ - .); default: the capability")
    capability: str = Field(description="capability to train (a registry name)")
    base: str = Field("runs/base", description="base model directory (HF format)")
    seed: int = Field(0, description="seed for sampling and the prompt stream")
    reward: Literal["verifier", "partial"] = Field("verifier", description="training reward (opd.capabilities.rewards); eval always uses the verifier")
    reward_timeout_s: float = Field(2.0, ge=0, description="a reward call taking longer scores 0 and is counted (0 = no limit)")
    difficulty: int | None = Field(None, ge=0, description="prompt difficulty; default: the capability's (the eval's)")
    steps: int = Field(200, gt=0, description="rollout batches (upper bound; max_minutes may stop earlier)")
    max_minutes: float = Field(10.0, gt=0, description="wall-clock budget; the best checkpoint by validation is kept")
    gspo: GSPOConfig = Field(default_factory=GSPOConfig)
    engine: Literal["embedded", "sglang"] = Field("embedded", description="rollout engine")
    engine_args: dict = Field(default_factory=dict, description="engine options, e.g. {base_url: http://127.0.0.1:30000} for sglang")
    eval_every: int = Field(10, gt=0, description="steps between validation screenings")
    eval_limit: int = Field(100, gt=0, description="validation items per screening")
    checkpoint_every: int = Field(10, gt=0, description="steps between resumable checkpoints")
    score_capabilities: list[str] | None = Field(None, description="capabilities for the final matrix; default: the base's")
    deepspeed: DeepSpeedFragment = Field(None, description="DeepSpeed config (e.g. {zero_optimization: {stage: 2}}); None = plain torch")
    threads: int = Field(2, gt=0, description="torch CPU threads")
    report_to: ReportTo = Field("tensorboard", description=REPORT_TO_HELP + " (changes no weights: not part "
                                "of the spec's identity)")


    @model_validator(mode="after")
    def _check(self):
        get_capability(self.capability)
        for c in self.score_capabilities or []:
            get_capability(c)
        return self

    @property
    def expert_name(self) -> str:
        return self.name or self.capability.replace(":", "_")


def same_spec(stored: dict | None, spec: ExpertSpec) -> bool:
    """Whether a spec recorded in a manifest or checkpoint is `spec`. The stored one is validated
    through today's model first, so a field added since (with its default) changes nothing; nor does
    where the curves go (`report_to`)."""
    try:
        return stored is not None and \
            ExpertSpec.model_validate(stored).model_copy(update={"report_to": spec.report_to}) == spec
    except Exception:
        return False


def load_expert_spec(path: str | Path, **overrides) -> ExpertSpec:
    """An expert spec YAML with dotted overrides (`gspo.lr="1e-3"`) as a validated ExpertSpec."""
    return load_yaml_model(path, ExpertSpec, "expert spec", overrides)
