"""Scoring backends: a candidate scored in process (hf), or written to disk and scored by lm-eval's
own vLLM or SGLang model type (GPU only).

The constructor fields below were read from lm-eval 0.4.13's installed source:
- lm_eval/models/vllm_causallms.py `VLLM.__init__(pretrained, dtype, tokenizer, tensor_parallel_size,
  batch_size, max_model_len, seed, trust_remote_code, **kwargs)`; the extra kwargs go on to
  `vllm.LLM(...)`, which takes `gpu_memory_utilization`.
- lm_eval/models/sglang_causallms.py `SGLangLM.__init__(pretrained, tokenizer_path, dtype, tp_size,
  batch_size, max_model_len, mem_fraction_static, device, trust_remote_code)`.
Neither module is imported unless that backend is used: both import their engine at import time.
"""

from __future__ import annotations

import gc
import importlib.util
import tempfile
from pathlib import Path

from opd.errors import OpdError

BACKENDS = ("hf", "vllm", "sglang")
# the package each engine needs, and how a user gets it
PACKAGES = {"vllm": "pip install 'lm-eval[vllm]'", "sglang": "pip install 'opd[sglang]' (see docs.sglang.ai)"}


def require_backend(backend: str) -> None:
    """Refuse, in one line, a backend that cannot run on this machine."""
    if backend == "hf":
        return
    if backend not in PACKAGES:
        raise OpdError(f"scoring.backend {backend!r}: choose one of {BACKENDS}")
    if importlib.util.find_spec(backend) is None:
        raise OpdError(f"scoring.backend {backend!r}: the {backend} package is not installed here "
                       f"({PACKAGES[backend]}, on a CUDA machine); use backend: hf")
    import torch  # lazy: torch is slow to import

    if not torch.cuda.is_available():
        raise OpdError(f"scoring.backend {backend!r}: needs a CUDA GPU and this machine has none; use backend: hf")


def model_args(scoring, path: str | Path, seed: int = 0) -> dict:
    """The keyword arguments of lm-eval's model type for `scoring.backend` on the model in `path`."""
    path = str(path)
    if scoring.backend == "vllm":  # lm_eval/models/vllm_causallms.py VLLM.__init__
        args = {"pretrained": path, "tokenizer": path, "dtype": scoring.dtype,
                "tensor_parallel_size": scoring.tensor_parallel, "batch_size": scoring.batch_size,
                "max_model_len": scoring.max_model_len, "seed": seed, "trust_remote_code": False}
        if scoring.memory_fraction is not None:
            args["gpu_memory_utilization"] = scoring.memory_fraction  # **kwargs -> vllm.LLM
        return args
    if scoring.backend == "sglang":  # lm_eval/models/sglang_causallms.py SGLangLM.__init__
        return {"pretrained": path, "tokenizer_path": path, "dtype": scoring.dtype, "tp_size": scoring.tensor_parallel,
                "batch_size": scoring.batch_size, "max_model_len": scoring.max_model_len,
                "mem_fraction_static": scoring.memory_fraction, "device": "cuda", "trust_remote_code": False}
    raise OpdError(f"scoring.backend {scoring.backend!r}: no lm-eval model type to build (hf scores in process)")


def make_lm(scoring, path: str | Path, seed: int = 0):
    """lm-eval's VLLM / SGLangLM on the model directory `path`."""
    require_backend(scoring.backend)
    if scoring.backend == "vllm":
        from lm_eval.models.vllm_causallms import VLLM as model_type  # lazy: vllm is optional (GPU only)
    else:
        # lazy: sglang is optional (GPU only)
        from lm_eval.models.sglang_causallms import SGLangLM as model_type
    return model_type(**model_args(scoring, path, seed))


def evaluate_on_disk(model, tokenizer, scoring, capabilities: list[str], split: str, limit: int | None,
                     model_hash: str):
    """Write `model` (its current weights) and `tokenizer` to a temporary directory and score it
    there with the backend's engine; the cache works as for hf (keyed by `model_hash`)."""
    from opd.evaluation.api import evaluate  # lazy: opd.evaluation.api loads torch and numpy

    made = []

    with tempfile.TemporaryDirectory(prefix="opd-candidate-") as tmp:
        def factory():  # only when a score is not cached: an engine takes a while to start
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            made.append(make_lm(scoring, tmp))
            return made[-1]

        try:
            return evaluate(model, tokenizer, capabilities, split, limit=limit, model_hash=model_hash,
                            lm_factory=factory)
        finally:
            _release(made)


def _release(made: list) -> None:
    """Free the engine's GPU memory before the next candidate starts one (not checked on a GPU here:
    SGLang's Engine has shutdown(); vLLM's LLM frees its memory when collected)."""
    import torch  # lazy: torch is slow to import

    for lm in made:
        engine = getattr(lm, "model", None)
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    made.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
