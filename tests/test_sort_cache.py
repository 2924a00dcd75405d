"""The sorted-magnitude cache in front of mergekit's magnitude sparsification: same tensors as
mergekit's own function, ties at the cut handed back to it, the cache reused and bounded."""

import mergekit.sparsify as sp
import pytest
import torch
from mergekit.merge_methods import merge_state_dicts
from mergekit.sparsify import RescaleNorm

from opd.weights.sort_cache import SortedMagnitudes, cached_magnitude


def _random(seed: int, shape=(37, 23)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("density", [0.0, 0.001, 0.1, 0.37, 0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("norm", [None, RescaleNorm.l1])
def test_same_tensor_as_mergekit(density, norm):
    t = _random(0)
    want = sp.magnitude(t, density, norm)
    with cached_magnitude(SortedMagnitudes()):
        got = sp.magnitude(t, density, norm)
        again = sp.magnitude(t, density, norm)
    assert torch.equal(got, want) and torch.equal(again, want)


def test_ties_at_the_cut_go_to_mergekit():
    # magnitudes 0..4 repeated: every cut but the ends falls inside a run of equal values
    t = (torch.arange(100) % 5).float().reshape(10, 10) * torch.where(torch.arange(100) % 2 == 0, 1.0, -1.0).reshape(10, 10)
    calls = []
    original = sp.magnitude

    def spy(tensor, density, rescale_norm=None):
        calls.append(density)
        return original(tensor, density, rescale_norm)

    sp.magnitude = spy
    try:
        cache = SortedMagnitudes()
        with cached_magnitude(cache):
            got_tie = sp.magnitude(t, 0.5)  # k = 50: the 50th and 51st largest are both 2
            got_clean = sp.magnitude(t, 0.4)  # k = 40: exactly the 4s and 3s
    finally:
        sp.magnitude = original
    assert calls == [0.5]  # only the tie went to mergekit
    assert torch.equal(got_tie, original(t, 0.5))
    assert torch.equal(got_clean, original(t, 0.4))
    assert int((got_clean != 0).sum()) == 40


def test_sorted_once_per_tensor_and_bounded():
    cache = SortedMagnitudes(max_bytes=2 * 37 * 23 * 4)  # room for two of these tensors
    a, b, c = _random(1), _random(2), _random(3)
    with cached_magnitude(cache):
        for d in (0.2, 0.5, 0.8):
            sp.magnitude(a, d)
        assert (cache.misses, cache.hits) == (1, 2)
        sp.magnitude(b, 0.3)
        sp.magnitude(c, 0.3)  # evicts a, the least recently used
        assert cache.bytes <= cache.max_bytes
        sp.magnitude(a, 0.3)
    assert (cache.misses, cache.hits) == (4, 2)


def test_restored_after_the_block_even_on_error():
    original = sp.magnitude
    with pytest.raises(RuntimeError), cached_magnitude(SortedMagnitudes()):
        assert sp.magnitude is not original
        raise RuntimeError("boom")
    assert sp.magnitude is original


def test_ties_merge_identical_with_and_without_cache():
    base = {"w": _random(10, (16, 8)), "n": torch.ones(8)}
    experts = {f"e{i}": {k: v + 0.1 * _random(20 + i, v.shape) for k, v in base.items()} for i in range(3)}
    models = {"base": base, **experts}
    params = {"density": {"e0": 0.3, "e1": 0.6, "e2": 0.9}, "weight": {"e0": 1.0, "e1": 0.7, "e2": 0.5}}
    want = merge_state_dicts(models, "ties", parameters=params, base="base")
    cache = SortedMagnitudes()
    with cached_magnitude(cache):
        got = merge_state_dicts(models, "ties", parameters=params, base="base")
        got2 = merge_state_dicts(models, "ties", parameters=params, base="base")
    assert cache.misses == 6 and cache.hits == 6  # 2 tensors x 3 experts, sorted once
    for k in want:
        assert torch.equal(got[k], want[k]) and torch.equal(got2[k], want[k])


def test_sorted_magnitudes_equal_a_float_sort():
    # the cache sorts the bit patterns as int32: the same order for every non-negative float, zeros,
    # subnormals, huge values and infinity included
    w = torch.cat([_random(5).abs().reshape(-1), torch.tensor([0.0, -0.0, 1e-45, 1e-40, 3e38, float("inf"), 1.0, 1.0])])
    w = w.abs().contiguous()
    got = SortedMagnitudes().get(w)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.sort(w, descending=True).values)
