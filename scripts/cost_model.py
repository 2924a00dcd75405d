"""The paper cost model behind docs/scale.md: opd's stages for ten experts of an 8B dense model and of a
GLM-4.5-class MoE on H100s, and one OPD step of an 8B student with ten 8B teachers, from FLOP and byte
counts of the model shapes, the lab's measured step split, and stated hardware constants.

    python scripts/cost_model.py            # print every table
    python scripts/cost_model.py --write    # regenerate the tables between the markers in docs/scale.md

Pure arithmetic, no torch: every number in docs/scale.md's tables comes from here.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "scale.md"

# ---------------------------------------------------------------- hardware: spec-sheet values, or assumptions (each says)
H100_BF16_FLOPS = 989e12   # dense bf16 tensor-core peak, H100 SXM spec sheet (no sparsity)
HBM_BW = 3.35e12           # HBM3 bytes/s, H100 SXM spec sheet
HBM_BYTES = 80e9           # per GPU, H100 SXM spec sheet
NVLINK_BW = 450e9          # bytes/s one direction per GPU (NVLink 4: 900 GB/s both directions)
IB_BW = 50e9               # bytes/s per GPU: one 400 Gb/s NDR NIC per GPU, 8 per node (DGX H100 layout)
GPUS_PER_NODE = 8
MEM_FRACTION = 0.85        # of HBM an engine may fill (weights + KV); SGLang's mem_fraction_static is 0.7-0.9
BW_EFF = 0.80              # achieved / peak HBM bandwidth in a decode step (assumption)
MFU = {                    # achieved / peak FLOP/s (assumptions; MoE lower for all-to-all and small expert GEMMs)
    "dense": {"prefill": 0.50, "train": 0.40, "decode": 0.50},
    "moe": {"prefill": 0.35, "train": 0.25, "decode": 0.35},
}
OPT_BYTES_PER_PARAM = 30   # AdamW step traffic: reads fp32 grad, master, m, v (16 B); writes master, m, v, bf16 copy (14 B)
TRAIN_STATE_BYTES = 16     # per param resident for mixed-precision Adam: bf16 w + bf16 g + fp32 master, m, v
HOST_BYTES = 2e12          # host memory per node (DGX H100: 2 TB; assumption)
DISK_BW = 10e9             # bytes/s a merge worker streams expert weights (NVMe RAID / page cache; assumption)


@dataclass(frozen=True)
class Gpu:
    name: str
    flops: float    # dense bf16 peak, FLOP/s
    bw: float       # HBM bytes/s
    hbm: float      # HBM bytes


H100 = Gpu("H100 SXM", H100_BF16_FLOPS, HBM_BW, HBM_BYTES)
# Only for checking marin#6218, which ran on Leonardo's A100-64GB: 312 TFLOP/s bf16 is the A100 spec sheet's;
# 1.6 TB/s is an assumption between the 40 GB (1.56) and 80 GB (2.04) parts.
A100_64 = Gpu("A100-64GB", 312e12, 1.6e12, 64e9)


@dataclass(frozen=True)
class Shape:
    """A decoder's shape, as its config.json gives it. `experts`/`topk`/`moe_layers` are 0 for dense."""
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int              # dense MLP width
    vocab: int
    tied: bool                     # lm head shares the embedding matrix
    moe_layers: int = 0
    experts: int = 0               # routed experts per MoE layer
    topk: int = 0                  # routed experts per token
    shared_experts: int = 0
    moe_intermediate: int = 0
    source: str = ""

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def _attn(self) -> int:
        qo = 2 * self.hidden * self.q_heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return qo + kv

    def _expert(self, width: int) -> int:
        return 3 * self.hidden * width  # SwiGLU: gate, up, down

    def params(self) -> tuple[int, int]:
        """(total, active per token), embeddings and lm head included."""
        dense_layers = self.layers - self.moe_layers
        body = self.layers * self._attn() + dense_layers * self._expert(self.intermediate)
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        if not self.moe:
            return body + emb, body + emb
        router = self.hidden * self.experts
        shared = self.shared_experts * self._expert(self.moe_intermediate)
        per_moe_total = self.experts * self._expert(self.moe_intermediate) + shared + router
        per_moe_active = self.topk * self._expert(self.moe_intermediate) + shared + router
        return (body + self.moe_layers * per_moe_total + emb, body + self.moe_layers * per_moe_active + emb)

    def matmul_params(self) -> int:
        """Active parameters that multiply each token: all but the input embedding (a lookup)."""
        return self.params()[1] - self.vocab * self.hidden * (0 if self.tied else 1)

    def fwd_flops(self, ctx: float) -> float:
        """Forward FLOPs per token attending to `ctx` earlier tokens: 2 per matmul parameter, plus QK^T and
        AV (2 FLOPs x 2 products x q_heads x head_dim per attended token per layer)."""
        return 2 * self.matmul_params() + 4 * self.layers * self.q_heads * self.head_dim * ctx

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes  # K and V

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        return self.params()[0] * dtype_bytes


QWEN3_8B = Shape("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, tied=False,
                 source="Qwen/Qwen3-8B config.json, as stated in the task brief")
QWEN3_1_7B = Shape("Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, 151936, tied=True,
                   source="Qwen/Qwen3-1.7B config.json (marin experiments/qwen3.py has the same widths)")
QWEN3_32B = Shape("Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, tied=False,
                  source="Qwen/Qwen3-32B config.json, stated from memory (gives 32.8B, its published size)")
GLM45 = Shape("GLM-4.5", 92, 5120, 96, 8, 128, 12288, 151552, tied=False, moe_layers=89, experts=160, topk=8,
              shared_experts=1, moe_intermediate=1536,
              source="slime scripts/models/glm4.5-355B-A32B.sh (MTP layer left out)")
QWEN3_235B = Shape("Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 12288, 151936, tied=False, moe_layers=94, experts=128,
                   topk=8, moe_intermediate=1536, source="slime scripts/models/qwen3-235B-A22B.sh")
LAB = Shape("lab base", 4, 192, 6, 2, 32, 512, 60, tied=True, source="opd/lab/model.py ModelShape defaults, char vocab")

# ---------------------------------------------------------------- the lab's measured parts (cited; a test checks the quotes)
LAB_MS = {"sample": 139.0, "score": 124.0, "update": 250.0}
LAB_MS_SOURCE = ("docs/results/opd-throughput.md, `python bench/profile_opd_step.py` (64 prompts x 3, 3 updates, "
                 "fp32, 1 thread, AVX2 EPYC)")
LAB_MS_QUOTE = "sampling 214 → 139 ms,\nteacher scoring 150 → 124 ms, update 280 → 250 ms"
LAB_PROMPTS, LAB_GROUP = 64, 3
# Mean lengths of the lab10 capabilities' train items (prompt; answer + "\n"), 500 items each: printed by
# `python scripts/cost_model.py --lab-lengths` from opd.capabilities; the doc's "about 8.5 prompt tokens
# before 3-4 answer tokens" agrees.
LAB_PROMPT_LEN, LAB_ANSWER_LEN = 8.56, 3.91
LAB_GFLOPS_QUOTE = "every phase's matrix products run at 80-89 GFLOP/s on one core"
LAB10 = ["add", "sub", "mod", "rev", "sort", "count", "max", "shift", "dedup", "digsum"]

# ---------------------------------------------------------------- workloads (assumptions, sized like published recipes)
@dataclass(frozen=True)
class Rollouts:
    steps: int
    prompts: int           # per step
    samples: int           # per prompt
    prompt_len: int        # tokens
    resp_len: int          # mean sampled tokens per answer

    @property
    def seqs(self) -> int:
        return self.steps * self.prompts * self.samples

    def resp_tokens(self) -> float:
        return self.seqs * self.resp_len


# RL expert: DAPO/slime-like GRPO batches (512 prompts x 8, 4k mean answers), 200 steps.
RL = Rollouts(steps=200, prompts=512, samples=8, prompt_len=1024, resp_len=4096)
# OPD: Thinking Machines' cookbook shape (200 steps, 512 prompts x 4, 16k cap; 4k mean assumed), per marin#9250.
OPD = Rollouts(steps=200, prompts=512, samples=4, prompt_len=1024, resp_len=4096)
# Scoring one model: 500 test (or val) items per capability, ten capabilities, 2k mean answers.
EVAL = Rollouts(steps=1, prompts=5000, samples=1, prompt_len=1024, resp_len=2048)
SEARCH_TRIALS = 100        # Optuna candidates, each merged then scored on a val split of EVAL's size
SEARCH_VAL_FRACTION = 0.4  # val items per candidate / EVAL's test items (200 of 500 per capability)
TEST_MODELS = 17           # base + 10 experts + 5 finalists + the consolidated model
N_EXPERTS = 10

PAYLOAD_K = (64, 256)


# ---------------------------------------------------------------- per-token costs (H100 unless told)
def _mfu(s: Shape, phase: str) -> float:
    return MFU["moe" if s.moe else "dense"][phase]


def decode(s: Shape, ctx: float, gpus: int, gpu: Gpu = H100) -> dict:
    """One engine of `gpus` GPUs decoding as many sequences as its KV memory holds (mean context `ctx`).
    Memory-bound unless the FLOPs of the batch take longer than reading weights + KV once per step."""
    w_bytes = s.weight_bytes()
    kv_seq = s.kv_bytes_per_token() * ctx
    free = gpus * gpu.hbm * MEM_FRACTION - w_bytes
    batch = max(1, math.floor(free / kv_seq))
    touched = 1.0
    if s.moe:  # fraction of routed experts some token of the batch hits, per layer (uniform routing)
        touched = 1 - (1 - s.topk / s.experts) ** batch
        expert_bytes = s.moe_layers * s.experts * 3 * s.hidden * s.moe_intermediate * 2
        w_bytes = w_bytes - expert_bytes * (1 - touched)
    step_bytes = w_bytes + batch * kv_seq
    t_mem = step_bytes / (gpus * gpu.bw * BW_EFF)
    t_flop = batch * s.fwd_flops(ctx) / (gpus * gpu.flops * _mfu(s, "decode"))
    t_a2a = 0.0
    if s.moe and gpus > GPUS_PER_NODE:  # expert-parallel dispatch + combine of bf16 hidden states, off-node share
        off_node = 1 - GPUS_PER_NODE / gpus
        a2a = 2 * s.topk * s.hidden * 2 * s.moe_layers * off_node
        t_a2a = batch * a2a / (gpus * IB_BW)
    t_step = max(t_mem, t_flop) + t_a2a
    return {"batch": batch, "step_bytes": step_bytes, "t_step": t_step, "bound": "HBM" if t_mem > t_flop else "FLOPs",
            "gpu_s_per_token": gpus * t_step / batch, "bytes_per_token": step_bytes / batch,
            "flops_per_token": s.fwd_flops(ctx), "a2a_share": t_a2a / t_step}


def prefill_gpu_s(s: Shape, ctx: float, gpu: Gpu = H100) -> float:
    return s.fwd_flops(ctx) / (gpu.flops * _mfu(s, "prefill"))


def train_gpu_s(s: Shape, ctx: float, gpu: Gpu = H100) -> float:
    return 3 * s.fwd_flops(ctx) / (gpu.flops * _mfu(s, "train"))  # forward + backward = 3 forwards (6N)


def engine_gpus(s: Shape) -> int:
    """Smallest power-of-two engine whose HBM holds the bf16 weights with half its share left for KV."""
    g = 1
    while s.weight_bytes() > g * HBM_BYTES * MEM_FRACTION / 2:
        g *= 2
    return g


def teacher_gpus(s: Shape) -> int:
    """A scoring actor keeps no KV between requests: the smallest power of two holding the bf16 weights
    with a fifth of its memory left for one prefill batch's activations."""
    g = 1
    while s.weight_bytes() > g * HBM_BYTES * MEM_FRACTION * 0.8:
        g *= 2
    return g


def rollout_gpu_s(s: Shape, r: Rollouts, teacher: Shape | None = None, trains: bool = True,
                  relogprob: bool = False) -> dict:
    """GPU-seconds per phase for a batch of rollouts: decode, teacher (or old-policy) prefill, update."""
    seq = r.prompt_len + r.resp_len
    dec = decode(s, r.prompt_len + r.resp_len / 2, engine_gpus(s))
    out = {"sample": r.seqs * (dec["gpu_s_per_token"] * r.resp_len + prefill_gpu_s(s, r.prompt_len / 2) * r.prompt_len)}
    scorer = teacher or (s if relogprob else None)
    if scorer:
        out["score" if teacher else "old logprobs"] = r.seqs * seq * prefill_gpu_s(scorer, seq / 2)
    out["update"] = r.seqs * seq * train_gpu_s(s, seq / 2) if trains else 0.0
    return out


# ---------------------------------------------------------------- payloads
def payloads(vocab: int) -> list[tuple[str, int, str]]:
    rows = [("full vocabulary, fp32", vocab * 4, "vocab x 4 B"),
            ("full vocabulary, bf16", vocab * 2, "vocab x 2 B")]
    rows += [(f"top-{k} (int32 id + fp32 logprob)", k * 8, f"{k} x (4 + 4) B") for k in PAYLOAD_K]
    rows += [("sampled token (fp32 logprob)", 4, "1 x 4 B")]
    return rows


# ---------------------------------------------------------------- formatting
def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _sig(x: float) -> str:
    """Two or three significant figures, with SI-ish suffixes, for FLOPs and bytes."""
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- tables
def t_constants() -> str:
    rows = [
        ["H100 SXM bf16 dense peak", f"{H100_BF16_FLOPS / 1e12:.0f} TFLOP/s", "spec sheet"],
        ["HBM3 bandwidth", f"{HBM_BW / 1e12:.2f} TB/s; {BW_EFF:.0%} achieved in decode", "spec sheet; achieved: assumption"],
        ["HBM per GPU; share an engine fills", f"{HBM_BYTES / 1e9:.0f} GB; {MEM_FRACTION:.0%}", "spec sheet; assumption"],
        ["NVLink 4 per GPU, one direction", f"{NVLINK_BW / 1e9:.0f} GB/s", "spec sheet"],
        ["InfiniBand per GPU (400 Gb/s NDR, 8 per node)", f"{IB_BW / 1e9:.0f} GB/s", "DGX H100 layout: assumption"],
        ["MFU dense: prefill / train / decode FLOP cap", " / ".join(f"{v:.0%}" for v in MFU["dense"].values()), "assumption"],
        ["MFU MoE: prefill / train / decode FLOP cap", " / ".join(f"{v:.0%}" for v in MFU["moe"].values()), "assumption"],
        ["AdamW step traffic; resident train state", f"{OPT_BYTES_PER_PARAM} B/param; {TRAIN_STATE_BYTES} B/param",
         "mixed precision, fp32 master and moments"],
        ["merge worker's weight streaming; host memory per node", f"{DISK_BW / 1e9:.0f} GB/s; {HOST_BYTES / 1e12:.0f} TB",
         "assumption; DGX H100"],
        ["lab OPD step, measured: sample / score / update", " / ".join(f"{v:.0f} ms" for v in LAB_MS.values()),
         LAB_MS_SOURCE],
        ["RL expert run", f"{RL.steps} steps x {RL.prompts} prompts x {RL.samples}, {RL.prompt_len} + {RL.resp_len} tokens",
         "assumption (DAPO/slime-sized)"],
        ["OPD run", f"{OPD.steps} steps x {OPD.prompts} prompts x {OPD.samples}, {OPD.prompt_len} + {OPD.resp_len} tokens",
         "Tinker cookbook's 200 x 512 x 4 (marin#9250); lengths assumed"],
        ["scoring one model", f"{EVAL.prompts:,} items, {EVAL.prompt_len} + {EVAL.resp_len} tokens; search: "
         f"{SEARCH_TRIALS} candidates on {SEARCH_VAL_FRACTION:.0%} of it; test: {TEST_MODELS} models", "assumption"],
    ]
    return _table(["constant", "value", "source"], rows)


def t_models() -> str:
    rows = []
    for s in (LAB, QWEN3_1_7B, QWEN3_8B, QWEN3_32B, GLM45):
        tot, act = s.params()
        rows.append([s.name, _sig(tot), _sig(act), _sig(s.fwd_flops(0)) + "FLOP", _n(s.kv_bytes_per_token()),
                     _sig(s.weight_bytes()) + "B", str(math.ceil(s.weight_bytes() / (HBM_BYTES * MEM_FRACTION))),
                     str(math.ceil(tot * TRAIN_STATE_BYTES / (HBM_BYTES * MEM_FRACTION)))])
    return _table(["model", "params", "active", "fwd / token (2N)", "KV B / token (bf16)", "bf16 weights",
                   "GPUs to hold weights", "GPUs to hold Adam state"], rows)


def lab_split() -> dict:
    rows = LAB_PROMPTS * LAB_GROUP
    gen = rows * LAB_ANSWER_LEN                    # student tokens a step
    prompt = LAB_PROMPTS * LAB_PROMPT_LEN          # packed: each prompt laid out once
    pos = prompt + gen
    flops = {"sample": (prompt + gen) * LAB.fwd_flops(LAB_PROMPT_LEN),
             "score": pos * LAB.fwd_flops(LAB_PROMPT_LEN),
             "update": 3 * pos * LAB.fwd_flops(LAB_PROMPT_LEN)}
    return {"gen": gen, "pos": pos, "flops": flops}


def t_lab() -> str:
    lab = lab_split()
    total_ms = sum(LAB_MS.values())
    total_f = sum(lab["flops"].values())
    rows = []
    for k in LAB_MS:
        f = lab["flops"][k]
        rows.append([k, f"{LAB_MS[k]:.0f}", f"{LAB_MS[k] / total_ms:.0%}", _sig(f) + "FLOP", f"{f / total_f:.0%}",
                     f"{f / (LAB_MS[k] / 1000) / 1e9:.0f}"])
    rows.append(["step", f"{total_ms:.0f}", "100%", _sig(total_f) + "FLOP", "100%",
                 f"{total_f / (total_ms / 1000) / 1e9:.0f}"])
    return _table(["phase", "measured ms", "share of time", "FLOPs (2N / 6N)", "share of FLOPs", "achieved GFLOP/s"], rows)


def opd_step_8b() -> dict:
    """One OPD step: OPD's batch, an 8B student, ten 8B teachers (each row scored by its routed teacher)."""
    s, r = QWEN3_8B, OPD
    one = Rollouts(1, r.prompts, r.samples, r.prompt_len, r.resp_len)
    seq = r.prompt_len + r.resp_len
    dec = decode(s, r.prompt_len + r.resp_len / 2, engine_gpus(s))
    gen, pos = one.resp_tokens(), one.seqs * seq
    g = rollout_gpu_s(s, one, teacher=s)
    opt_bytes = OPT_BYTES_PER_PARAM * s.params()[0]
    g["update"] += opt_bytes / (HBM_BW * BW_EFF)
    return {"gen": gen, "pos": pos, "dec": dec, "gpu_s": g,
            "flops": {"sample": gen * s.fwd_flops(r.prompt_len + r.resp_len / 2) + one.seqs * r.prompt_len * s.fwd_flops(r.prompt_len / 2),
                      "score": pos * s.fwd_flops(seq / 2), "update": 3 * pos * s.fwd_flops(seq / 2)},
            "bytes": {"sample": gen * dec["bytes_per_token"],
                      "score": N_EXPERTS * s.weight_bytes() + one.seqs * seq * s.kv_bytes_per_token(),
                      "update": opt_bytes}}


def t_opd_step() -> str:
    st = opd_step_8b()
    tot = sum(st["gpu_s"].values())
    notes = {"sample": f"HBM-bound: {_sig(st['dec']['bytes_per_token'])}B read per token "
                       f"(batch {st['dec']['batch']} per GPU)",
             "score": "FLOP-bound (prefill); bytes: ten teachers' weights once + KV written",
             "update": f"FLOP-bound; bytes: AdamW's {OPT_BYTES_PER_PARAM} B/param once a step (activations not counted)"}
    rows = [[k, _sig(st["flops"][k]) + "FLOP", _sig(st["bytes"][k]) + "B", _n(st["gpu_s"][k] / 3600, 1),
             f"{st['gpu_s'][k] / tot:.0%}", notes[k]] for k in st["gpu_s"]]
    rows.append(["step", _sig(sum(st["flops"].values())) + "FLOP", _sig(sum(st["bytes"].values())) + "B",
                 _n(tot / 3600, 1), "100%", f"{_n(st['gen'] / 1e6, 1)}M student tokens, {_n(st['pos'] / 1e6, 1)}M positions"])
    return _table(["phase", "FLOPs", "HBM bytes moved (lower bound)", "GPU-hours", "share", "what bounds it"], rows)


def t_payload() -> str:
    st = opd_step_8b()
    teacher_rate = 1 / prefill_gpu_s(QWEN3_8B, (OPD.prompt_len + OPD.resp_len) / 2)  # positions/s per teacher GPU
    rows = []
    for name, b, how in payloads(QWEN3_8B.vocab):
        glm = b if "top" in name or "sampled" in name else b // QWEN3_8B.vocab * GLM45.vocab
        rows.append([name, how, _n(b), _n(glm), _sig(b * st["gen"]) + "B",
                     f"{b * teacher_rate / 1e9:.2f}", f"{b * teacher_rate / IB_BW:.1%}",
                     f"{b * teacher_rate / NVLINK_BW:.1%}"])
    hid = QWEN3_8B.hidden * 2
    rows.append(["last hidden state, bf16 (NeMo-RL #3978)", "hidden x 2 B", _n(hid), _n(GLM45.hidden * 2),
                 _sig(hid * st["gen"]) + "B", f"{hid * teacher_rate / 1e9:.2f}", f"{hid * teacher_rate / IB_BW:.1%}",
                 f"{hid * teacher_rate / NVLINK_BW:.1%}"])
    return _table(["teacher output", "bytes", "B / token, vocab 151,936 (Qwen3)", "B / token, vocab 151,552 (GLM-4.5)",
                   "one 8B OPD step", "GB/s out of one 8B teacher GPU", "of its 400 Gb/s NIC", "of its NVLink"], rows)


def stages(s: Shape) -> list[dict]:
    """GPU-hours, GPUs and teacher actors per stage for ten experts of `s` (student = the base's shape)."""
    out = []
    rl = rollout_gpu_s(s, RL, relogprob=True)
    rl_gpus = max(GPUS_PER_NODE, 64 if s.moe else GPUS_PER_NODE)  # one node per 8B expert; slime's 64 H100 for GLM
    out.append({"stage": "expert RL training (x10)", "gpu_h": N_EXPERTS * sum(rl.values()) / 3600,
                "gpus": N_EXPERTS * rl_gpus, "actors": "-", "split": rl})
    val = Rollouts(1, int(EVAL.prompts * SEARCH_VAL_FRACTION), 1, EVAL.prompt_len, EVAL.resp_len)
    score_one = sum(rollout_gpu_s(s, val, trains=False).values())
    merge_s = (N_EXPERTS + 1) * s.weight_bytes() / DISK_BW  # read ten experts + base, per candidate
    eng = engine_gpus(s)
    workers = 8 if not s.moe else 4
    out.append({"stage": f"merge search ({SEARCH_TRIALS} candidates)",
                "gpu_h": SEARCH_TRIALS * (score_one + eng * merge_s) / 3600, "gpus": workers * eng, "actors": "-",
                "split": {"merge": SEARCH_TRIALS * eng * merge_s, "score": SEARCH_TRIALS * score_one}})
    opd = rollout_gpu_s(s, OPD, teacher=s)
    gpus = 32 if not s.moe else 256
    tg = teacher_gpus(s)
    held = max(N_EXPERTS * tg, math.ceil(gpus * opd["score"] / sum(opd.values()) / tg) * tg)
    gpus = max(gpus, held + eng)
    # teachers on their own GPUs, sampling and update on the rest, overlapped: the slower side sets the wall
    wall = max(opd["score"] / held, (opd["sample"] + opd["update"]) / (gpus - held))
    out.append({"stage": "OPD consolidation", "gpu_h": gpus * wall / 3600, "gpus": gpus,
                "actors": f"{held // tg} ({tg} GPU{'s' if tg > 1 else ''} each; {opd['score'] / (held * wall):.0%} busy)",
                "split": opd})
    test = TEST_MODELS * sum(rollout_gpu_s(s, EVAL, trains=False).values())
    out.append({"stage": f"test scoring ({TEST_MODELS} models)", "gpu_h": test / 3600, "gpus": workers * eng,
                "actors": "-", "split": {}})
    return out


def t_stages() -> str:
    rows = []
    for s in (QWEN3_8B, GLM45):
        for st in stages(s):
            split = st["split"]
            tot = sum(split.values()) or 1
            shares = " / ".join(f"{k} {v / tot:.0%}" for k, v in split.items()) if split else "decode-bound"
            rows.append([s.name, st["stage"], _n(st["gpu_h"]), str(st["gpus"]), _n(st["gpus"] / GPUS_PER_NODE),
                         _n(st["gpu_h"] / st["gpus"], 1), st["actors"], shares])
    return _table(["model", "stage", "GPU-hours", "GPUs", "nodes", "wall hours", "teacher actors per student",
                   "where the GPU time goes"], rows)


def tm_check() -> dict:
    """Thinking Machines: OPD 1,800 GPU-hours, 32B teacher -> 8B student. The model's GPU-hours for OPD's
    batch shape, and the student tokens 1,800 GPU-hours buy at the model's per-token cost."""
    g = rollout_gpu_s(QWEN3_8B, OPD, teacher=QWEN3_32B)
    per_token = sum(g.values()) / OPD.resp_tokens()
    return {"gpu_h": sum(g.values()) / 3600, "tokens_for_1800": 1800 * 3600 / per_token, "per_token_us": per_token * 1e6}


def phase_seconds(student: Shape, r: Rollouts, gpus: dict, teacher: Shape | None = None, gpu: Gpu = H100,
                  engine: int = 1) -> dict:
    """Wall seconds per phase of one synchronous step when each phase has `gpus[phase]` GPUs to itself."""
    seq = r.prompt_len + r.resp_len
    dec = decode(student, r.prompt_len + r.resp_len / 2, engine, gpu)
    out = {"sample": r.seqs * r.resp_len * dec["gpu_s_per_token"] / gpus["sample"]}
    scorer = teacher or student
    out["score"] = r.seqs * seq * prefill_gpu_s(scorer, seq / 2, gpu) / gpus["score"]
    out["update"] = r.seqs * seq * train_gpu_s(student, seq / 2, gpu) / gpus["update"]
    return out


# marin#6218 OPD base cell, as published: 64 prompts x 8, generation cap 1,024, 2 nodes x 4 A100-64GB, teacher
# Qwen3-32B on vLLM TP2, student Qwen3-1.7B with 4 vLLM engines TP1; 1,461 s a step, 95.7% teacher scoring,
# generate 8-24 s, train 38-91 s. Prompt and mean answer lengths are assumptions (gsm8k; answers under the cap).
MARIN_OPD = Rollouts(steps=1, prompts=64, samples=8, prompt_len=256, resp_len=512)
MARIN_OPD_PUBLISHED = {"step": 1461.0, "score_share": 0.957, "sample": (8, 24), "update": (38, 91)}
# marin#8653 Qwen3-235B-A22B GRPO, as published: 256 prompts x 16, 2,048 input + 8,192 generation, 55% of samples
# at the cap; 8 policy nodes (64 GPUs, FSDP2, EP 1, CPU offload) + 4 engines TP8 (32 GPUs); per-step means:
# generate 5h26m, policy_train 2h51m, fwd_logprobs 36m37s. Prompt length and uncapped answers' mean are assumptions.
MARIN_235B = Rollouts(steps=1, prompts=256, samples=16, prompt_len=256,
                      resp_len=round(0.55 * 8192 + 0.45 * 4096))
MARIN_235B_PUBLISHED = {"sample": 5 * 3600 + 26 * 60, "update": 2 * 3600 + 51 * 60, "score": 36 * 60 + 37}


def marin_as_run() -> dict:
    opd = phase_seconds(QWEN3_1_7B, MARIN_OPD, {"sample": 4, "score": 2, "update": 4}, teacher=QWEN3_32B,
                        gpu=A100_64)
    rl = phase_seconds(QWEN3_235B, MARIN_235B, {"sample": 32, "score": 64, "update": 64}, engine=8)
    return {"opd": opd, "opd_share": opd["score"] / sum(opd.values()),
            "opd_teacher_mfu": MFU["dense"]["prefill"] * opd["score"]
            / (MARIN_OPD_PUBLISHED["step"] * MARIN_OPD_PUBLISHED["score_share"]),
            "rl": rl, "rl_share": {k: v / sum(rl.values()) for k, v in rl.items()},
            "rl_published_share": {k: v / sum(MARIN_235B_PUBLISHED.values()) for k, v in MARIN_235B_PUBLISHED.items()}}


def slime_check() -> dict:
    tot = GLM45.params()[0]
    return {"adam_gpus": math.ceil(tot * TRAIN_STATE_BYTES / (HBM_BYTES * MEM_FRACTION)),
            "offload_gpus": math.ceil(tot * 4 / (HBM_BYTES * MEM_FRACTION)),
            "decode": decode(GLM45, RL.prompt_len + RL.resp_len / 2, 32)}


def t_checks() -> str:
    m, t, sl = marin_as_run(), tm_check(), slime_check()
    o, pub = m["opd"], MARIN_OPD_PUBLISHED
    teacher_pub = pub["step"] * pub["score_share"]
    rl, rlp = m["rl"], MARIN_235B_PUBLISHED
    rl8 = rollout_gpu_s(QWEN3_8B, RL, relogprob=True)
    opd8 = rollout_gpu_s(QWEN3_8B, OPD, teacher=QWEN3_32B)
    per_rl = sum(rl8.values()) / RL.resp_tokens()
    per_opd = sum(opd8.values()) / OPD.resp_tokens()
    rows = [
        ["marin#6218 OPD as run: 32B teacher -> 1.7B student, 8 A100-64GB (teacher on 2)",
         f"teacher scoring {pub['score_share']:.1%} of {pub['step']:,.0f} s ({teacher_pub:,.0f} s); generate "
         f"{pub['sample'][0]}-{pub['sample'][1]} s; train {pub['update'][0]}-{pub['update'][1]} s",
         f"{m['opd_share']:.0%}: teacher {o['score']:.0f} s, generate {o['sample']:.0f} s, train {o['update']:.0f} s",
         f"share within {(pub['score_share'] - m['opd_share']) * 100:.0f} points, but every phase is slower than "
         f"modelled: the teacher {teacher_pub / o['score']:.0f}x ({m['opd_teacher_mfu']:.1%} MFU), generation "
         f"{pub['sample'][0] / o['sample']:.1f}-{pub['sample'][1] / o['sample']:.1f}x, training "
         f"{pub['update'][0] / o['update']:.1f}-{pub['update'][1] / o['update']:.1f}x"],
        ["marin#8653 GRPO as run: Qwen3-235B-A22B, 96 H100 (32 for generation)",
         "generate / logprobs / train: " + " / ".join(f"{m['rl_published_share'][k]:.0%}" for k in ("sample", "score", "update"))
         + f" of {sum(rlp.values()) / 3600:.1f} h",
         " / ".join(f"{m['rl_share'][k]:.0%}" for k in ("sample", "score", "update")) + f" of {sum(rl.values()) / 3600:.1f} h",
         "generation is the largest phase in both; the published phases take "
         + " / ".join(f"{rlp[k] / rl[k]:.0f}x" for k in ("sample", "score", "update")) + " the model's time"],
        ["GLM-4.5 RL on H100s", "64 H100, TP8 PP4 CP2 EP16, CPU Adam (slime's GLM-4.5 example); 256 H100 is its "
         "GLM-5.2 744B example", f"Adam state needs {sl['adam_gpus']} GPUs; bf16 weights + grads "
         f"{sl['offload_gpus']}", "64 fits only with Adam offloaded to the CPU, which is what slime does"],
        ["GLM-4.5 decode, 32-GPU engine (slime's rollout engine size)", "-",
         f"{1 / sl['decode']['gpu_s_per_token']:,.0f} tokens/s per GPU, batch {sl['decode']['batch']:,}",
         f"all-to-all is {sl['decode']['a2a_share']:.0%} of a decode step"],
        ["OPD GPU-hours, 32B teacher -> 8B student", "1,800 (Thinking Machines, NOTES.md)",
         f"{_n(t['gpu_h'])} for 200 x 512 x 4 x 4k tokens",
         f"1,800 GPU-hours buys {t['tokens_for_1800'] / 1e9:.1f}B student tokens at the model's cost"],
        ["RL / OPD cost per student token (8B student; 32B teacher)", "about 10x per run (17,920 / 1,800)",
         f"{per_rl / per_opd:.2f}x", f"an OPD token costs {per_opd / per_rl:.1f}x an RL token here (a 32B "
         "teacher forward against an 8B old-policy one): the 10x must be fewer tokens, an input here"],
    ]
    return _table(["check", "published", "this model", "reading"], rows)


def t_derived() -> str:
    """Figures the prose quotes that no other table shows."""
    s, r = QWEN3_8B, OPD
    ctx, seq = r.prompt_len + r.resp_len / 2, (r.prompt_len + r.resp_len) / 2
    d = decode(s, ctx, engine_gpus(s))
    pf, tr = prefill_gpu_s(s, seq), train_gpu_s(s, seq)
    flop_ratio = QWEN3_32B.fwd_flops(seq) / (3 * QWEN3_1_7B.fwd_flops(seq))
    full = {n: b for n, b, _ in payloads(s.vocab)}
    merge_bytes = (N_EXPERTS + 1) * GLM45.weight_bytes()
    glm52_total = 744e9  # published total of GLM-5.2 (slime's 256-H100 example); its shape is not modelled
    rows = []
    for shape in (QWEN3_8B, GLM45):
        st = stages(shape)
        tot = sum(x["gpu_h"] for x in st)
        rows.append([f"{shape.name}: expert RL's share of all GPU-hours; OPD / expert RL",
                     f"{st[0]['gpu_h'] / tot:.0%}; {st[2]['gpu_h'] / st[0]['gpu_h']:.1%}"])
    rows += [
        ["OPD consolidation, compute / reserved GPU-hours (teachers idle between requests): 8B; GLM-4.5",
         "; ".join(f"{sum(rollout_gpu_s(m, OPD, teacher=m).values()) / 3600:,.0f} / {stages(m)[2]['gpu_h']:,.0f}"
                   for m in (QWEN3_8B, GLM45))],
        ["8B decode: achieved MFU; GPU time per token against a prefill / a training token",
         f"{d['flops_per_token'] / d['gpu_s_per_token'] / H100_BF16_FLOPS:.1%}; "
         f"{d['gpu_s_per_token'] / pf:.1f}x / {d['gpu_s_per_token'] / tr:.1f}x"],
        ["8B: AdamW state traffic per step on one GPU's HBM", f"{OPT_BYTES_PER_PARAM * s.params()[0] / (HBM_BW * BW_EFF):.2f} s"],
        ["8B: weight sync to samplers over one node's 8 NICs", f"{s.weight_bytes() / (GPUS_PER_NODE * IB_BW):.2f} s"],
        ["bf16 full vocabulary / top-256; fp32 full vocabulary / bf16 hidden state (width 4096)",
         f"{full['full vocabulary, bf16'] / full['top-256 (int32 id + fp32 logprob)']:.0f}x; "
         f"{full['full vocabulary, fp32'] / (s.hidden * 2):.1f}x"],
        ["GLM-4.5: ten teachers resident (GPUs); one merge candidate's reads (base + ten experts)",
         f"{N_EXPERTS * teacher_gpus(GLM45)}; {merge_bytes / 1e12:.1f} TB in {merge_bytes / DISK_BW / 60:.0f} min"],
        ["32B forward / 1.7B forward + backward, FLOPs per token", f"{flop_ratio:.1f}"],
        ["GLM-5.2 (744B): GPUs to hold mixed-precision Adam state",
         f"{math.ceil(glm52_total * TRAIN_STATE_BYTES / (HBM_BYTES * MEM_FRACTION))}"],
        ["lab: fp32 weights; fp32 KV per token",
         f"{LAB.params()[0] * 4 / 1e6:.1f} MB; {LAB.kv_bytes_per_token(4):,} B"],
    ]
    return _table(["figure", "value"], rows)


TABLES = {"constants": t_constants, "models": t_models, "lab": t_lab, "opd_step": t_opd_step,
          "payload": t_payload, "stages": t_stages, "checks": t_checks,
          "derived": t_derived}


def render(doc: str) -> str:
    """`doc` with every `<!-- cost_model:NAME -->` ... `<!-- /cost_model:NAME -->` block regenerated."""
    for name, fn in TABLES.items():
        pat = re.compile(rf"(<!-- cost_model:{name} -->\n)(?:.*?\n)?(<!-- /cost_model:{name} -->)", re.S)
        if not pat.search(doc):
            raise SystemExit(f"{DOC}: no <!-- cost_model:{name} --> block; add the markers, then run --write")
        doc = pat.sub(lambda m, t=fn(): m.group(1) + t + "\n" + m.group(2), doc)
    return doc


def lab_lengths() -> tuple[float, float]:
    from opd.capabilities import get_capability

    p = a = 0.0
    for c in LAB10:
        items = get_capability(c).items("train", 500, seed=0)
        p += sum(len(i.prompt) for i in items) / len(items) / len(LAB10)
        a += sum(len(i.answer) + 1 for i in items) / len(items) / len(LAB10)
    return p, a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"regenerate the tables in {DOC.name}")
    ap.add_argument("--lab-lengths", action="store_true", help="print the lab10 items' mean prompt/answer lengths")
    args = ap.parse_args()
    if args.lab_lengths:
        p, a = lab_lengths()
        print(f"lab10 train items: prompt {p:.2f} chars, answer + newline {a:.2f}")
        return
    if args.write:
        from opd.io import atomic_write_text

        atomic_write_text(DOC, render(DOC.read_text()))
        print(f"wrote {DOC}")
        return
    for name, fn in TABLES.items():
        print(f"## {name}\n\n{fn()}\n")


if __name__ == "__main__":
    sys.exit(main())
