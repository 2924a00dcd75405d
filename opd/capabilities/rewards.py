"""Reward functions: `(completion, answer, capability) -> float in [0, 1]`, registered by name.

Evaluation always uses the capability's own verifier; a training reward may add partial credit
so that small models get signal before they are ever fully right.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from collections.abc import Callable

from opd.capabilities.base import Capability
from opd.errors import OpdError

Reward = Callable[[str, str, Capability], float]


def verifier(completion: str, answer: str, cap: Capability) -> float:
    """The capability's verifier: what lm-eval scores."""
    return cap.verify(completion, answer)


def partial(completion: str, answer: str, cap: Capability) -> float:
    """1.0 when verified; otherwise up to 0.5 for characters right in the right place
    (a wrong length costs: positions are counted over the longer string)."""
    if cap.verify(completion, answer) == 1.0:
        return 1.0
    got = completion.split("\n", 1)[0].strip()
    same = sum(a == b for a, b in zip(got, answer))
    return 0.5 * same / max(len(got), len(answer), 1)


REWARDS: dict[str, Reward] = {"verifier": verifier, "partial": partial}


def get_reward(name: str) -> Reward:
    try:
        return REWARDS[name]
    except KeyError:
        raise OpdError(f"unknown reward {name!r}; choose one of: {', '.join(sorted(REWARDS))}") from None


BUILTIN = frozenset({verifier, partial})  # trusted and fast: they run in process


def _as_score(value) -> float | None:
    """A reward's return value as a score in [0, 1], or None when it is not a number (None, a
    string, NaN): such a call scores 0 and is counted as an error."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None
    return min(1.0, max(0.0, float(value)))


class GuardedReward:
    """Call a reward so that it cannot take a training run down: a reward that raises (anything,
    BaseException included), returns something other than a number, or runs past `timeout_s`
    scores 0 and is counted in `errors` / `timeouts` (logged with the step's statistics).

    Built-in rewards run in process. A user-registered reward runs in a worker process that is
    killed at the deadline, so a reward stuck in C code (a regex backtracking), swallowing
    exceptions or called off the main thread is still stopped.
    """

    def __init__(self, reward: Reward, timeout_s: float):
        self.reward, self.timeout_s = reward, timeout_s
        self.errors = self.timeouts = 0
        self._pool = None

    def __call__(self, completion: str, answer: str, cap: Capability) -> float:
        if self.reward in BUILTIN:
            try:
                score = _as_score(self.reward(completion, answer, cap))
            except Exception:
                score = None
        else:
            score = self._isolated(completion, answer, cap)
        if score is None:
            self.errors += 1
            return 0.0
        return score

    def _isolated(self, completion: str, answer: str, cap: Capability) -> float | None:
        if self._pool is None:
            # spawn, not fork: a forked copy of a training process (torch threads, locks) can hang
            self._pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
            self._pool.submit(int).result()  # started and ready: the deadline below times the reward only
        future = self._pool.submit(_call, self.reward, completion, answer, cap)
        try:
            return _as_score(future.result(timeout=self.timeout_s or None))
        except cf.TimeoutError:
            self.timeouts += 1
            self.close()  # the worker is stuck: kill it; the next call starts a fresh one
            return 0.0
        except BaseException as e:  # the reward raised, or its worker died (BrokenProcessPool)
            if isinstance(e, KeyboardInterrupt):
                raise
            if isinstance(e, cf.process.BrokenProcessPool):
                self.close()
            return None

    def close(self) -> None:
        """Kill the reward's worker process, if it has one."""
        pool, self._pool = self._pool, None
        if pool is not None:
            for proc in list((pool._processes or {}).values()):
                proc.kill()
            pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _call(reward: Reward, completion: str, answer: str, cap: Capability):
    """Run in the worker process: a BaseException the reward raises comes back as an error, not a
    dead worker."""
    try:
        return reward(completion, answer, cap)
    except BaseException as e:
        raise RuntimeError(f"reward raised {type(e).__name__}") from None
