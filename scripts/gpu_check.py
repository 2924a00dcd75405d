"""SGLang smoke test for a lent GPU machine: launch a server on a model dir, generate with logprobs,
score, compare with the embedded engine, update weights. Prints SKIP with a reason when it cannot run.

    python scripts/gpu_check.py BASE_DIR [--port 30123] [--server-args "--attention-backend triton"]

Exit code: 0 passed or skipped, 1 failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("base_dir", nargs="?", default=None, help="an HF model dir with its tokenizer (the lab base)")
    p.add_argument("--port", type=int, default=None)
    # The lab model has head_dim 32, which some default attention backends do not build for.
    p.add_argument("--server-args", default="--attention-backend triton --mem-fraction-static 0.2 --disable-cuda-graph")
    a = p.parse_args()

    import torch

    if a.base_dir is None or not (Path(a.base_dir) / "config.json").exists():
        print(f"SKIP sglang smoke: no model dir given or no config.json in it ({a.base_dir})")
        return 0
    if not torch.cuda.is_available():
        print("SKIP sglang smoke: no CUDA device")
        return 0
    if importlib.util.find_spec("sglang") is None:
        print("SKIP sglang smoke: sglang is not installed (pip install 'opd[sglang]' on the GPU machine)")
        return 0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.rollout import SamplingParams, get_engine
    from opd.rollout.sglang import launch_server

    tok = AutoTokenizer.from_pretrained(a.base_dir)
    model = AutoModelForCausalLM.from_pretrained(a.base_dir).to("cuda")
    port = a.port or free_port()
    print(f"launching sglang on {a.base_dir}, port {port} ({a.server_args})")
    failures = []
    with launch_server(a.base_dir, port, shlex.split(a.server_args), timeout_s=300) as server:
        sgl = get_engine("sglang", base_url=server.base_url, tokenizer=tok, model=model, timeout_s=120)
        emb = get_engine("embedded", model=model, tokenizer=tok)
        prompts = ["12+7=", "3*4="]
        out = sgl.generate(prompts, n=2, params=SamplingParams(temperature=1.0, max_new_tokens=8))
        for group in out:
            for r in group:
                print(f"  {r.prompt!r} -> {r.text!r} logprobs {[round(x, 3) for x in r.logprobs]}")
                if len(r.logprobs) != len(r.completion_ids) or not r.completion_ids:
                    failures.append("generate: logprobs and completion ids differ in length")
        flat = [r for g in out for r in g]
        pids, cids = [r.prompt_ids for r in flat], [r.completion_ids for r in flat]
        s_scores, e_scores = sgl.score(pids, cids), emb.score(pids, cids)
        gen_vs_score = max(abs(x - y) for r, s in zip(flat, s_scores, strict=True)
                           for x, y in zip(r.logprobs, s, strict=True))
        sgl_vs_hf = max(abs(x - y) for s, e in zip(s_scores, e_scores, strict=True) for x, y in zip(s, e, strict=True))
        print(f"  max |sampled logprob - sglang score| = {gen_vs_score:.2e}")
        print(f"  max |sglang score - transformers score| = {sgl_vs_hf:.2e}")
        # bf16/float kernels differ from the CPU reference; 2e-2 catches misalignment, not rounding.
        if gen_vs_score > 2e-2:
            failures.append(f"sampled logprobs differ from scores by {gen_vs_score:.2e} (temperature-1 logprobs?)")
        if sgl_vs_hf > 2e-2:
            failures.append(f"sglang scores differ from transformers by {sgl_vs_hf:.2e}")
        sgl.sync_weights(a.base_dir)
        print("  update_weights_from_disk: ok")
    if failures:
        print("FAIL sglang smoke: " + "; ".join(failures))
        return 1
    print("PASS sglang smoke")
    return 0


if __name__ == "__main__":
    from opd.errors import OpdError

    try:
        sys.exit(main())
    except OpdError as e:  # the client's errors are one line: print it as the step's verdict
        print(f"FAIL sglang smoke: {e}")
        sys.exit(1)
