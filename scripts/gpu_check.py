"""Checks for a lent GPU machine. Each prints PASS, FAIL or SKIP with a reason when it cannot run.

    python scripts/gpu_check.py --steps    # one GSPO step, one OPD step, one merge-candidate scoring on cuda in bf16
    python scripts/gpu_check.py BASE_DIR [--port 30123] [--server-args "--attention-backend triton"]   # SGLang smoke

The steps run on pico models built in the process (seconds); the SGLang smoke test launches a server on
a model dir, generates with logprobs, scores, compares with the embedded engine and updates weights.
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


def device_steps() -> int:
    """One GSPO step, one OPD step (sampled and full estimators) and one merge-candidate scoring on `cuda` in
    bf16, each on pico models: the batches must be built on the model's device and the weights must move."""
    import copy
    import random

    import torch

    if not torch.cuda.is_available():
        for step in ("gspo step", "opd step", "merge scoring"):
            print(f"SKIP {step}: no CUDA device (torch {torch.__version__})")
        return 0
    from opd.devices import place, resolve_device, resolve_dtype
    from opd.lab.model import build_model
    from opd.lab.pico import PICO
    from opd.lab.tokenizer import build_char_tokenizer
    from opd.rollout import SamplingParams, get_engine

    device = resolve_device("cuda")
    dtype = resolve_dtype("auto", device)
    tok = build_char_tokenizer()
    base = build_model(PICO, tok, seed=0)

    def on_gpu(m):
        return place(copy.deepcopy(m), device, dtype)

    def moved(model, before: dict) -> bool:
        return any(not torch.equal(p, before[k]) for k, p in model.state_dict().items())

    failures = []

    def check(step: str, fn) -> None:
        try:
            print(f"PASS {step} ({device}, {str(dtype).removeprefix('torch.')}): {fn()}")
        except Exception as e:
            failures.append(step)
            print(f"FAIL {step}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def gspo() -> str:
        from opd.expert.settings import GSPOConfig
        from opd.expert.trainer import gspo_step

        model = on_gpu(base)
        engine = get_engine("embedded", model=model, tokenizer=tok)
        groups = engine.generate(["12+3=", "7-2="], 4, SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))
        kept = [(g, [float(i % 2) for i in range(len(g))]) for g in groups]
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        st = gspo_step(model, opt, on_gpu(base).eval(), kept, GSPOConfig(updates_per_batch=2, kl_coef=0.1),
                       tok.pad_token_id)
        assert st["loss"] == st["loss"] and moved(model, before), "no finite loss or the weights did not move"
        return f"loss {st['loss']:.4f}, {st['trained_tokens']:.0f} tokens"

    def opd() -> str:
        from opd.distill.batch import build_batch, sample_batch
        from opd.distill.config import DistillConfig
        from opd.distill.loop import StudentHidden, opd_step
        from opd.distill.routing import resolve_routes
        from opd.distill.teacher_bank import TeacherBank
        from opd.distill.teachers import embedded_teacher

        torch.manual_seed(1)
        teachers = {}
        for i, cap in enumerate(["count", "rev"]):
            m = copy.deepcopy(base)
            for p in m.parameters():
                p.data += 0.05 * torch.randn_like(p)
            teachers[f"t{i}"] = embedded_teacher(f"t{i}", cap, on_gpu(m), tok)
        routes = resolve_routes({n: t.capability for n, t in teachers.items()})
        out = []
        for estimator in ("sampled", "full"):
            student = on_gpu(base)
            engine = get_engine("embedded", model=student, tokenizer=tok)
            items, groups = sample_batch(engine, routes, {"count": 1.0, "rev": 1.0}, random.Random(0), prompts=4,
                                         group=2, temperature=1.0, max_new_tokens=4, seed=0)
            bank = TeacherBank(teachers, sorted(teachers)) if estimator == "full" else None
            batch = build_batch(student, items, groups, teachers, routes, tok.pad_token_id, bank=bank,
                                old_lp=estimator == "sampled")
            before = {k: v.clone() for k, v in student.state_dict().items()}
            opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
            st = opd_step(StudentHidden(student), opt, batch, DistillConfig(estimator=estimator), teachers)
            assert st["loss"] == st["loss"] and moved(student, before), f"{estimator}: no finite loss or no update"
            out.append(f"{estimator} loss {st['loss']:.4f}")
        return ", ".join(out)

    def scoring() -> str:
        from pathlib import Path

        from opd.merge.references import Scorer
        from opd.merge.strategies import MergeInputs
        from opd.weights.merge import Candidate, merge_in_memory, merge_keys

        experts = {}
        for i in range(2):
            m = copy.deepcopy(base)
            for p in m.parameters():
                p.data += 0.02 * torch.randn_like(p)
            experts[f"e{i}"] = {k: v.detach().clone() for k, v in merge_keys(m.state_dict()).items()}
        inputs = MergeInputs(Path("."), copy.deepcopy(base), tok, "", {}, {}, experts, ["count", "rev"])
        cand = Candidate(strategy="linear", per_model={e: {"weight": 0.5} for e in experts})
        merged = merge_in_memory(cand, inputs.base_sd, experts)  # on the CPU in float32, as the search keeps it
        scorer = Scorer(inputs, batch_size=64, device=device, dtype=dtype)
        scores = scorer.score(merged, "val", limit=16)
        p = next(scorer.model.parameters())
        assert (p.device, p.dtype) == (device, dtype), f"the scorer's model is on {p.device} in {p.dtype}"
        assert inputs.base_model.device.type == "cpu", "the merge base left the CPU"
        return ", ".join(f"{c} {s.score:.3f}" for c, s in scores.items())

    check("gspo step", gspo)
    check("opd step", opd)
    check("merge scoring", scoring)
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("base_dir", nargs="?", default=None, help="an HF model dir with its tokenizer (the lab base)")
    p.add_argument("--steps", action="store_true", help="the device steps (GSPO, OPD, merge scoring), not SGLang")
    p.add_argument("--port", type=int, default=None)
    # The lab model has head_dim 32, which some default attention backends do not build for.
    p.add_argument("--server-args", default="--attention-backend triton --mem-fraction-static 0.2 --disable-cuda-graph")
    a = p.parse_args()
    if a.steps:
        return device_steps()

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

    from opd.distill.offpolicy import teacher_targets
    from opd.distill.teachers import embedded_teacher
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
        # the KL warm start's targets from a server teacher (distill.warmstart_topk): its top-k log-probs at
        # each completion token against transformers' own, compared sorted (ties may order ids differently)
        k = 5
        tops = sgl.top_logprobs(pids, cids, k)
        want = teacher_targets(embedded_teacher("smoke", "add", model, tok), list(zip(pids, cids)),
                               tok.pad_token_id if tok.pad_token_id is not None else 0, topk=k)
        got = torch.tensor([v for _, lps in tops for v in lps])
        top_vs_hf = float((got.sort(-1, descending=True).values - want.logprobs).abs().max())
        print(f"  max |sglang top-{k} logprob - transformers top-{k}| = {top_vs_hf:.2e}")
        if top_vs_hf > 2e-2:
            failures.append(f"sglang top-{k} log-probs differ from transformers by {top_vs_hf:.2e}")
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
