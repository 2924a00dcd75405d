"""Reward functions: `(completion, answer, capability) -> float in [0, 1]`, registered by name.

Evaluation always uses the capability's own verifier; a training reward may add partial credit
so that small models get signal before they are ever fully right.
"""

from __future__ import annotations

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


class RewardTimeout(Exception):
    pass


class GuardedReward:
    """Call a reward with a time limit; a reward that raises or hangs scores 0 and is counted.

    A user's reward function must not take a training run down: exceptions and timeouts become
    reward 0, and `errors` / `timeouts` are logged with the step's statistics. The limit uses
    SIGALRM, so it applies in the main thread (elsewhere the call runs unguarded by time).
    """

    def __init__(self, reward: Reward, timeout_s: float):
        self.reward, self.timeout_s = reward, timeout_s
        self.errors = self.timeouts = 0

    def __call__(self, completion: str, answer: str, cap: Capability) -> float:
        import signal
        import threading

        timed = self.timeout_s > 0 and threading.current_thread() is threading.main_thread()
        if timed:
            def _raise(signum, frame):
                raise RewardTimeout

            previous = signal.signal(signal.SIGALRM, _raise)
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            value = float(self.reward(completion, answer, cap))
            return min(1.0, max(0.0, value)) if value == value else 0.0  # NaN scores 0
        except RewardTimeout:
            self.timeouts += 1
            return 0.0
        except Exception:
            self.errors += 1
            return 0.0
        finally:
            if timed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
