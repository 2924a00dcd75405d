"""On-policy distillation settings: the loop's knobs and a standalone run's inputs, as frozen models."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator, model_validator

from opd.capabilities import get_capability
from opd.config import load_yaml_model
from opd.devices import DeviceName, DtypeName
from opd.distill.ahead import Worker
from opd.errors import OpdError
from opd.model_inputs import ExpertEntry, ExpertInput
from opd.rl.distributed import DeepSpeedFragment
from opd.rl.packing import Layout
from opd.tracking import REPORT_TO_HELP, ReportTo

Estimator = Literal["sampled", "full", "topk", "teacher_topk"]
# What consolidation may read of a capability besides its prompts: 'capability', its reward (the
# verifier, or whatever reward its experts trained on); 'none', nothing (domains with no verifier).
Verifier = Literal["capability", "none"]
VERIFIER_HELP = ("'capability': consolidation may call the capability's reward (the warm start keeps the "
                 "teacher samples it accepts, reward_weight mixes it into OPD, each step logs it); 'none': no "
                 "reward is ever computed: the warm start is sequence-level distillation on the teachers' "
                 "unfiltered samples, OPD has no reward term, no step logs or selects by reward (val and test "
                 "scoring stay lm-eval's)")


class TeacherRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    expert: str = Field(description="expert name (experts/<name>/) or path")
    weight: float = Field(1.0, gt=0, description="share of this teacher in its capability's KL target")


class TeacherActors(BaseModel):
    """How `teachers_on: ray` lays the teachers out over Ray actors (opd.distill.remote)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    address: str = Field("auto", description="the Ray cluster: 'auto', 'ray://host:port' or 'host:port'")
    per_actor: int = Field(1, ge=1, description="teachers held by one actor (routed teachers in name order)")
    replicas: dict[str, int] = Field(default_factory=dict, description="capability -> actors serving its "
                                     "teachers (default 1): an over-provisioned capability's rows are split "
                                     "between them")
    resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0}, description="what each actor asks "
                                        "of a node, e.g. {CPU: 4, GPU: 1} for a teacher on its own GPU")


class DistillConfig(BaseModel):
    """How the student learns from its teachers. Every field has a default a pico model trains with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    estimator: Estimator = Field("sampled", description="'sampled': per-token advantage -(log pi_s - log pi_t) "
                                 "in the GSPO-token loss; 'full': exact full-vocabulary reverse KL per token; "
                                 "'topk': reverse KL over the student's top-`topk` tokens plus one tail bucket; "
                                 "'teacher_topk': over each row's teacher's top-`topk` tokens plus one tail bucket, "
                                 "what teachers on SGLang servers or Ray actors return (one teacher per row)")
    topk: int | None = Field(None, ge=1, description="K of the top-k estimators (needed by topk and teacher_topk, read "
                             "by no other): per token, the KL between student and target coarsened to the student's "
                             "(topk) or the teacher's (teacher_topk) K most likely tokens and one bucket for the rest "
                             "(K >= the vocabulary is the full estimator)")
    steps: int = Field(50, ge=0, description="rollout batches (one optimizer pass each); 0 with warmstart_steps "
                       "> 0 is off-policy distillation alone")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="'cosine': decay from lr to lr * lr_min_ratio over `steps` (the last step at the floor)")
    lr_min_ratio: float = Field(0.1, ge=0, le=1, description="final lr / lr under the cosine schedule")
    prompts_per_step: int = Field(16, gt=0, le=4096, description="prompts drawn per step, over all routed capabilities")
    group_size: int = Field(4, gt=0, le=1024, description="student samples per prompt (the verifier reward is "
                            "group-normalised, so mixing it in needs >= 2)")
    max_new_tokens: int | None = Field(None, gt=0, le=32768, description="sampling cap (default: the largest routed "
                                       "capability's max_new_tokens + 1)")
    temperature: float = Field(1.0, gt=0, description="student sampling temperature")
    updates_per_batch: int = Field(1, gt=0, description="minibatch updates per rollout batch")
    eps_low: float = Field(0.2, ge=0, description="GSPO-token clip below 1 (sampled estimator)")
    eps_high: float = Field(0.28, ge=0, description="GSPO-token clip above 1 (sampled estimator)")
    reward_weight: float = Field(0.0, ge=0, description="weight of the capability's group-normalised verifier "
                                 "reward added to the distillation advantage (0: pure distillation)")
    kl_weight: float = Field(1.0, ge=0, description="weight of the reverse-KL term; 0 with reward_weight > 0 is "
                             "multi-task GSPO on verifier rewards alone (the bench's control)")
    grad_clip: float = Field(1.0, gt=0)
    routes: dict[str, list[TeacherRef]] | None = Field(
        None, description="capability -> teachers (default: each teacher serves its tasks: an opd expert's "
        "manifest capability, a BYO entry's tasks)")
    mix: dict[str, float] | None = Field(None, description="capability -> prompt share (default: each "
                                         "capability's summed teacher weight)")
    adaptive_mix: float = Field(0.0, ge=0, description="after each retention check, scale capability c's prompt "
                                "share by 1 + adaptive_mix * (1 - retention_c), so the student sees more of what it "
                                "is losing (0: the mix stays fixed; needs eval_every > 0 and teacher references)")
    domain_balance: Literal["none", "dn", "d3"] = Field(
        "none", description="balancing the capabilities (domains) of a multi-teacher run: 'dn' (DN-MOPD) scales each "
        "capability's per-token loss in a minibatch by clip(sigma_all / sigma_c, 0.25, 4), the standard deviations "
        "of the per-token loss terms over all tokens and over the capability's; 'd3' (D3-MOPD) draws each step's "
        "prompts with share_c proportional to mix_c * clip(KL_c / mean KL, 0.25, 4), KL_c the capability's mean "
        "reverse KL to its teachers in the previous step; 'none': neither")
    capability_weights: dict[str, PositiveFloat] | None = Field(
        None, description="capability -> weight of its prompts' per-token loss (default: 1 each); divided by the "
        "mean over each batch's prompts, so only the ratios matter")
    checkpoint_every: int = Field(10, gt=0, description="steps between resumable checkpoints")
    eval_every: int = Field(0, ge=0, description="steps between retention checks on val (0: only at the end)")
    eval_limit: int | None = Field(50, gt=0, description="val items per capability in a retention check")
    kernel_chunk: int = Field(1024, gt=0, le=16384, description="tokens per chunk in the full-vocabulary kernels")
    teacher_forward: Literal["stacked", "loop"] = Field(
        "stacked", description="'stacked': every in-process teacher scores its rows in one vectorised forward "
        "(torch.func.vmap over stacked weights) that also gives the full estimator's targets; 'loop': one forward "
        "per teacher, and another for the full estimator (the only way for SGLang teachers, taken automatically)")
    teachers_on: Literal["local", "ray"] = Field(
        "local", description="'local': teachers score in the student's process; 'ray': on Ray actors "
        "(`teacher_actors`), each scoring the rows routed to it and returning what the estimator needs "
        "(the sampled tokens' log-probs, or full-vocabulary log-probs for full and top-k); the student routes "
        "the rows, gathers the answers and updates. The same losses to float rounding")
    teacher_actors: TeacherActors | None = Field(None, description="actors, replicas and resources of "
                                                 "teachers_on: ray (default: one actor per teacher, 1 CPU)")
    layout: Layout = Field("padded", description="how the student's update, the warm start and the stacked "
                           "teachers lay out token rows, and how the student prefills its prompts before sampling: 'padded' (one "
                           "right-padded row per sample, prompts left-padded) or 'packed' (no padding, a group's prompt "
                           "once, rows of mixed lengths packed together under a block attention mask: the same hidden "
                           "states up to float rounding at a fraction of the positions; see opd.rl.packing)")
    compact_every: int | None = Field(
        None, gt=0, le=32768, description="the student samples in `generate` calls of this many tokens, and only the "
        "rows that have not stopped go on to the next, from the KV cache (default: one call, every row computed to "
        "the longest answer of the batch). The same sampling distribution; with answers of mixed lengths (short "
        "arithmetic beside long string tasks) it skips the rows that have ended (see opd.rollout.embedded)")
    sample_ahead: bool = Field(False, description="sample and score the next step's batch in a worker (see "
                               "sample_worker), on a copy of the student synced after every step, while this step's "
                               "update runs: "
                               "the two use both cores of a CPU, and each batch comes from the student one step "
                               "before the one it updates")
    sample_worker: Worker = Field(
        "thread", description="where sample_ahead samples: 'thread' (a background thread of this process) or "
        "'process' (a worker forked at the start, the sampler's weights in shared memory and pushed after every "
        "update, as to a rollout server; platforms that fork, CPU students). The two give the same batches; a process "
        "does not share the GIL with the update, which makes it the faster on a CPU (see opd.distill.ahead)")
    inference_dtype: Literal["float32", "bfloat16", "auto"] | None = Field(
        None, description="dtype the student samples in and the stacked teachers score in (default: the student's "
        "own, with no copy); the update stays in the student's own dtype. 'bfloat16' runs their matrix products "
        "faster on CPUs with AVX512-BF16 or AMX and on GPUs, but tens of times slower on CPUs with AVX2 alone; "
        "'auto' times one product in each dtype on this machine and takes the faster (opd.distill.precision). "
        "With bf16, as an SGLang server samples a bf16 copy of a model trained in fp32, the student samples from its "
        "weights rounded to bf16 (the sampled estimator's old log-probs are that copy's), and each token's teacher "
        "target is computed from bf16 teachers (in fp32 after the head)")
    verifier: Verifier = Field("capability", description=VERIFIER_HELP)
    warmstart_steps: int = Field(0, ge=0, description="supervised steps on verified teacher samples before OPD "
                                 "(off-policy distillation as a warm start; 0: none; with verifier: none, on "
                                 "unfiltered teacher samples)")
    warmstart_prompts: int = Field(256, gt=0, description="training prompts per capability its teacher samples "
                                   "for the warm start")
    warmstart_group: int = Field(4, gt=0, description="teacher samples per warm-start prompt (the verifier keeps "
                                 "the correct ones)")
    warmstart_temperature: float = Field(1.0, gt=0, description="teacher sampling temperature for the warm start")
    warmstart_select: Literal["all", "mbr"] = Field(
        "all", description="which teacher samples the warm start trains on: 'all' (every kept sample) or 'mbr' (per "
        "prompt, the one sample that agrees most with the teacher's other samples of it: minimum Bayes risk, a "
        "consensus that reads no reward, for domains with no verifier; set warmstart_group to the samples to vote)")
    warmstart_loss: Literal["nll", "kl"] = Field(
        "nll", description="the warm start's loss on its teacher samples: 'nll' (the sampled tokens, sequence-level KD) "
        "or 'kl' (at each of their tokens the exact KL(student || teacher) over the full vocabulary to the "
        "capability's teacher, word-level KD; needs in-process teachers and costs a teacher forward per step)")
    warmstart_target_temperature: float = Field(
        1.0, gt=0, description="with warmstart_loss kl: the temperature of the teacher's distribution that each token's "
        "KL targets: 1.0 its own; warmstart_temperature's value the sharper one that drew its samples")
    warmstart_topk: int | None = Field(
        None, ge=1, description="with warmstart_loss kl: the KL at each token over the teacher's K most likely tokens "
        "and one tail bucket with the rest of each side's mass (an exact KL between the two (K+1)-way coarsenings, "
        "never above the full one; K >= the vocabulary is the full KL): the cache holds 8 x K bytes a token instead "
        "of 4 x vocab, and teachers on SGLang servers (teacher_servers), which return top-K log-probs and not the "
        "full vocabulary, can be distilled from; None: the full vocabulary (in-process teachers only)")
    warmstart_cache_mib: int = Field(
        4096, ge=0, description="with warmstart_loss kl: the most host memory (MiB) that the teachers' logits at every "
        "token of their distinct warm-start samples may take; within it each teacher scores each distinct sample once, "
        "in large batches, and a step costs the student alone (the same targets to float rounding); above it, or "
        "at 0, each step runs its pairs' teachers (a real vocabulary: 4 bytes x vocab per token)")
    warmstart_lr: float = Field(1e-3, gt=0, description="AdamW lr of the warm start (cosine to lr_min_ratio)")
    warmstart_batch: int = Field(64, gt=0, description="sequences per warm-start step")
    warmstart_draws: Literal["pairs", "groups"] = Field(
        "pairs", description="how a warm-start step draws its warmstart_batch sequences: 'pairs' (each a random teacher "
        "sample) or 'groups' (random prompts, each with all its kept samples, until there are warmstart_batch): with "
        "layout packed each prompt is then laid out once for its samples, so a step costs fewer tokens")
    warmstart_balance: Literal["none", "d3"] = Field(
        "none", description="balancing the capabilities in the warm start's draws: 'd3' (D3-MOPD's schedule, on the "
        "teachers' samples) draws each step's pairs with share_c proportional to mix_c * clip(KL_c / mean KL, 0.25, "
        "4), KL_c a running mean (decay 0.9 a step) of the capability's sequence KL in the steps so far (logged every 50 "
        "steps under warmstart_loss kl either way); needs warmstart_loss kl; 'none': the mix itself")
    report_to: ReportTo = Field("tensorboard", description=REPORT_TO_HELP)
    seed: int = 0

    @field_validator("capability_weights")
    @classmethod
    def _known_capabilities(cls, weights):
        for cap in weights or {}:
            try:
                get_capability(cap)
            except OpdError as e:  # as a ValueError, so the message names the file and the field
                raise ValueError(str(e)) from None
        return weights

    @model_validator(mode="after")
    def _check(self):
        for cap in list(self.routes or {}) + list(self.mix or {}):
            get_capability(cap)
        for cap, teachers in (self.routes or {}).items():
            if not teachers:
                raise ValueError(f"routes.{cap}: list at least one teacher")
        if self.steps == 0 and self.warmstart_steps == 0:
            raise ValueError("steps and warmstart_steps are both 0: nothing to train")
        if self.kl_weight == 0 and self.reward_weight == 0:
            raise ValueError("kl_weight and reward_weight are both 0: nothing to learn from")
        if self.verifier == "none" and self.reward_weight > 0:
            what = ("kl_weight 0 with reward_weight > 0 is multi-task GSPO on the capability's reward"
                    if self.kl_weight == 0 else f"reward_weight {self.reward_weight} mixes the capability's reward "
                    "into OPD")
            raise ValueError(f"{what}, which verifier: none rules out: set reward_weight: 0 (or verifier: capability)")
        if self.reward_weight > 0 and self.group_size < 2:
            raise ValueError("reward_weight > 0 needs group_size >= 2 (rewards are group-normalised)")
        if self.estimator == "topk" and self.topk is None:
            raise ValueError("estimator 'topk' needs topk: K, the number of the student's most likely tokens "
                             "per position (>= 1)")
        if self.estimator == "teacher_topk" and self.topk is None:
            raise ValueError("estimator 'teacher_topk' needs topk: K, the number of the teacher's most likely tokens "
                             "per position (>= 1)")
        if self.warmstart_target_temperature != 1.0 and self.warmstart_loss != "kl":
            raise ValueError("warmstart_target_temperature is the temperature of warmstart_loss kl's target: set "
                             "warmstart_loss: kl, or leave warmstart_target_temperature at 1.0")
        if self.warmstart_topk is not None and self.warmstart_loss != "kl":
            raise ValueError("warmstart_topk is the support of warmstart_loss kl's target: set warmstart_loss: kl, or "
                             "remove warmstart_topk")
        if self.warmstart_topk is not None and self.warmstart_target_temperature != 1.0:
            raise ValueError("warmstart_target_temperature rescales the teacher's full logits, which warmstart_topk "
                             "does not keep: leave warmstart_target_temperature at 1.0, or remove warmstart_topk")
        if self.warmstart_balance == "d3" and self.warmstart_loss != "kl":
            raise ValueError("warmstart_balance d3 schedules the capabilities by their KL to the teacher: set "
                             "warmstart_loss: kl, or warmstart_balance: none")
        if self.teachers_on == "ray" and self.warmstart_loss == "kl" and self.warmstart_steps > 0 \
                and self.warmstart_topk is None:
            raise ValueError("warmstart_loss: kl reads each teacher's full distribution in this process; with "
                             "teachers_on: ray the teachers live in actors: set warmstart_topk: K (the actors "
                             "return their top-K log-probs), use warmstart_loss: nll, or teachers_on: local")
        if self.teachers_on == "ray" and self.sample_ahead and self.sample_worker == "process":
            raise ValueError("teachers_on: ray with sample_ahead needs sample_worker: thread (a forked worker "
                             "cannot call the teachers' Ray actors)")
        if self.adaptive_mix > 0 and self.eval_every == 0:
            raise ValueError("adaptive_mix reweights prompts after each retention check: set eval_every > 0")
        return self


def one_verifier(data: Any) -> Any:
    """A run's or recipe's raw fields with `verifier` given once: the top-level field and its `distill`
    block's `verifier` are one setting, so whichever is given is copied to the other (both given and
    different: refused). Used as a `mode="before"` validator, so the `distill` block is validated with it."""
    if not isinstance(data, dict):
        return data
    block = data.get("distill")
    if isinstance(block, DistillConfig):  # built in Python: its verifier counts only if it was set
        inner = block.verifier if "verifier" in block.model_fields_set else None
    else:
        inner = block.get("verifier") if isinstance(block, dict) else None
    top = data.get("verifier")
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"verifier: {top} and distill.verifier: {inner} disagree; give it once, at the top")
    chosen = top if top is not None else inner
    if chosen is None or not isinstance(block, dict | DistillConfig | None):  # a bad block: its own error
        return data
    fields = block.model_dump() if isinstance(block, DistillConfig) else dict(block or {})
    return {**data, "verifier": chosen, "distill": {**fields, "verifier": chosen}}


class DistillRun(BaseModel):
    """A standalone OPD job (`python -m opd.distill run.yaml`): inputs, student init, settings, output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[\w-][\w.-]*$", description="names the output directory (one path "
                      "component: letters, digits, _ - .)")
    base: str = Field("runs/base", description="the base model all teachers were trained from")
    teachers: list[ExpertInput] = Field(
        min_length=1, description="opd experts (a name, experts/<name>/, or a path holding manifest.json), or any HF "
        "causal-LM directory fine-tuned from the base as {path: DIR, tasks: [...]}: each teacher serves the "
        "prompts of its tasks (an opd expert: its manifest's capability)")
    student: str = Field("base", description="'base', or a model directory (e.g. runs/merge/<name>/best)")
    student_merge: dict[str, Any] | None = Field(
        None, description="init the student from this weight-space merge of the teachers: "
        "{strategy, shared, per_model, seed} as in opd.weights.merge.Candidate")
    distill: DistillConfig = Field(default_factory=DistillConfig)
    verifier: Verifier = Field("capability", description=VERIFIER_HELP + "; the same setting as distill.verifier")
    teacher_servers: dict[str, str] = Field(default_factory=dict, description="teacher name -> SGLang server URL "
                                            "that serves it (GPU machines): it scores there, its weights are not loaded")
    out: str | None = Field(None, description="output directory (default runs/distill/<name>)")
    threads: int = Field(1, gt=0, description="torch CPU threads")
    device: DeviceName = Field("auto", description="torch device of the student and the in-process teachers: 'auto' "
                               "(the GPU when there is one, else the CPU), 'cpu', 'cuda' (under DeepSpeed each "
                               "rank's own GPU) or 'cuda:N'; not part of the run's identity")
    dtype: DtypeName = Field("auto", description="the student's and the in-process teachers' weights: 'float32', "
                             "'bfloat16' (the update then steps bf16 weights) or 'auto' (bfloat16 on a GPU that "
                             "computes in it, else float32); distill.inference_dtype may sample in another")
    deepspeed: DeepSpeedFragment = Field(
        None, description="DeepSpeed config fragment merged over ZeRO-2 defaults (e.g. {zero_optimization: {stage: 2}}; "
        "{} for the defaults): the updates run under a ZeRO engine; None = plain torch. Launch several ranks with "
        "`deepspeed --num_gpus N --no_local_rank --module opd.distill run.yaml`; prompts_per_step is per rank")


    _one_verifier = model_validator(mode="before")(one_verifier)

    @model_validator(mode="after")
    def _check(self):
        for i, t in enumerate(self.teachers):
            for task in (t.tasks or []) if isinstance(t, ExpertEntry) else []:
                try:
                    get_capability(task)
                except OpdError as e:
                    raise ValueError(f"teachers.{i}.tasks: {e}") from None
        if self.student_merge is not None and self.student != "base":
            raise ValueError("give student (a model directory) or student_merge, not both")
        d = self.distill
        if self.teacher_servers and d.warmstart_loss == "kl" and d.warmstart_steps > 0 and d.warmstart_topk is None:
            raise ValueError("warmstart_loss kl reads each teacher's full distribution, which teacher_servers do not "
                             "return: set distill.warmstart_topk: K (their top-K log-probs and a tail bucket), or "
                             "use warmstart_loss: nll")
        if self.teacher_servers and self.distill.estimator in ("full", "topk"):
            raise ValueError(f"the {self.distill.estimator} estimator reads teachers' hidden states in process; "
                             "teacher_servers return sampled-token and top-k log-probs: use estimator 'sampled' or "
                             "'teacher_topk'")
        if self.teacher_servers and self.student_merge is not None:
            raise ValueError("student_merge merges the teachers' weights, which teacher_servers leaves on the servers")
        return self

    @property
    def out_dir(self) -> Path:
        return Path(self.out or f"runs/distill/{self.name}")


def load_run(path: str | Path, overrides: list[str] = ()) -> DistillRun:
    """A run YAML (plus dotted `key=value` overrides) as a validated DistillRun; errors name the file."""
    return load_yaml_model(path, DistillRun, "distillation run file", list(overrides),
                           defaults={"name": Path(path).stem})
