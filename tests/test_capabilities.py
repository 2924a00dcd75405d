import random

import pytest

from opd.capabilities import SPLIT_BUCKETS, get_capability, list_capabilities
from opd.errors import OpdError

BUILTIN = [c for c in list_capabilities() if not c.startswith("rg:")]


def test_at_least_ten_builtin():
    assert len(BUILTIN) >= 10


@pytest.mark.parametrize("name", BUILTIN)
def test_generator_answers_verify(name):
    cap = get_capability(name)
    rng = random.Random(0)
    for _ in range(50):
        prompt, answer = cap.generate(rng, cap.default_difficulty)
        assert prompt.endswith("=") and len(prompt) <= 40
        assert cap.verify(answer, answer) == 1.0
        assert cap.verify(answer + "\ntrailing", answer) == 1.0  # only the first line counts
        assert cap.verify(answer + "x", answer) == 0.0
        assert len(answer) <= cap.max_new_tokens


@pytest.mark.parametrize("name", BUILTIN)
def test_seeded_and_split_respected(name):
    cap = get_capability(name)
    a = cap.items("val", 20, seed=3)
    assert a == cap.items("val", 20, seed=3)
    assert all(cap.split_of(it.prompt) == "val" for it in a)
    train = [cap.sample(random.Random(i), "train") for i in range(20)]
    assert all(cap.split_of(it.prompt) == "train" for it in train)


def test_buckets_partition():
    allb = sorted(b for r in SPLIT_BUCKETS.values() for b in r)
    assert allb == list(range(100))


def test_specific_answers():
    # hand-checked examples of each generator's answer rule
    assert get_capability("add").generate(random.Random(0), 2)[1] == str(
        sum(int(x) for x in get_capability("add").generate(random.Random(0), 2)[0][:-1].split("+")))
    p, a = get_capability("dedup").generate(random.Random(1), 6)
    body = p[2:-1]
    assert a == "".join(ch for i, ch in enumerate(body) if i == 0 or body[i - 1] != ch)


def test_unknown_capability_lists_names():
    with pytest.raises(OpdError, match="unknown capability 'nope'; known: add"):
        get_capability("nope")


def test_reasoning_gym_adapter():
    cap = get_capability("rg:basic_arithmetic")
    it = cap.sample(random.Random(0), "train")
    assert cap.verify(it.answer, it.answer) == 1.0
    assert cap.verify("<answer>definitely wrong</answer>", it.answer) == 0.0
