"""Resumable checkpoints of the training loops (GSPO in opd.expert, OPD in opd.distill), one way.

A checkpoint holds the model, the optimizer, the loop's state, both RNG states, the run's identity
(what must match for a rerun to continue it) and its ranks (`Ranks.record`: a ZeRO optimizer's state
is this rank's partition, so only the same kind and number of ranks resume it). Each rank writes its
own file (`rank_path`) atomically and keeps the previous version beside it (`opd.io.atomic_torch_save`
with keep_previous): a torn file falls back to the previous one, and ranks killed between their saves
are still one common step apart. Resuming picks this rank's newest readable checkpoint of the same
identity and ranks; with several ranks, the newest step that every rank holds (a collective).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opd.io import atomic_torch_save, readable_checkpoints
from opd.rl.distributed import common_step, init_distributed, rank_path, zero_checkpoint_globals


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in a data-parallel run (one plain rank unless under DeepSpeed)."""

    rank: int = 0
    world: int = 1
    deepspeed: bool = False

    @classmethod
    def join(cls, deepspeed: bool) -> Ranks:
        """This process's ranks: under DeepSpeed it joins the process group first (`init_distributed`,
        which reads the launcher's RANK and WORLD_SIZE; one process alone is a world of one)."""
        if not deepspeed:
            return cls()
        rank, world = init_distributed()
        return cls(rank, world, True)

    @property
    def record(self) -> dict:
        """What a checkpoint records of the ranks that wrote it."""
        return {"deepspeed": self.deepspeed, "world_size": self.world}


PLAIN = Ranks().record


@dataclass(frozen=True)
class Checkpointer:
    """One loop's checkpoint: `path` is rank 0's file (None: the run keeps none).

    identity: the run's identity, stored under `field` (the name older checkpoints carry it under:
    "config" for OPD, "spec" for GSPO); `resumes(recorded)` says whether a checkpoint's recorded
    identity may be continued (default: equal). `legacy_ranks`: the ranks assumed for a checkpoint
    written before they were recorded (None: any)."""

    path: Path | None
    ranks: Ranks
    identity: Any
    field: str
    resumes: Callable[[Any], bool] | None = None
    legacy_ranks: dict | None = None
    log: Callable[[str], None] = print

    @property
    def file(self) -> Path | None:
        """This rank's file."""
        return rank_path(Path(self.path), self.ranks.rank) if self.path else None

    def save(self, model, opt, state: dict, rng: random.Random) -> None:
        if self.path is None:
            return
        atomic_torch_save({self.field: self.identity, "ranks": self.ranks.record, "model": model.state_dict(),
                           "optim": opt.state_dict(), "state": state, "rng": rng.getstate(),
                           "torch_rng": torch.get_rng_state()}, self.file, keep_previous=True)

    def _ours(self, ck: dict) -> bool:
        recorded = ck.get(self.field)
        same = self.resumes(recorded) if self.resumes is not None else recorded == self.identity
        ranks = ck.get("ranks", self.legacy_ranks)
        return same and (ranks is None or ranks == self.ranks.record)

    def latest(self) -> dict | None:
        """The checkpoint to resume from, or None (collective with several ranks: every rank calls it)."""
        if self.path is None:
            return None
        # a ZeRO optimizer's state holds a few DeepSpeed classes
        found: dict[int, dict] = {}
        for ck in readable_checkpoints(self.file, self.log, zero_checkpoint_globals() if self.ranks.deepspeed
                                       else None):
            if self._ours(ck):
                found.setdefault(ck["state"]["step"], ck)
        if self.ranks.world == 1:
            return found.get(max(found, default=None))
        step = common_step(list(found))
        return found[step] if step is not None else None

    def restore(self, model, rng: random.Random) -> tuple[dict, dict] | None:
        """Model and RNG states back in place from `latest()`; returns the loop's state and the optimizer
        state, which goes into the final optimizer (a ZeRO optimizer exists only after `wrap`); None if
        there is nothing to resume."""
        ck = self.latest()
        if ck is None:
            return None
        model.load_state_dict(ck["model"])
        rng.setstate(ck["rng"])
        torch.set_rng_state(ck["torch_rng"])
        return ck["state"], ck["optim"]
