"""opd kernels: chunked selective log-softmax and reverse KL (torch on CPU, Triton row ops on GPU).

Imported as `opd_kernels` (kernels/opd_kernels, mapped in pyproject; kernels/ has no __init__.py
so it never shadows the `kernels` hub package that transformers imports). Triton is imported only when a CUDA
tensor reaches a kernel with backend "auto" or "triton".
"""

from opd_kernels.chunked import (
    reverse_kl,
    reverse_kl_from_logits,
    selective_log_softmax,
    selective_log_softmax_from_logits,
)


def triton_available() -> bool:
    """True when CUDA is usable and triton imports, i.e. when backend="auto" picks Triton."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = [
    "reverse_kl",
    "reverse_kl_from_logits",
    "selective_log_softmax",
    "selective_log_softmax_from_logits",
    "triton_available",
]
