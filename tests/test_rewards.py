import pytest

from opd.capabilities import get_capability
from opd.capabilities.rewards import get_reward
from opd.errors import OpdError


def test_partial_credit_hand_values():
    cap = get_capability("sort")
    partial = get_reward("partial")
    assert partial("01127\n", "01127", cap) == 1.0
    # 4 of 5 characters in place -> 0.5 * 4/5
    assert partial("01128", "01127", cap) == pytest.approx(0.4)
    # too long: positions counted over the longer string: 5 right of 6 -> 0.5 * 5/6
    assert partial("011279", "01127", cap) == pytest.approx(0.5 * 5 / 6)
    assert partial("", "01127", cap) == 0.0
    assert get_reward("verifier")("01128", "01127", cap) == 0.0


def test_unknown_reward():
    with pytest.raises(OpdError, match="choose one of: partial, verifier"):
        get_reward("nope")


class Escape(BaseException):
    """Not an Exception: a reward's own `except Exception` would not stop it either."""


def user_reward(completion, answer, cap):
    """A user-registered reward (module level, so its worker process can import it) with every fault."""
    import re
    import time

    if completion == "boom":
        raise ValueError("user reward bug")
    if completion == "escape":
        raise Escape
    if completion == "hang":
        try:
            time.sleep(30)
        except Exception:  # swallows whatever a signal-based guard would raise
            pass
    if completion == "spin":  # catastrophic backtracking: minutes inside C code
        re.match(r"(a+)+$", "a" * 40 + "b")
    return {"big": 2.0, "nan": float("nan"), "none": None, "str": "0.5"}.get(completion, float(completion == answer))


def test_guarded_reward_counts_errors_and_timeouts():
    import time

    from opd.capabilities.rewards import GuardedReward

    cap = get_capability("sort")
    g = GuardedReward(user_reward, timeout_s=1.0)
    cases = ["01127", "boom", "escape", "hang", "spin", "big", "nan", "none", "str", "x", "01127"]
    t0 = time.time()
    got = [g(c, "01127", cap) for c in cases]
    assert got == [1.0, 0, 0, 0, 0, 1.0, 0, 0, 0, 0, 1.0]  # training goes on after each fault
    assert (g.errors, g.timeouts) == (5, 2)  # boom, escape, nan, none, str; hang and spin were killed
    assert time.time() - t0 < 30
    g.close()


def test_builtin_rewards_run_in_process():
    from opd.capabilities.rewards import GuardedReward, get_reward

    g = GuardedReward(get_reward("verifier"), timeout_s=1.0)
    assert g("01127", "01127", get_capability("sort")) == 1.0 and g._pool is None
