"""hicache.threads: a background thread's torch ops run on that thread alone, and its
priority can be lowered without touching the others'."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from hicache.threads import BACKGROUND_NICENESS, _openmp, background_priority, one_openmp_thread


@pytest.mark.skipif(_openmp() is None, reason="no OpenMP runtime loaded")
def test_one_openmp_thread_limits_only_the_calling_thread() -> None:
    before = torch.get_num_threads()
    seen: list[tuple[bool, int, torch.Tensor]] = []

    def worker() -> None:
        ok = one_openmp_thread()
        x = torch.arange(1_000_000, dtype=torch.float32)
        seen.append((ok, torch.get_num_threads(), x.sum()))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    ok, threads, total = seen[0]
    assert ok and threads == 1
    assert total.item() == pytest.approx(499999500000.0, rel=1e-6)  # ops still work
    assert torch.get_num_threads() == before  # this thread keeps its count


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities here")
def test_background_priority_lowers_only_the_calling_thread() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[tuple[bool, int]] = []

    def worker() -> None:
        ok = background_priority()
        seen.append((ok, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [(True, max(BACKGROUND_NICENESS, mine))]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
