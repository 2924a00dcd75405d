"""Held-out evaluation data never overlaps training data (checked by hashing)."""

import hashlib
import random

import pytest

from opd.capabilities import get_capability, list_capabilities
from opd.evaluation.heldout import heldout_items
from opd.lab.data import MixtureStream

BUILTIN = [c for c in list_capabilities() if not c.startswith("rg:")]


def _h(cap, prompt):
    return hashlib.sha256(f"{cap}|{prompt}".encode()).hexdigest()


@pytest.mark.parametrize("name", BUILTIN)
def test_no_overlap_between_train_val_test(name):
    val = {_h(name, d["prompt"]) for d in heldout_items(name, "val")}
    test = {_h(name, d["prompt"]) for d in heldout_items(name, "test")}
    assert val and test and not (val & test)
    # training draws, from several seeds as the base, experts and GSPO would use them
    stream = MixtureStream({name: 1.0}, seed=123)
    train = {_h(name, it.prompt) for it in stream.next_batch(3000)}
    cap = get_capability(name)
    train |= {_h(name, cap.sample(random.Random(s), "train").prompt) for s in range(500)}
    assert not (train & val) and not (train & test)


def test_heldout_sizes_and_determinism():
    a = heldout_items("rev", "test")
    assert len(a) == 300 and a == heldout_items("rev", "test")
    assert len(heldout_items("rev", "val")) == 200
