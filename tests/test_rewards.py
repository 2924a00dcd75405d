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
