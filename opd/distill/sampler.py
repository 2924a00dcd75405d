"""Where each OPD step's batch comes from: the student samples its prompts, the routed teachers score.

`Sampler.next(step, mix, rng)` is the one call the loop makes. Synchronous, it samples and scores
step k's batch from the student as it is. With `sample_ahead`, a worker (opd.distill.ahead: a
thread, or a forked process) samples and scores step k+1's batch on a copy of the student (synced
when step k's batch is taken, so one update behind) while step k's update runs; on a CPU the two use
both cores. The prompt mix and the prompt RNG's state go with each call, and the RNG moves on only
when its batch is taken, so a checkpoint saves the RNG as it was before the batch in flight and a
resumed run draws the same prompts (its first batch then samples the checkpoint's student, not the
one before). The update then draws its minibatches from a per-step generator (`Drawn.generator`;
the worker lays out those minibatches on the packed layout, `OpdBatch.lay_out_ahead`),
and in a thread a retention check waits for the batch in flight (`settle`), as both would otherwise
share torch's global RNG with the sampling.

`inference_dtype` samples (and the stacked teachers score) in another dtype, from a copy of the
student synced before each batch.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass

import torch

from opd.distill.ahead import start_ahead
from opd.distill.batch import OpdBatch, build_batch, sample_batch
from opd.distill.config import DistillConfig
from opd.distill.precision import resolve_inference_dtype
from opd.distill.remote import remote_teachers
from opd.distill.routing import Routes
from opd.distill.teacher_bank import TeacherBank
from opd.distill.teachers import Teacher
from opd.rl.estimators import get_estimator
from opd.rollout import get_engine


@dataclass(frozen=True)
class Drawn:
    """One step's batch and where its seconds went."""

    batch: OpdBatch
    sample_s: float  # student sampling (ahead: the wait for the batch in flight; its own seconds overlapped)
    score_s: float  # teacher (and old-policy) scoring (ahead: 0)
    generator: torch.Generator | None  # the update's minibatch split (None: torch's global RNG)


def sampler_copy(student, dtype: torch.dtype):
    """A copy of the student whose parameters are in `dtype`; its buffers (RoPE's frequencies) keep their
    own dtype, so positions are not rounded."""
    # eval for good: it only samples and scores, so the engine never has to switch its mode (a walk over
    # every module per call, with transformers' kernel checks)
    sampler = copy.deepcopy(student).eval()
    for p in sampler.parameters():
        p.data = p.data.to(dtype)
    return sampler


class Sampler:
    """The student's rollouts scored by its teachers, synchronously or one step ahead (see the module).

    `teachers` is what the update reads: the ones given, or their Ray actors' clients
    (`teachers_on: ray`, opd.distill.remote). A context manager: leaving it ends the worker."""

    def __init__(self, cfg: DistillConfig, student, tokenizer, teachers: dict[str, Teacher], routes: Routes,
                 rank: int = 0, log=print):
        self.cfg, self.student, self.routes, self.rank = cfg, student, routes, rank
        self.pad_id = tokenizer.pad_token_id
        own = next(student.parameters()).dtype
        dtype = resolve_inference_dtype(cfg.inference_dtype, student)
        if cfg.inference_dtype == "auto":
            log(f"inference_dtype auto: sampling and teacher scoring in {str(dtype).removeprefix('torch.')} on this "
                "machine")
        cast = dtype != own
        # sample_ahead samples from a copy that a worker reads while the update runs
        self.model = sampler_copy(student, dtype) if cfg.sample_ahead or cast else student
        self.engine = get_engine("embedded", model=self.model, tokenizer=tokenizer, compact_every=cfg.compact_every,
                                 prefill=cfg.layout)
        routed = sorted({t for ts in routes.values() for t in ts})
        self.bank = None
        if cfg.teachers_on != "local":  # the same bank and engines, served by actors (opd.distill.remote)
            teachers, self.bank = remote_teachers(cfg, teachers, routed, tokenizer, dtype if cast else None)
        elif cfg.teacher_forward == "stacked" and all(teachers[n].model is not None for n in routed):
            self.bank = TeacherBank(teachers, routed, dtype if cast else None)
        self.teachers = teachers
        self._old_lp = get_estimator(cfg.estimator).reads_old_lp or cfg.reward_weight > 0
        self._worker = self._ahead = None  # sample_ahead's worker, and its batch in flight

    def next(self, step: int, mix: dict[str, float], rng: random.Random) -> Drawn:
        """Step `step`'s batch, its prompts drawn by `mix` from `rng` (moved on past them)."""
        if not self.cfg.sample_ahead:
            if self.model is not self.student:
                self.model.load_state_dict(self.student.state_dict())  # casts to the sampler's dtype
            return self._produce(step, mix, rng)
        if self._worker is None:  # a process samples what load_state_dict writes into the shared sampler
            self._worker = start_ahead(self.cfg.sample_worker, self._produce_ahead, torch.get_num_threads(),
                                       shared=self.model)
        t_wait = time.perf_counter()
        if self._ahead is None:  # nothing in flight (first step, or resumed): sample the student as it is now,
            # not as it was when the copy was made (before a warm start or a checkpoint's weights)
            self.model.load_state_dict(self.student.state_dict())
            self._ahead = self._worker.submit(step, mix, rng.getstate())
        batch, rng_state = self._ahead.result()
        rng.setstate(rng_state)
        self.model.load_state_dict(self.student.state_dict())  # the next batch samples the student as it is now
        self._ahead = None
        if step + 1 < self.cfg.steps:
            self._ahead = self._worker.submit(step + 1, mix, rng.getstate())
        return Drawn(batch, time.perf_counter() - t_wait, 0.0, self.split_generator(step))

    def split_generator(self, step: int) -> torch.Generator:
        """The random source of step `step`'s minibatch split (sampling ahead)."""
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 7_919 + self.rank)

    def settle(self) -> None:
        """Wait for a batch a thread is sampling (before anything else draws from torch's global RNG)."""
        if self._ahead is not None and self.cfg.sample_worker == "thread":
            self._ahead.result()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _produce(self, step: int, mix: dict[str, float], prompt_rng: random.Random) -> Drawn:
        """The rollout batch of `step`: the sampler samples, the teachers score."""
        cfg = self.cfg
        t_sample = time.perf_counter()
        items, groups = sample_batch(self.engine, self.routes, mix, prompt_rng, prompts=cfg.prompts_per_step,
                                     group=cfg.group_size, temperature=cfg.temperature,
                                     max_new_tokens=cfg.max_new_tokens,
                                     seed=cfg.seed * 100_003 + step + self.rank * 1_000_003)
        t_score = time.perf_counter()
        batch = build_batch(self.model, items, groups, self.teachers, self.routes, self.pad_id, cfg.kernel_chunk,
                            self.bank, old_lp=self._old_lp, layout=cfg.layout, rewards=cfg.verifier != "none")
        return Drawn(batch, t_score - t_sample, time.perf_counter() - t_score, None)

    def _produce_ahead(self, step: int, mix: dict[str, float], rng_state) -> tuple[OpdBatch, object]:
        """`_produce` from the prompt RNG state given (in the worker); returns the batch and the RNG state after it."""
        prompt_rng = random.Random()
        prompt_rng.setstate(rng_state)
        batch = self._produce(step, mix, prompt_rng).batch
        # the update's packed minibatch layouts too (the worker has the time: the update is the longer)
        batch.lay_out_ahead(self.cfg.updates_per_batch, self.split_generator(step))
        return batch, prompt_rng.getstate()
