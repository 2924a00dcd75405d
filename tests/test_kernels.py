"""Chunked log-prob and reverse-KL heads against the naive full-logits formulas (CPU), Triton on GPU."""

from __future__ import annotations

import math

import pytest
import torch
from opd_kernels import (
    reverse_kl,
    reverse_kl_from_logits,
    selective_log_softmax,
    selective_log_softmax_from_logits,
    triton_available,
)
from torch.utils._python_dispatch import TorchDispatchMode

N, H, V = 10, 8, 50


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any torch op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _inputs(seed=0, n=N, h=H, v=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    ids = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, ids


def _naive_selective(hidden, weight, ids):
    return torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, ids[:, None])[:, 0]


def test_selective_by_hand():
    # Logits (0, ln 3): softmax (1/4, 3/4), so the log-prob of token 1 is ln 0.75 and of token 0 ln 0.25.
    hidden = torch.ones(2, 1)
    weight = torch.tensor([[0.0], [math.log(3.0)]])
    out = selective_log_softmax(hidden, weight, torch.tensor([1, 0]), chunk_size=1)
    torch.testing.assert_close(out, torch.tensor([math.log(0.75), math.log(0.25)]))


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", [(3, None), (N, None), (4, 7), (1, V)])
def test_selective_matches_naive_values_and_grads(chunk_size, vocab_chunk_size):
    hidden, weight, ids = _inputs()
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(1))
    ref = _naive_selective(hidden, weight, ids)
    (ref * upstream).sum().backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    out = selective_log_softmax(hidden, weight, ids, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    (out * upstream).sum().backward()
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref_gw, atol=1e-5, rtol=1e-5)


def test_selective_grad_to_hidden_only():
    hidden, weight, ids = _inputs()
    weight = weight.detach()
    selective_log_softmax(hidden, weight, ids, chunk_size=4).sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_selective_never_builds_full_logits():
    hidden, weight, ids = _inputs(n=32, v=200)
    with LargestTensor() as probe:
        selective_log_softmax(hidden, weight, ids, chunk_size=4).sum().backward()
    # Largest pieces: a (4, 200) logits chunk and the (200, 8) weight gradient, never (32, 200).
    assert probe.numel <= max(4 * 200, 200 * 8) < 32 * 200
    with LargestTensor() as probe:
        selective_log_softmax(hidden, weight, ids, chunk_size=4, vocab_chunk_size=16).sum().backward()
    assert probe.numel <= 200 * 8  # now the weight itself (its gradient) is the largest tensor
    with LargestTensor() as probe:
        _naive_selective(hidden, weight, ids).sum().backward()
    assert probe.numel == 32 * 200


def test_selective_from_logits():
    logits = torch.randn(2, 3, V)
    ids = torch.randint(0, V, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(selective_log_softmax_from_logits(logits, ids), expected)


def test_reverse_kl_by_hand():
    # Student uniform over 2 tokens, teacher (3/4, 1/4):
    # KL = 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.5 ln(4/3) = 0.143841.
    s = torch.zeros(1, 2)
    t = torch.log(torch.tensor([[0.75, 0.25]]))
    assert reverse_kl_from_logits(s, t).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-6)
    out = reverse_kl(torch.zeros(1, 1), torch.zeros(2, 1), teacher_logits=t)
    assert out.item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-6)


@pytest.mark.parametrize("teacher_as", ["hidden", "logits"])
def test_reverse_kl_matches_naive_values_and_grads(teacher_as):
    hidden, weight, _ = _inputs()
    t_hidden, t_weight, _ = _inputs(seed=2, h=6)
    upstream = torch.rand(N, generator=torch.Generator().manual_seed(3))
    t_logits = t_hidden @ t_weight.T  # (N, V)
    ref = reverse_kl_from_logits(hidden @ weight.T, t_logits.detach())
    (ref * upstream).sum().backward()
    ref_gh, ref_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    if teacher_as == "hidden":
        out = reverse_kl(hidden, weight, t_hidden, t_weight, chunk_size=3)
    else:
        out = reverse_kl(hidden, weight, teacher_logits=t_logits, chunk_size=3)
    (out * upstream).sum().backward()
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref_gw, atol=1e-5, rtol=1e-5)
    assert t_hidden.grad is None and t_weight.grad is None  # the teacher is a constant target
    assert (out >= -1e-6).all()


def test_reverse_kl_of_itself_is_zero():
    hidden, weight, _ = _inputs()
    out = reverse_kl(hidden, weight, hidden, weight, chunk_size=4)
    torch.testing.assert_close(out, torch.zeros(N), atol=1e-5, rtol=0)


def test_bad_arguments_refused():
    hidden, weight, ids = _inputs()
    with pytest.raises(ValueError, match="hidden"):
        selective_log_softmax(hidden, weight, ids[:3])
    with pytest.raises(ValueError, match="either"):
        reverse_kl(hidden, weight)
    with pytest.raises(ValueError, match="vocabularies"):
        reverse_kl(hidden, weight, hidden, weight[:5])
    with pytest.raises(RuntimeError, match="CUDA"):
        selective_log_softmax(hidden, weight, ids, backend="triton")


needs_triton = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and triton")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_selective_matches_torch(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 256, 64, 151_936
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.1).to(dtype).requires_grad_(True)
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    results = []
    for backend in ("torch", "triton"):
        hidden.grad = weight.grad = None
        out = selective_log_softmax(hidden, weight, ids, chunk_size=64, backend=backend)
        out.sum().backward()
        results.append((out.detach(), hidden.grad.float(), weight.grad.float()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@needs_triton
def test_triton_reverse_kl_matches_torch():
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 256, 64, 151_936
    hidden = torch.randn(n, h, device="cuda", generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.1).requires_grad_(True)
    t_hidden = torch.randn(n, h, device="cuda", generator=g)
    t_weight = torch.randn(v, h, device="cuda", generator=g) * 0.1
    results = []
    for backend in ("torch", "triton"):
        hidden.grad = weight.grad = None
        out = reverse_kl(hidden, weight, t_hidden, t_weight, chunk_size=64, backend=backend)
        out.sum().backward()
        results.append((out.detach(), hidden.grad, weight.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_kernels_folder_never_shadows_the_hub_kernels_package():
    """transformers >= 5.25 imports the `kernels` hub package; a regular package named `kernels` in the
    working directory shadowed it and every transformers model import failed (a CI run did)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert not (root / "kernels" / "__init__.py").exists()
    probe = (
        "import importlib.util, sys; s = importlib.util.find_spec('kernels'); "
        "o = s.origin if s else None; print(o); "
        "from transformers import Qwen3ForCausalLM; import opd_kernels; print(opd_kernels.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    origin, ours = out.stdout.split()
    # A real install is a file in site-packages; without one, only a namespace portion (origin None).
    assert origin in ("None",) or "site-packages" in origin, origin
    assert Path(ours).parent == root / "kernels" / "opd_kernels"
