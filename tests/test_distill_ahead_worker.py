"""opd.distill.ahead: the thread and the forked process run calls one at a time; the process reads the
parent's shared-memory tensors as they are at each call, reports its errors, and ends when closed."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from opd.distill.ahead import ProcessAhead, ThreadAhead, start_ahead


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_each_call_sees_the_shared_weights_as_they_are_then(worker):
    w = torch.zeros(4)
    w.share_memory_()

    def read(scale):
        return (w * scale).tolist(), os.getpid()

    ahead = start_ahead(worker, read, threads=1)
    try:
        first, pid = ahead.submit(2.0).result()
        w.copy_(torch.arange(4.0))  # the parent updates the weights between calls
        second, _ = ahead.submit(3.0).result()
    finally:
        ahead.close()
    assert first == [0.0] * 4 and second == [0.0, 3.0, 6.0, 9.0]
    assert (pid != os.getpid()) == (worker == "process")
    assert isinstance(ahead, ProcessAhead if worker == "process" else ThreadAhead)


def test_a_process_error_comes_back_with_its_traceback_and_the_worker_goes_on():
    def fn(x):
        if x < 0:
            raise ValueError(f"negative {x}")
        return x + 1

    ahead = ProcessAhead(fn, threads=1)
    try:
        with pytest.raises(RuntimeError, match=r"worker process failed:(.|\n)*ValueError: negative -1"):
            ahead.submit(-1).result()
        assert ahead.submit(1).result() == 2
    finally:
        ahead.close()
    assert not multiprocessing.active_children()


def test_close_with_a_call_in_flight_does_not_wait_for_it():
    ahead = ProcessAhead(lambda: time.sleep(60), threads=1)
    ahead.submit()
    t = time.time()
    ahead.close()
    assert time.time() - t < 10 and not multiprocessing.active_children()


def test_a_killed_worker_is_a_clear_error_not_a_hang():
    ahead = ProcessAhead(lambda: time.sleep(60), threads=1)
    pending = ahead.submit()
    ahead._proc.kill()
    with pytest.raises(RuntimeError, match="worker process died"):
        pending.result()
    ahead.close()


def test_a_forked_worker_computes_with_torch_after_the_parent_did():
    # torch has run ops (and set its thread count) in the parent before the fork; the child must too
    torch.set_num_threads(1)
    a = torch.randn(64, 64)
    expect = (a @ a).sum().item()
    ahead = ProcessAhead(lambda: (a @ a).sum().item(), threads=1)
    try:
        assert ahead.submit().result() == expect
    finally:
        ahead.close()
