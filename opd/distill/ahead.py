"""Where `sample_ahead` samples the next batch while the update runs: a thread of this process, or a
forked worker process (the shape of a rollout server beside the trainer, with the weights pushed to it
after every update).

Both run one call at a time and hand back a `.result()`: `ThreadAhead` through
`concurrent.futures`, `ProcessAhead` through a pipe to a child forked once at the start. A forked
child inherits the sampler, the teachers and the prompt sampler without pickling them; the
sampler's weights live in shared memory (`Module.share_memory`), so the parent's
`load_state_dict` into them before each call is what the child samples from. Only the call's
arguments and its result cross the pipe (pickled; the batch is a few hundred KB).

Why a process: sampling (transformers `generate`, one Python-level step per token) and the update
(a forward and backward of many small ops) both spend much of their time in Python, and two
threads share one GIL. On the ten-teacher lab the bench's tuned step (bench/bench_opd_throughput.py
--runs tuned --prompts 64 --group 4 --updates 4 --tuned-lr 1.6e-4 --tokens 40000) ran 3,369-3,470 student tokens/s with a process against
2,944-2,989 with a thread (README, "OPD throughput").
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch

Worker = Literal["thread", "process"]


class ThreadAhead:
    """`fn` runs in one background thread of this process."""

    def __init__(self, fn: Callable):
        self._fn = fn
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="opd-sample-ahead")

    def submit(self, *args) -> Future:
        return self._pool.submit(self._fn, *args)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


class _Pending:
    """The result of the call in flight in a `ProcessAhead` worker."""

    def __init__(self, conn):
        self._conn, self.done, self._value = conn, False, None

    def result(self):
        if not self.done:
            try:
                kind, payload = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                raise RuntimeError("the sample-ahead worker process died (killed, or out of memory?); rerun "
                                   "the same command to resume from the last checkpoint") from None
            if kind == "error":
                raise RuntimeError(f"the sample-ahead worker process failed:\n{payload}")
            self.done, self._value = True, payload
        return self._value


def _serve(fn: Callable, conn, parent_end, threads: int) -> None:
    """The child: run each call that arrives, send back its result (or the error's traceback), and
    end when the parent closes the pipe or sends None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends this child
    parent_end.close()
    torch.set_num_threads(threads)
    while True:
        try:
            args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if args is None:
            return
        try:
            out = ("ok", fn(*args))
        except BaseException:
            out = ("error", traceback.format_exc())
        conn.send_bytes(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))


class ProcessAhead:
    """`fn` runs in a child forked now, with `threads` torch threads. Everything `fn` reads is the
    parent's state at this moment, except `shared`'s tensors, moved to shared memory here (the caller
    keeps writing into them), and the arguments of each call. CPU tensors only: a CUDA context does
    not survive a fork."""

    def __init__(self, fn: Callable, threads: int, shared: torch.nn.Module | None = None):
        if "fork" not in multiprocessing.get_all_start_methods():
            raise RuntimeError("sample_worker 'process' forks a worker, which this platform cannot do: "
                               "use sample_worker: thread")
        if shared is not None:
            if next(shared.parameters()).device.type != "cpu":
                raise ValueError("sample_worker 'process' forks a CPU sampler; with a GPU student use "
                                 "sample_worker: thread (or an SGLang server)")
            shared.share_memory()  # the child reads what the parent writes into these tensors
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(fn, child, self._conn, threads), daemon=True,
                                 name=f"opd-sample-ahead-{os.getpid()}")
        self._proc.start()
        child.close()
        self._pending: _Pending | None = None

    def submit(self, *args) -> _Pending:
        self._conn.send_bytes(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
        self._pending = _Pending(self._conn)
        return self._pending

    def close(self) -> None:
        """End the child: at once if a call is in flight (its result is not wanted), else once it has read
        the stop message."""
        if self._pending is None or self._pending.done:
            try:
                self._conn.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass  # the child is gone already
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._conn.close()


def start_ahead(worker: Worker, fn: Callable, threads: int, shared: torch.nn.Module | None = None
                ) -> ThreadAhead | ProcessAhead:
    """`fn`'s worker; a process shares `shared`'s tensors with it (a thread shares everything)."""
    return ThreadAhead(fn) if worker == "thread" else ProcessAhead(fn, threads, shared)
