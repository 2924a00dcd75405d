"""Model weights read tensor by tensor from safetensors, on access: memory that does not grow with
the number of models a merge takes.

`LazyStateDict(path)` is a read-only Mapping name -> tensor over a model directory's safetensors
(one file, or shards named by `model.safetensors.index.json`, found as mergekit's lazy loader finds
them: mergekit/io/lazy_tensor_loader.py, `ShardedTensorIndex.from_disk`). Indexing it reads that one
tensor from disk and casts it to `dtype` (float32 by default, as the search's in-memory models
were); nothing is kept, so a merge that visits one tensor name at a time holds one tensor per input.
Its names are the stored ones; `names=` orders and restricts them to the names
`opd.weights.merge.merge_keys` gives the loaded model's state dict (a tied `lm_head.weight` is not
stored, and is not a name of its own there either).

Each access opens the file and drops the handle after reading: safetensors maps the file into memory
(safetensors 0.8, `safe_open`), and a handle held for the life of the mapping would keep every page
read so far in the process's resident set.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import safetensors  # safetensors.safe_open through the module: tests count its reads by patching it
import torch
from mergekit import merge_methods as mm
from mergekit.io.lazy_tensor_loader import ShardedTensorIndex
from mergekit.merge_methods import PerGroupValues, merge_state_dicts
from mergekit.merge_methods.base import ParameterScope


class LazyStateDict(Mapping):
    """A model directory's tensors, each read from its safetensors file when indexed (`reads` counts)."""

    def __init__(self, path: str | Path, names: Sequence[str] | None = None, dtype: torch.dtype | None = torch.float32):

        self.path = Path(path)
        index = ShardedTensorIndex.from_disk(str(self.path))
        if not index.is_safetensors:
            raise ValueError(f"{self.path}: weights are not safetensors; a lazy state dict reads safetensors only")
        self._files = {k: os.path.join(index.base_path, f) for k, f in index.tensor_paths.items()}
        missing = [n for n in names or () if n not in self._files]
        if missing:
            raise KeyError(f"{self.path}: no stored tensor {missing[:3]}")
        self._names = list(names) if names is not None else list(self._files)
        self._set = frozenset(self._names)
        self.dtype = dtype
        self.reads = 0
        self._headers: dict | None = None

    def __getitem__(self, name: str) -> torch.Tensor:

        if name not in self._set:
            raise KeyError(name)
        self.reads += 1
        with safetensors.safe_open(self._files[name], framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        return t if self.dtype is None or not t.is_floating_point() else t.to(self.dtype)

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tensors `names` (in that order), each file opened once for all of them: opening a shard
        parses its header, most of the time a small tensor's read takes alone (0.8 ms against 0.1 ms a
        tensor on a 64 MiB shard of 233 tensors). The handle is dropped once they are read."""

        by_file: dict[str, list[str]] = {}
        for name in names:
            if name not in self._set:
                raise KeyError(name)
            by_file.setdefault(self._files[name], []).append(name)
        out = {}
        for file, group in by_file.items():
            with safetensors.safe_open(file, framework="pt", device="cpu") as f:
                for name in group:
                    self.reads += 1
                    t = f.get_tensor(name)
                    out[name] = t if self.dtype is None or not t.is_floating_point() else t.to(self.dtype)
        return {name: out[name] for name in names}

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._set

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of tensor `name` (along its first axis), read without reading the rest."""

        if name not in self._set:
            raise KeyError(name)
        self.reads += 1
        with safetensors.safe_open(self._files[name], framework="pt", device="cpu") as f:
            t = f.get_slice(name)[lo:hi]
        return t if self.dtype is None or not t.is_floating_point() else t.to(self.dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name` (from the header; the tensor is not read)."""
        return self._header(name)[0]

    def _header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) of a stored tensor, from its file's header (read once)."""

        if self._headers is None:
            self._headers = {}
            for file in dict.fromkeys(self._files[n] for n in self._names):
                with safetensors.safe_open(file, framework="pt", device="cpu") as f:
                    for n in f.keys():
                        sl = f.get_slice(n)
                        self._headers[n] = (tuple(sl.get_shape()), sl.get_dtype())
        return self._headers[name]

    def numel(self, name: str) -> int:
        """Elements of tensor `name` (from the header; the tensor is not read)."""
        return math.prod(self._header(name)[0])

    def nbytes(self) -> int:
        """Bytes the tensors take once read, floating ones in `dtype` (from the headers; nothing is read)."""
        total = 0
        for n in self._names:
            dt = _DTYPES[self._header(n)[1]]
            if self.dtype is not None and dt.is_floating_point:
                dt = self.dtype
            total += self.numel(n) * dt.itemsize
        return total


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def read_tensors(sd: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """`{name: sd[name]}` for `names`; a lazy state dict opens each of its files once for them."""
    return sd.read(names) if isinstance(sd, LazyStateDict) else {name: sd[name] for name in names}


def state_dict_bytes(sd: Mapping[str, torch.Tensor]) -> int:
    """Bytes a state dict's tensors take (a lazy one's from its headers, without reading them)."""
    if isinstance(sd, LazyStateDict):
        return sd.nbytes()
    return sum(t.numel() * t.element_size() for t in sd.values())


@torch.no_grad()
def load_into(model: torch.nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy `sd`'s tensors into `model`'s parameters and buffers of the same names, one at a time.

    `Module.load_state_dict(strict=False)` does the same but first copies the whole mapping into an
    OrderedDict (torch/nn/modules/module.py), which for a lazy state dict reads every tensor at once.
    A name the model lacks is skipped, as strict=False skips it; a tied head follows the embedding."""
    own = model.state_dict()
    for name in sd:
        if name in own:
            own[name].copy_(sd[name])


# A tensor too large for a run of mergekit's `merge_state_dicts` (its copies over all N inputs exceed the
# run's bytes) is merged here reading one input, or one block of rows of every input, at a time: what
# is held is a few copies of that one tensor (or of a block whose rows shrink as N grows), never N.
# Run bytes per input byte a method's mergekit function holds besides its inputs, about: TIES keeps
# its deltas, their masked copies, the sign mask and its product (mergekit/merge_methods/
# generalized_task_arithmetic.py, `merge_group`); the subspace methods their task matrices, the
# stack summed and SVD factors; RegMean float64 copies of the weights and Grams. A run of such a
# method is given this fraction of the merge's bytes, so that inputs and temporaries stay within them.
# RegMean's runs also hold each expert's Gram (in, in) in float64, which a run's input bytes do not
# count (a down_proj's is 3x its weight's bytes): its runs are small enough that every block matrix
# streams, one expert's weight and Gram at a time (with 4, the 0.1B bench peaked at 2.31x, 2.11x, 2.58x
# one model at N = 4, 10, 20).
TEMPORARIES = {"ties": 5, "tsv_m": 3, "iso_c": 3, "iso_cts": 3, "regmean": 64, "wudi": 3}
# Methods whose merged element depends only on the inputs' same element (and scalars).
ELEMENTWISE = {"linear", "task_arithmetic"}
SUBSPACE = {"tsv_m", "iso_c", "iso_cts"}


class TensorInputs:
    """One tensor name over a merge's inputs (input id -> state dict, lazy or in memory), read one
    input, or one block of rows, at a time (float32 from a lazy state dict, as stored from a dict)."""

    def __init__(self, models: Mapping, ids: Sequence, name: str, base=None):
        self.models, self.ids, self.name, self.base = models, list(ids), name, base
        first = models[self.ids[0]]
        self.shape = first.shape(name) if isinstance(first, LazyStateDict) else tuple(first[name].shape)

    @property
    def experts(self) -> list:
        return [i for i in self.ids if i != self.base]

    def read(self, i) -> torch.Tensor:
        return self.models[i][self.name]

    def rows(self, i, lo: int, hi: int) -> torch.Tensor:
        sd = self.models[i]
        return sd.rows(self.name, lo, hi) if isinstance(sd, LazyStateDict) else sd[self.name][lo:hi]

    def row_step(self, budget: int, copies: int) -> int:
        """Rows per block so that `copies` float64 copies of a block stay within `budget` bytes."""
        row_bytes = 8 * max(1, math.prod(self.shape[1:]))
        return max(1, budget // (row_bytes * max(1, copies)))


def merge_streamed(models: Mapping, ids: Sequence, name: str, method: str, params: dict, base,
                   budget: int) -> torch.Tensor | None:
    """Tensor `name` merged by `method` reading one input (or one block of rows) at a time, with
    about `budget` bytes of blocks at once; None where `method` has no such path for this tensor (the
    caller then hands the whole tensor group to mergekit). Mergekit's method on the whole tensor
    (tests/test_lazy_streamed.py): the same operations, so the same numbers up to the order torch adds
    a block's N inputs in, which it picks by the block's shape (1 ulp seen), and for TIES the choice
    among magnitudes tied at a task vector's cut."""
    from opd.weights import (  # lazy: cycle: opd.weights.regmean reads stored tensors through this module
        regmean,
        subspace,
    )

    inp = TensorInputs(models, ids, name, base)
    if not inp.shape:  # a scalar has no rows
        return None
    if method in ELEMENTWISE:
        return merge_rows(inp, method, params, budget)
    if method == "ties":
        return ties(inp, params, budget)
    if method in SUBSPACE:
        if len(inp.shape) == 2 and not subspace.is_vocabulary(name):
            return subspace.merge_streamed(inp, method, _values(method, params, inp.experts))
        return merge_rows(inp, method, params, budget)
    if method == "wudi" and (len(inp.shape) != 2 or subspace.is_vocabulary(name)):
        return merge_rows(inp, method, params, budget)  # its task mean, elementwise
    if method == "regmean":
        return regmean.merge_streamed(inp, _values(method, params, inp.ids), budget)
    return None


def _values(method: str, params: dict, ids: Sequence) -> dict:
    """A run of one tensor's parameters as plain values: shared ones as scalars, per-input ones as
    {id: value}; mergekit's declared defaults where a parameter is not given."""

    out = {}
    for spec in mm.get(method).spec.parameters:
        v = params.get(spec.name, spec.default)
        if isinstance(v, PerGroupValues):
            (v,) = v.values
        if spec.scope != ParameterScope.SHARED:
            v = {i: (v[i] if isinstance(v, Mapping) else v) for i in ids}
        out[spec.name] = v
    return out


def merge_rows(inp: TensorInputs, method: str, params: dict, budget: int) -> torch.Tensor:
    """Tensor `inp.name` merged by mergekit's `method` a block of rows at a time (each block within
    `budget` bytes over all inputs and their copies), for a method whose merged element depends only
    on the inputs' same element: the same numbers as whole."""

    step = inp.row_step(budget, len(inp.ids) * TEMPORARIES.get(method, 2))
    out = None  # filled block by block: a concatenation would hold the tensor twice
    for lo in range(0, inp.shape[0], step):
        chunk = {i: {inp.name: inp.rows(i, lo, lo + step)} for i in inp.ids}
        block = merge_state_dicts(chunk, method, parameters=params, base=inp.base)[inp.name]
        out = _fill(out, inp.shape, lo, block)
        del chunk, block
    return out


def _fill(out: torch.Tensor | None, shape: tuple, lo: int, block: torch.Tensor) -> torch.Tensor:
    """`block` written into rows lo: of `out` (allocated with the block's dtype at the first block)."""
    if out is None:
        out = torch.empty(shape, dtype=block.dtype)
    out[lo:lo + block.shape[0]] = block
    return out


class _Trim:
    """Which elements of one task vector mergekit's magnitude sparsification keeps, as a cut: every
    |δ| > t, and the first `ties` elements (in row-major order) with |δ| == t; `scale` is its L1 rescale
    (None: none)."""

    def __init__(self, t: float, ties: int, scale: torch.Tensor | None):
        self.t, self.ties, self.scale, self.seen = t, ties, scale, 0

    def apply(self, delta: torch.Tensor) -> torch.Tensor:
        """`delta` (the next block of rows, in order) masked as the whole tensor is."""
        w = delta.abs().float()
        tied = w == self.t
        n_tied = int(tied.sum())
        if n_tied and self.seen + n_tied > self.ties:  # only the first `ties` tied elements are kept
            order = tied.reshape(-1).cumsum(0).reshape(tied.shape) + self.seen
            tied &= order <= self.ties
        self.seen += n_tied
        mask = ((w > self.t) | tied).to(delta.dtype)
        masked = delta * mask
        return masked if self.scale is None else masked * self.scale


def _trim(inp: TensorInputs, expert, density: float, rescale: bool, step: int, budget: int = 0) -> _Trim | None:
    """The cut mergekit's `sparsify.magnitude` makes in expert `expert`'s whole task vector δ = expert −
    base (mergekit/sparsify.py: the k = max(1, int(density · numel)) largest |δ| by
    `argsort(descending=True)[:k]`, then `rescaled_masked_tensor`, L1 when `rescale`). None: density
    >= 1 keeps everything.

    The k-th largest magnitude t is found exactly without holding δ: non-negative float32 values order
    as their bit patterns read as integers, so two passes over blocks of `step` rows count the
    patterns' high 16 bits, then the low 16 bits within the high half that holds the k-th (two
    histograms of 2^15 and 2^16 counts); where one expert's whole tensor, read with the base's, fits
    `budget` bytes, it is read once and t is its `torch.kthvalue`. Where several elements tie at t, argsort keeps some of them
    in an order it does not promise; here the first ones in row-major order (what a stable argsort
    keeps). Zero magnitudes at the cut change nothing: a zero delta adds nothing, and TIES's sign vote
    never counts a zero. The L1 rescale's two sums are added block by block (mergekit sums the whole
    tensor at once: the same up to float rounding)."""
    n = math.prod(inp.shape)
    if density >= 1:
        return None
    if density <= 0 or n == 0:
        return _Trim(float("inf"), 0, None)
    k = max(1, int(density * n))

    def bits():  # |δ| of each block as float32 bit patterns (int32, flat), in row order
        for lo in range(0, inp.shape[0], step):
            d = inp.rows(expert, lo, lo + step) - inp.rows(inp.base, lo, lo + step)
            yield d.abs().float().reshape(-1).view(torch.int32)

    if 4 * 4 * n <= budget:  # expert, base, δ and |δ| whole: one read, a selection
        w = (inp.read(expert) - inp.read(inp.base)).abs().float().reshape(-1)
        t = float(torch.kthvalue(w, n - k + 1).values)
        greater = int((w > t).sum())
        del w
    else:
        t, greater = _kth_by_histograms(bits, k)
    trim = _Trim(t, k - greater, None)
    if rescale:  # mergekit's L1 rescale: Σ|δ| and Σ|δ ⊙ mask| over the whole tensor
        before = after = 0.0
        for b in bits():
            w = b.view(torch.float32)
            before += w.sum()
            after += trim.apply(w).sum()
        trim.seen = 0
        eps = 1e-7  # rescaled_masked_tensor's default
        trim.scale = None if before < eps or after < eps else before / after
    return trim


def _kth_by_histograms(bits, k: int) -> tuple[float, int]:
    """(t, the count of elements > t): t the k-th largest of the magnitudes whose float32 bit patterns
    `bits()` yields block by block, found by two passes over them."""
    high = torch.zeros(1 << 15, dtype=torch.int64)  # a magnitude's sign bit is 0: its pattern >> 16 < 2^15
    for b in bits():
        high += torch.bincount(b >> 16, minlength=1 << 15)
    at_least = high.flip(0).cumsum(0).flip(0)  # at_least[h]: elements whose high bits are >= h
    h = int((at_least >= k).nonzero().max())
    above = int(at_least[h] - high[h])  # elements in higher bins: all > t
    low = torch.zeros(1 << 16, dtype=torch.int64)
    for b in bits():
        low += torch.bincount(b[(b >> 16) == h] & 0xFFFF, minlength=1 << 16)
    at_least = low.flip(0).cumsum(0).flip(0)
    lo_bits = int((at_least >= k - above).nonzero().max())
    greater = above + int(at_least[lo_bits] - low[lo_bits])
    return torch.tensor([(h << 16) | lo_bits], dtype=torch.int32).view(torch.float32).item(), greater


def ties(inp: TensorInputs, params: dict, budget: int) -> torch.Tensor:
    """mergekit's TIES on one tensor with its inputs read one at a time: first each task vector's
    magnitude cut (`_trim`: over the whole tensor, one expert at a time, holding its |δ| as float32),
    then blocks of rows: each expert's block trimmed by its cut, and mergekit's own TIES (sign
    election, disjoint mean, weights, normalize, lambda) on the trimmed deltas with density 1 against
    a zero base, added to the base. mergekit computes base + its mixed delta the same way, so this is
    its result element for element (tests/test_lazy_streamed.py)."""

    v = _values("ties", params, inp.experts)
    step = inp.row_step(budget, len(inp.ids) * TEMPORARIES["ties"])
    trims = {i: _trim(inp, i, v["density"][i], v["rescale"], step, budget) for i in inp.experts}
    block_params = {**v, "density": {i: 1.0 for i in inp.experts}, "rescale": False}
    out = None
    for lo in range(0, inp.shape[0], step):
        b = inp.rows(inp.base, lo, lo + step)
        chunk = {inp.base: {inp.name: torch.zeros_like(b)}}
        for i in inp.experts:
            d = inp.rows(i, lo, lo + step) - b
            chunk[i] = {inp.name: d if trims[i] is None else trims[i].apply(d)}
        merged = merge_state_dicts(chunk, "ties", parameters=block_params, base=inp.base)[inp.name]
        out = _fill(out, inp.shape, lo, (b + merged).to(b.dtype))
        del chunk, merged
    return out
