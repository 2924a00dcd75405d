"""mergekit's magnitude sparsification with each task vector's sorted magnitudes kept between merges.

A search merges the same experts again and again at different densities. mergekit's
`sparsify.magnitude` (TIES, DARE-free magnitude pruning) argsorts |delta| for every candidate; on the
lab's 1.6M-parameter experts that sort is most of a TIES merge. The order of |delta| does not depend
on the candidate, so inside `cached_magnitude()` each delta's magnitudes are sorted once (keyed by a
hash of its bytes) and a merge keeps `|delta| >= t`, t the k-th largest magnitude. That is the set
mergekit's `argsort(...)[:k]` keeps whenever the k-th and (k+1)-th largest magnitudes differ; on a
tie there (or a NaN, a non-CPU tensor, a tensor over the cache's size) mergekit's own function
runs. The mask is then mergekit's, element for element, and so is the rest (its
`rescaled_masked_tensor`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

DEFAULT_BYTES = 1 << 30  # sorted magnitudes kept per process, least recently used dropped first


class SortedMagnitudes:
    """Each delta's magnitudes sorted in descending order (float32), least recently used evicted."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._sorted: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def cacheable(self, w: torch.Tensor) -> bool:
        return w.device.type == "cpu" and w.numel() * 4 <= self.max_bytes

    def get(self, w: torch.Tensor) -> torch.Tensor:
        """The sorted magnitudes of flat float32 `w` (CPU, contiguous, no NaN, no negative values)."""
        key = (tuple(w.shape), hashlib.blake2b(memoryview(w.numpy()), digest_size=16).digest())
        if key in self._sorted:
            self.hits += 1
            self._sorted.move_to_end(key)
            return self._sorted[key]
        self.misses += 1
        # Non-negative IEEE-754 floats order as their bit patterns read as integers (+0.0 is 0; `w` is
        # |delta| with NaN refused by the caller), and torch's CPU sort of int32 in ascending order is
        # far faster than of float32 (4.5x on lab10's 184 task vectors, bench/bench_sort_cache.py) or
        # of int32 descending. Flipped, it is the same values in the same order.
        s = torch.sort(w.view(torch.int32)).values.view(torch.float32).flip(0)
        self._sorted[key] = s
        self.bytes += s.numel() * 4
        while self.bytes > self.max_bytes:
            _, old = self._sorted.popitem(last=False)
            self.bytes -= old.numel() * 4
        return s


CACHE = SortedMagnitudes()


def magnitude(tensor: torch.Tensor, density: float, rescale_norm=None, *, original: Callable,
              cache: SortedMagnitudes):
    """`mergekit.sparsify.magnitude` with the sort taken from `cache` (same result)."""
    from mergekit.sparsify import rescaled_masked_tensor  # lazy: mergekit is slow to import

    n = tensor.numel()
    if density >= 1 or density <= 0 or n == 0 or not cache.cacheable(tensor):
        return original(tensor, density, rescale_norm)
    k = max(1, int(density * n))
    w = tensor.detach().abs().reshape(-1).float().contiguous()  # as mergekit: float magnitudes
    if torch.isnan(w).any():
        return original(tensor, density, rescale_norm)
    s = cache.get(w)
    t = s[k - 1]
    if k < n and s[k] == t:  # the k-th largest ties the next: which of them argsort keeps is its own
        return original(tensor, density, rescale_norm)
    mask = (w >= t).to(tensor.dtype).reshape_as(tensor)  # exactly the k largest
    return rescaled_masked_tensor(tensor, mask, rescale_norm)


@contextlib.contextmanager
def cached_magnitude(cache: SortedMagnitudes = CACHE) -> Iterator[SortedMagnitudes]:
    """Within the block, mergekit's magnitude sparsification reads its sort from `cache`."""
    import mergekit.sparsify as sp  # lazy: mergekit is slow to import

    original = sp.magnitude

    def cached(tensor, density, rescale_norm=None):
        return magnitude(tensor, density, rescale_norm, original=original, cache=cache)

    sp.magnitude = cached
    try:
        yield cache
    finally:
        sp.magnitude = original
