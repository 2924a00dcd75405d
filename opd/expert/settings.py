"""What the GSPO loop (opd.expert.trainer) takes: its GSPO settings and its run settings.

`GSPOConfig` is the `gspo:` block of an expert spec; `GSPORun` is what one run trains on and for how
long, which the expert recipe builds from its spec (`ExpertSpec.run_settings`). The loop reads
nothing else, so it runs without a spec (bench/bench_gspo_trl.py builds both directly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
    layout: Literal["grouped", "packed"] = Field(
        "grouped", description="how the update lays out its rows: 'grouped' (each prompt's KV cache copied under its "
        "rows' completions) or 'packed' (one forward without padding, opd.rl.packed_logits): the same values and "
        "gradients up to float rounding; packed is the faster on CPUs")
    minibatch: Literal["rows", "groups"] = Field(
        "rows", description="how a rollout batch splits into updates_per_batch minibatches: 'rows' (rows shuffled "
        "one by one) or 'groups' (whole groups shuffled, so a minibatch runs each of its prompts once for all its "
        "samples; with layout packed the faster on CPUs). The same objective, another split of it")
    tis_cap: float | None = Field(None, gt=0, description="truncated importance sampling: weight each sample by "
                                  "min(pi_trainer / pi_engine, tis_cap) (GSPO-token: each token); None = off")

    @model_validator(mode="after")
    def _check_tis(self):
        if self.tis_cap is not None and not self.recompute_old_logprobs:
            raise ValueError("tis_cap needs recompute_old_logprobs: true (the clip uses the trainer's old "
                             "logprobs, the engine's enter only through the TIS weight)")
        return self


class GSPORun(BaseModel):
    """One GSPO run: the capability it trains on and with which reward, its budget, how often it
    screens and checkpoints, and the job its checkpoints belong to. Defaults: a default expert spec's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="names the run in the log (an expert's name)")
    capability: str = Field(description="capability whose train prompts and reward train the policy")
    seed: int = Field(0, description="seed for sampling and the prompt stream")
    difficulty: int | None = Field(None, ge=0, description="prompt difficulty; default: the capability's")
    reward: str = Field("verifier", description="training reward (opd.capabilities.rewards), or 'reward_model': "
                        "the score of the reward model at `reward_model`")
    reward_model: str | None = Field(None, description="reward model directory (opd.capabilities.reward_model) "
                                     "when reward is 'reward_model'")
    reward_timeout_s: float = Field(2.0, ge=0, description="a reward call taking longer scores 0 and is counted "
                                    "(0 = no limit)")
    steps: int = Field(200, gt=0, description="rollout batches (upper bound; max_minutes may stop earlier)")
    max_minutes: float = Field(10.0, gt=0, description="wall-clock budget")
    eval_every: int = Field(10, gt=0, description="steps between validation screenings (evaluate_fn)")
    patience: int | None = Field(None, gt=0, description="stop after this many screenings in a row that did not "
                                 "beat the kept checkpoint (None: run all `steps`)")
    checkpoint_every: int = Field(10, gt=0, description="steps between resumable checkpoints")
    engine: str = Field("embedded", description="rollout engine (opd.rollout)")
    engine_args: dict = Field(default_factory=dict, description="engine options")
    deepspeed: bool = Field(False, description="the updates run under a DeepSpeed engine (`wrap`): its "
                            "checkpoints hold DeepSpeed's classes")
    job: dict = Field(default_factory=dict, description="the job as its recipe records it (an expert: its "
                      "resolved spec), written into every checkpoint")
    same_job: Callable[[dict | None], bool] | None = Field(
        None, exclude=True, description="whether a checkpoint's recorded job is this run's (default: equal to "
        "`job`); a checkpoint of another job is never resumed")

    def resumes(self, recorded: dict | None) -> bool:
        """Whether a checkpoint that recorded `recorded` as its job may be resumed by this run."""
        return self.same_job(recorded) if self.same_job is not None else recorded == self.job
