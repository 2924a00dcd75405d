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


def test_guarded_reward_counts_errors_and_timeouts():
    import time

    from opd.capabilities.rewards import GuardedReward

    cap = get_capability("sort")

    def flaky(completion, answer, cap):
        if completion == "boom":
            raise ValueError("user reward bug")
        if completion == "hang":
            time.sleep(5)
        return 2.0 if completion == "big" else float(completion == answer)

    g = GuardedReward(flaky, timeout_s=0.2)
    t0 = time.time()
    assert [g(c, "01127", cap) for c in ("01127", "boom", "hang", "big", "x")] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert time.time() - t0 < 2  # the hang was cut at 0.2 s
    assert (g.errors, g.timeouts) == (1, 1)
