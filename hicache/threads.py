"""Background threads that do torch work beside the forward pass: one OpenMP thread each.

An OpenMP thread pool lives as long as the thread that started it. Each pool beyond the
scheduler thread's adds workers, and once libgomp counts more threads than cores it stops
spinning between parallel regions (its throttled spin count): every op of a forward pass
then waits for its workers to wake. The transfer and storage threads copy pages while the
forward pass has the cores anyway, so they run their ops on themselves alone and start no
pool. The engine itself starts up on a passing thread for the same reason
(`hicache_server.engine.in_passing_thread`). Measured on 2 cores, a server with L1+L2 under 8
streams of 400 tokens: 13.7-16.7 s with the transfer thread on one OpenMP thread, 16.1-24.1
s without (alternating runs).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
BACKGROUND_NICENESS = 19  # work that may wait for idle cores: Linux's lowest priority


@cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs on (the one already loaded), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        name = Path(path).name
        if name.startswith(("libgomp", "libiomp5", "libomp")) and ".so" in name:
            try:
                lib = ctypes.CDLL(path)
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            except (OSError, AttributeError):
                continue
            return lib
    return None


def one_openmp_thread() -> bool:
    """Make torch ops on the calling thread run on it alone (no OpenMP pool of its own).
    Whether that was possible (False: no OpenMP runtime found, e.g. not Linux)."""
    torch.get_num_threads()  # ATen sets this thread's OpenMP threads here, once; then ours
    lib = _openmp()
    if lib is None:
        logger.debug("no OpenMP runtime found: this thread keeps torch's thread count")
        return False
    lib.omp_set_num_threads(1)
    return True


def background_priority(niceness: int = BACKGROUND_NICENESS) -> bool:
    """Make the calling thread's CPU time the cores' leftovers: Linux's SCHED_IDLE policy
    (it runs only when nothing else wants the core, and any other thread that wakes takes
    the core at once) at nice `niceness` (on Linux a thread's policy and nice value are its
    own). Work that may wait, such as writing pages to L3, then never holds up the forward
    pass's threads, which meet at a barrier after every op: a thread that is merely
    lower-priority still runs out its time slice before one of them gets the core back.
    Whether the priority could be lowered (False where the OS has no such call)."""
    if not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(niceness, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError as err:
        logger.debug("cannot lower this thread's priority: %s", err)
        return False
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as err:
            logger.debug("cannot make this thread SCHED_IDLE: %s", err)
    return True
