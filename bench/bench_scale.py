"""Peak memory and seconds per merged candidate as the number of experts grows (docs/memory.md).

    python bench/bench_scale.py --quick          # 0.1B, N = 4 and 10 (2 processes at once)
    python bench/bench_scale.py                  # 0.1B and 0.5B, N = 4, 10 and 20
    python bench/bench_scale.py --tiny           # pico models, N = 2 and 3 (the test's fast path)

A synthetic Qwen3 base of the size (random weights from a transformers Qwen3Config, Qwen3's vocabulary)
and N experts = base + a random rank-4 update + 1% of the entries moved, per tensor, written as
safetensors one tensor run at a time (mergekit's TensorWriter), so building them does not hold N
models; `--jobs` processes write them (each expert from its own generator: the same bytes either
way). `--dir` keeps them for the next run (then nothing is rebuilt). Each (method, N) merges one
candidate in a process of its own, as the search does when the candidate is over `memory_budget`: the
inputs read tensor by tensor from disk (opd.weights.lazy), the candidate written to disk tensor by
tensor. The process reports its peak RSS (VmHWM of /proc/self/status) over the merge, and for RegMean,
separately, over its statistics pass (`prepare`; freed heap is returned with malloc_trim and the peak
reset in between by writing 5 to /proc/self/clear_refs). RegMean's statistics come from opd's own
path (opd.weights.regmean.prepare) on a small calibration batch: 8 train prompts of the lab's `add`
capability per expert, prompt tokens only (inputs=prompt).

The processes are forked from a fork server that imported torch, mergekit and opd once (`--start
spawn`: a fresh interpreter each, which also counts in its peak the pages its imports touched and the
merge does not, about 90 MiB). `--jobs J` runs J of them at once, longest first (default 2 with
`--quick`, else 1): each still has one torch thread and its own VmHWM, but its seconds are then
measured with J processes busy, slower than alone on a machine whose cores are shared.

Prints the torch thread count, load and jobs, one line per (method, N) as each finishes (start_MiB:
the resident set when the merge starts; cpu_s: the merge's CPU seconds, which the machine's load
changes less than its wall seconds), the ratios N_max/N_min of peak RSS and of seconds, the wall
time with the CPU seconds of all merges and statistics passes (on J idle cores the rows take about
their sum / J), and last `peak_rss_over_model: X.XX`: the largest merge peak RSS over one model's size (float32
bytes) among the methods and N it ran.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

# name -> Qwen3 shape; head_dim 64 (pico's 16). The two sizes keep Qwen3's own vocabulary (151,936, tied)
# and a narrow, deep stack: the embedding is the largest tensor, as in Qwen3-0.6B (a quarter of it
# there, 38% / 16% here), and the blocks' matrices are small enough that the SVDs of TSV-M and Iso-CTS
# take seconds, not minutes, per expert on one core. Tokens beyond the lab's char tokenizer are unused.
SIZES = {
    "pico": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, vocab_size=128),
    "0.1B": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=80, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=151936),
    "0.5B": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=134, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, vocab_size=151936),
}
METHODS = {
    "linear": ({}, {"weight": 1.0}),
    "ties": ({}, {"weight": 1.0, "density": 0.3}),
    "tsv_m": ({"alpha": 1.0}, {"weight": 1.0}),
    "iso_cts": ({"alpha": 1.0, "common_space_fraction": 0.8}, {"weight": 1.0}),
    "regmean": ({"alpha": 0.9, "prompts": 8, "inputs": "prompt"}, {"weight": 1.0}),
}

# method -> (seconds, seconds per expert) per candidate, about (the 0.1B `--quick` rows of
# docs/results/scale.md): only the order --jobs starts the runs in, longest first
COST = {"linear": (2, 0.3), "ties": (0, 5.5), "tsv_m": (10, 5.7), "iso_cts": (17, 5.5), "regmean": (20, 3.7)}


def build(root: Path, size: str, n: int, dtype: torch.dtype, seed: int = 0,
          jobs: int = 1) -> tuple[Path, list[Path], int]:
    """root/base and root/e<i> (i < n), reused when already there; returns (base, experts, parameters).
    With jobs > 1 the missing experts are written by that many forked processes: each expert draws
    from its own generator, so the files are the same bytes whichever process writes them."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from opd.lab.tokenizer import build_char_tokenizer
    from opd.weights.lazy import LazyStateDict

    tok = build_char_tokenizer()
    base = root / "base"
    if not (base / "config.json").exists():
        cfg = Qwen3Config(**SIZES[size], max_position_embeddings=256, tie_word_embeddings=True,
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.save_pretrained(base)
        tok.save_pretrained(base)
        del model
    experts = [root / f"e{i}" for i in range(n)]
    todo = [(root, size, i, dtype, seed) for i in range(n) if not (experts[i] / "manifest.json").exists()]
    if jobs > 1 and len(todo) > 1:
        # fork: the workers start with torch, mergekit and transformers already imported
        with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=multiprocessing.get_context("fork")) as pool:
            list(pool.map(_build_expert, *zip(*todo)))
    else:
        for args in todo:
            _build_expert(*args)
    base_sd = LazyStateDict(base, dtype=None)
    params = sum(base_sd.numel(k) for k in base_sd)
    return base, experts, params


def _build_expert(root: Path, size: str, i: int, dtype: torch.dtype, seed: int) -> None:
    """root/e<i> from root/base: base + `_delta` per tensor, drawn from generator seed·1000 + i + 1,
    written one tensor at a time (mergekit's TensorWriter, 64 MiB shards) to a temporary name, then
    renamed."""
    from mergekit.io.tensor_writer import TensorWriter

    from opd.lab.tokenizer import build_char_tokenizer
    from opd.weights.lazy import LazyStateDict

    torch.set_num_threads(1)
    base = root / "base"
    base_sd = LazyStateDict(base, dtype=None)
    tmp = root / f".e{i}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    g = torch.Generator().manual_seed(seed * 1000 + i + 1)
    names = list(base_sd)
    with TensorWriter(str(tmp), max_shard_size=64 << 20) as w:
        for lo in range(0, len(names), 64):  # a file open per 64 tensors, not per tensor (its header parse)
            group = base_sd.read(names[lo:lo + 64])
            for k in list(group):
                b = group.pop(k)
                w.save_tensor(k, (b.float() + _delta(b, g)).to(dtype))
                del b
    for f in ("config.json", "generation_config.json"):
        if (base / f).exists():
            shutil.copy(base / f, tmp / f)
    build_char_tokenizer().save_pretrained(tmp)
    # what opd.weights.regmean reads: the capability its prompts come from; the hash keys its cache
    (tmp / "manifest.json").write_text(json.dumps({
        "name": f"e{i}", "capability": "add", "content_hash": f"synthetic-{size}-{seed}-{i}",
        "base": {"path": str(base), "content_hash": f"synthetic-{size}-{seed}"}}))
    tmp.rename(root / f"e{i}")


def _delta(b: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """An expert's update of base tensor `b`: rank 4 (matrices) plus 1% of the entries moved, drawn
    as random positions (no full-size random mask: building 20 experts takes seconds per expert)."""
    scale = b.float().std().clamp_min(1e-3)
    if b.ndim == 2:
        u = torch.randn(b.shape[0], 4, generator=g)
        v = torch.randn(4, b.shape[1], generator=g)
        delta = (0.002 * scale) * (u @ v)
    else:
        delta = torch.zeros(b.shape)
    n = max(1, b.numel() // 100)
    idx = torch.randint(b.numel(), (n,), generator=g)
    delta.view(-1).index_add_(0, idx, (0.01 * scale) * torch.randn(n, generator=g))
    return delta


def measure(method: str, ns: list[int], root: Path) -> Iterator[dict]:
    """One candidate of `method` over the first n experts, for each n in `ns`: a dict each (peak and
    start bytes, seconds)."""
    from opd.weights.lazy import LazyStateDict
    from opd.weights.merge import Candidate, _prepare, merge_candidate

    base = root / "base"
    for n in ns:
        experts = [root / f"e{i}" for i in range(n)]
        shared, per = METHODS[method]
        cand = Candidate(strategy=method, shared=shared, per_model={e.name: dict(per) for e in experts})
        paths = {e.name: str(e) for e in experts}
        base_sd = LazyStateDict(base)
        expert_sds = {e.name: LazyStateDict(e, names=list(base_sd)) for e in experts}
        _reset_peak()
        t, cpu = time.perf_counter(), time.process_time()
        _prepare(method, paths, shared, cand.per_model, str(base))  # RegMean's statistics; others: nothing
        prepare_s, prepare_cpu = time.perf_counter() - t, time.process_time() - cpu
        prepare_peak = _hwm()
        _trim_heap()  # what the statistics pass freed goes back to the system before the merge is measured
        start = _reset_peak()  # the merge's own peak from here
        out = Path(tempfile.mkdtemp(prefix="cand-", dir=root))
        t, cpu = time.perf_counter(), time.process_time()
        merged = merge_candidate(cand, str(base), paths, base_sd, expert_sds, out_dir=out)
        merge_s, merge_cpu = time.perf_counter() - t, time.process_time() - cpu
        assert len(merged) == len(base_sd)
        shutil.rmtree(out)
        yield {"n": n, "peak": _hwm(), "start": start, "merge_s": merge_s, "cpu_s": merge_cpu, "prepare_s": prepare_s, "prepare_cpu": prepare_cpu,
               "prepare_peak": prepare_peak}


def _child(conn, method: str, ns: list[int], root: Path, threads: int, log: Path) -> None:
    """A measuring process (forked from the fork server): its rows, or its traceback, sent on `conn`;
    what it prints (progress bars, warnings) goes to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(threads)
    try:
        conn.send(("rows", list(measure(method, ns, root))))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _trim_heap() -> None:
    """Hand freed heap pages back to the system (glibc's malloc_trim; a no-op elsewhere)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def _reset_peak() -> int:
    """Reset VmHWM to the current resident set (Linux: 5 > clear_refs) and return it, bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _hwm()


def _hwm() -> int:
    """This process's peak resident set since start or the last reset, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


_START = threading.Lock()  # one Process.start at a time: --jobs starts them from threads


def _run_child(ctx, method: str, group: list[int], root: Path, threads: int) -> tuple[str, list[int], list[dict]]:
    """One (method, N group) measurement in a process of its own, forked from `ctx`'s fork server (a
    clean interpreter that has imported torch, mergekit and opd, and merged nothing): (method, group,
    its rows); SystemExit with its traceback or log if it fails."""
    log = root / f"log-{method}-{'-'.join(map(str, group))}.txt"
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, method, group, root, threads, log))
    with _START:
        proc.start()
    send.close()  # the child's end: recv() then sees EOF if the child dies without a word
    try:
        kind, value = recv.recv()
    except EOFError:
        kind, value = "error", None
    proc.join()
    if value is None:
        value = f"exit code {proc.exitcode}; its output:\n{log.read_text()[-3000:] if log.exists() else '(none)'}"
    if kind != "rows":
        raise SystemExit(f"{method} N={group} failed:\n{value}")
    return method, group, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="0.1B, N = 4 and 10")
    ap.add_argument("--tiny", action="store_true", help="pico, N = 2 and 3")
    ap.add_argument("--sizes", nargs="*", default=None, choices=sorted(SIZES))
    ap.add_argument("--n", nargs="*", type=int, default=None)
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--dir", help="where the synthetic models go (kept; default a temporary directory)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="how the synthetic models are stored (bfloat16 halves the disk; 20 experts of 0.5B "
                         "take 40 GB in float32)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="(method, N) processes run at once, and processes building the experts (default 2 "
                         "with --quick, else 1)")
    ap.add_argument("--start", default="forkserver", choices=["forkserver", "spawn"],
                    help="how each (method, N) process starts: forked from a server that imported torch, "
                         "mergekit and opd once (default), or a fresh interpreter")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # The measuring processes are forked from a fork server that imports these once (3-6 s of CPU per
    # process otherwise): each still starts clean, merges one candidate, and has its own VmHWM, which
    # counts the pages of the imported libraries it touches (--start spawn: a fresh interpreter, which
    # counts every page its imports touched, about 90 MiB more).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    ctx = multiprocessing.get_context(args.start)
    if args.start == "forkserver":
        ctx.set_forkserver_preload(["torch", "mergekit.io.tensor_writer", "opd.weights.merge", "opd.weights.regmean"])
        # started now, the server imports those while the experts are built (it is a fresh interpreter,
        # not a fork of this process: what the build leaves here is not in it)
        multiprocessing.forkserver.ensure_running()
    sizes = args.sizes or (["pico"] if args.tiny else ["0.1B"] if args.quick else ["0.1B", "0.5B"])
    ns = args.n or ([2, 3] if args.tiny else [4, 10] if args.quick else [4, 10, 20])
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="opd-bench-scale-"))
    wall = time.perf_counter()
    if args.jobs is None:
        args.jobs = 2 if args.quick else 1
    print(f"torch threads: {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}; "
          f"methods {args.methods}; N {ns}; sizes {sizes}; jobs {args.jobs}; processes start by {args.start}")
    if args.jobs > 1:
        print(f"jobs {args.jobs}: {args.jobs} candidates merge at once, each in its own process with "
              f"{args.threads} torch thread(s) and its own peak RSS; their seconds are with {args.jobs} of them "
              "busy (slower than alone where cores are shared)")
    worst, every = 0.0, []
    try:
        for size in sizes:
            dtype = getattr(torch, args.dtype)  # storage; every merge reads float32
            root = work / size
            t = time.perf_counter()
            base, _, params = build(root, size, max(ns), dtype, jobs=args.jobs)
            model_bytes = 4 * params
            print(f"size {size}: {params / 1e6:.1f}M parameters, one model {model_bytes / 2**20:.0f} MiB in float32 "
                  f"(stored {str(dtype).removeprefix('torch.')}); {max(ns)} experts built in "
                  f"{time.perf_counter() - t:.0f} s; {SIZES[size]}")
            print(f"{'method':<9} {'N':>3} {'start_MiB':>9} {'peak_MiB':>9} {'over_model':>10} {'merge_s':>8} {'cpu_s':>6} {'s_per_expert':>12} "
                  f"{'prepare_s':>9} {'prepare_peak_over_model':>23}")
            rows = {}
            # a process of its own per (method, N), so one measurement does not leak into the next; --tiny
            # (the test's fast path) runs each method's N in one process, peak reset in between
            runs = [(m, [n]) for m in args.methods for n in ns] if not args.tiny else [(m, ns) for m in args.methods]
            if args.jobs > 1:  # longest first, so that the last ones to start are short
                runs.sort(key=lambda run: -sum(COST[run[0]][0] + COST[run[0]][1] * n for n in run[1]))
            with ThreadPoolExecutor(args.jobs) as pool:
                futures = [pool.submit(_run_child, ctx, method, group, root, args.threads) for method, group in runs]
                for fut in as_completed(futures):
                    try:
                        method, group, results = fut.result()
                    except SystemExit:
                        for f in futures:
                            f.cancel()
                        raise
                    for r in results:
                        n = r["n"]
                        rows[method, n] = r
                        every.append(r)
                        over = r["peak"] / model_bytes
                        worst = max(worst, over)
                        print(f"{method:<9} {n:>3} {r['start'] / 2**20:>9.0f} {r['peak'] / 2**20:>9.0f} {over:>10.2f} "
                              f"{r['merge_s']:>8.1f} {r['cpu_s']:>6.1f} {r['merge_s'] / n:>12.2f} {r['prepare_s']:>9.1f} "
                              f"{r['prepare_peak'] / model_bytes:>23.2f}", flush=True)
            lo, hi = min(ns), max(ns)
            for method in args.methods:
                a, b = rows[method, lo], rows[method, hi]
                print(f"ratio {size} {method}: peak RSS N={hi}/N={lo} {b['peak'] / a['peak']:.2f}; "
                      f"seconds N={hi}/N={lo} {b['merge_s'] / a['merge_s']:.2f} (linear in N: {hi / lo:.2f})")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wall {time.perf_counter() - wall:.0f} s; load average {os.getloadavg()[0]:.2f}; CPU seconds of the "
          f"merges {sum(r['cpu_s'] for r in every):.0f}, of the statistics passes "
          f"{sum(r['prepare_cpu'] for r in every):.0f}")
    print(f"peak_rss_over_model: {worst:.2f}")


if __name__ == "__main__":
    main()
