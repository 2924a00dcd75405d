"""Expert specs: the YAML in experts/<name>.yaml that `scripts/train_expert.py` trains from.

A spec is the recipe's input; the GSPO loop takes the settings the spec resolves to
(`spec.gspo` and `spec.run_settings()`, opd.expert.settings), never the spec itself.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from opd.capabilities import get_capability
from opd.capabilities.preference import LearnedRewardCapability
from opd.capabilities.reward_model import default_dir
from opd.config import load_yaml_model
from opd.devices import DeviceName, DtypeName
from opd.expert.settings import GSPOConfig, GSPORun
from opd.paths import NAME_PATTERN
from opd.rl.distributed import DeepSpeedFragment
from opd.tracking import REPORT_TO_HELP, ReportTo


class ExpertSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, pattern=NAME_PATTERN, description="expert name (one path component: "
                             "letters, digits, _ - .); default: the capability")
    capability: str = Field(description="capability to train (a registry name)")
    base: str = Field("runs/base", description="base model directory (HF format)")
    seed: int = Field(0, description="seed for sampling and the prompt stream")
    reward: Literal["verifier", "partial", "reward_model"] = Field(
        "verifier", description="training reward (opd.capabilities.rewards), or 'reward_model': the score of a "
        "learned-reward capability's reward model (opd.capabilities.preference); eval always uses the verifier "
        "(for those capabilities, their hidden rule)")
    reward_model: str | None = Field(None, description="with reward: reward_model, the reward model's directory "
                                     "(default runs/reward_models/<capability>, made by scripts/train_reward_model.py)")
    reward_timeout_s: float = Field(2.0, ge=0, description="a reward call taking longer scores 0 and is counted (0 = no limit)")
    difficulty: int | None = Field(None, ge=0, description="prompt difficulty; default: the capability's (the eval's)")
    steps: int = Field(200, gt=0, description="rollout batches (upper bound; max_minutes may stop earlier)")
    max_minutes: float = Field(10.0, gt=0, description="wall-clock budget; the best checkpoint by validation is kept")
    gspo: GSPOConfig = Field(default_factory=GSPOConfig)
    engine: Literal["embedded", "sglang"] = Field("embedded", description="rollout engine")
    engine_args: dict = Field(default_factory=dict, description="engine options, e.g. {base_url: http://127.0.0.1:30000} for sglang")
    eval_every: int = Field(10, gt=0, description="steps between validation screenings")
    eval_limit: int = Field(100, gt=0, description="validation items per screening")
    patience: int | None = Field(None, gt=0, description="stop after this many validation screenings in a row "
                                 "that did not beat the kept checkpoint (None: train all `steps`); the kept "
                                 "checkpoint is a full run's unless a later screening would have beaten it")
    checkpoint_every: int = Field(10, gt=0, description="steps between resumable checkpoints")
    score_capabilities: list[str] | None = Field(None, description="capabilities for the final matrix; default: the base's")
    deepspeed: DeepSpeedFragment = Field(None, description="DeepSpeed config (e.g. {zero_optimization: {stage: 2}}); None = plain torch")
    threads: int = Field(2, gt=0, description="torch CPU threads")
    device: DeviceName = Field("auto", description="where the policy trains and samples: 'auto' (the GPU when "
                               "there is one, else the CPU), 'cpu', 'cuda' (under a launcher, each rank's own "
                               "GPU) or 'cuda:N'; where it ran is not part of the spec's identity")
    dtype: DtypeName = Field("auto", description="the policy's weights: 'float32', 'bfloat16' (the optimizer "
                             "then updates bf16 weights) or 'auto' (bfloat16 on a GPU that computes in it, else "
                             "float32)")
    resources: dict[str, float] | None = Field(None, description="what the expert's Ray task asks of a node "
                                               "when the lab runs on a cluster, e.g. {CPU: 4, GPU: 1} (default "
                                               "{CPU: threads}); changes no weights: not part of the spec's identity")
    report_to: ReportTo = Field("tensorboard", description=REPORT_TO_HELP + " (changes no weights: not part "
                                "of the spec's identity)")


    @model_validator(mode="after")
    def _check(self):
        cap = get_capability(self.capability)
        if self.reward == "reward_model" and not isinstance(cap, LearnedRewardCapability):
            raise ValueError(f"reward 'reward_model' needs a learned-reward capability (anagram, mirror); "
                             f"{self.capability!r} is verified: use reward 'verifier' or 'partial'")
        if self.reward_model is not None and self.reward != "reward_model":
            raise ValueError("reward_model is set but reward is not 'reward_model'")
        for c in self.score_capabilities or []:
            get_capability(c)
        return self

    @property
    def expert_name(self) -> str:
        return self.name or self.capability.replace(":", "_")

    @property
    def task_resources(self) -> dict[str, float]:
        """The resources its cluster task asks for: `resources`, else one CPU per torch thread."""
        return dict(self.resources) if self.resources is not None else {"CPU": float(self.threads)}

    @property
    def reward_model_dir(self) -> str | None:
        """The reward model the expert trains on (reward: reward_model), else None."""
        if self.reward != "reward_model":
            return None
        return self.reward_model or str(default_dir(self.capability))

    def run_settings(self) -> GSPORun:
        """The GSPO loop's run settings for this spec. Its checkpoints record the spec, and a run
        resumes only a checkpoint of the same spec (`same_spec`)."""
        return GSPORun(name=self.expert_name, capability=self.capability, seed=self.seed, difficulty=self.difficulty,
                       reward=self.reward, reward_model=self.reward_model_dir, reward_timeout_s=self.reward_timeout_s, steps=self.steps,
                       max_minutes=self.max_minutes, eval_every=self.eval_every, patience=self.patience,
                       checkpoint_every=self.checkpoint_every,
                       engine=self.engine, engine_args=self.engine_args, deepspeed=self.deepspeed is not None,
                       job=self.model_dump(mode="json"), same_job=functools.partial(same_spec, spec=self))


def same_spec(stored: dict | None, spec: ExpertSpec) -> bool:
    """Whether a spec recorded in a manifest or checkpoint is `spec`. The stored one is validated
    through today's model first, so a field added since (with its default) changes nothing; nor does
    where the curves go (`report_to`), where it ran (`device`: a spec run on a GPU resumes on a CPU) nor
    what a cluster task asks for (`resources`)."""
    try:
        return stored is not None and ExpertSpec.model_validate({**stored, "device": "cpu"}).model_copy(
            update={"report_to": spec.report_to, "device": spec.device, "resources": spec.resources}) == spec
    except Exception:
        return False


def load_expert_spec(path: str | Path, **overrides) -> ExpertSpec:
    """An expert spec YAML with dotted overrides (`gspo.lr="1e-3"`) as a validated ExpertSpec."""
    return load_yaml_model(path, ExpertSpec, "expert spec", overrides)
