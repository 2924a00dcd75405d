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

import torch


class LazyStateDict(Mapping):
    """A model directory's tensors, each read from its safetensors file when indexed (`reads` counts)."""

    def __init__(self, path: str | Path, names: Sequence[str] | None = None, dtype: torch.dtype | None = torch.float32):
        from mergekit.io.lazy_tensor_loader import ShardedTensorIndex

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
        from safetensors import safe_open

        if name not in self._set:
            raise KeyError(name)
        self.reads += 1
        with safe_open(self._files[name], framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        return t if self.dtype is None or not t.is_floating_point() else t.to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of tensor `name` (along its first axis), read without reading the rest."""
        from safetensors import safe_open

        if name not in self._set:
            raise KeyError(name)
        self.reads += 1
        with safe_open(self._files[name], framework="pt", device="cpu") as f:
            t = f.get_slice(name)[lo:hi]
        return t if self.dtype is None or not t.is_floating_point() else t.to(self.dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name` (from the header; the tensor is not read)."""
        return self._header(name)[0]

    def _header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) of a stored tensor, from its file's header (read once)."""
        from safetensors import safe_open

        if self._headers is None:
            self._headers = {}
            for file in dict.fromkeys(self._files[n] for n in self._names):
                with safe_open(file, framework="pt", device="cpu") as f:
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
