"""glibc's malloc told to keep the memory a forward pass frees, for the next one.

torch's CPU tensors come from malloc. By default glibc hands a block of 128 KiB or more
straight back to the kernel when it is freed (a block first served by mmap, or the top of a
heap past its trim threshold), and the next forward pass, allocating the same activations
again, faults every page of them back in. On 2 cores (a VM whose host takes freed pages
back, which makes a fault dear), a 1,024-token prefill of SmolLM2-135M in float32 took
110,889 page faults per call on the main thread (848-900 ms, median of 7) and 26,944 on
another thread (783 ms), and 0 faults with the thresholds below (686-756 and 667 ms). In
the served multi-turn benchmark one pass each moved within its noise. vLLM's CPU guide
preloads tcmalloc for the same reason; this keeps glibc and changes two of its settings:

    M_MMAP_THRESHOLD  32 MiB, glibc's largest: blocks up to this size come from the heap
                      (reused), not from a fresh mapping per tensor
    M_TRIM_THRESHOLD  1 GiB: free memory at a heap's top stays with the process up to this

Setting either also stops glibc's dynamic thresholds. Process-wide, so the engine sets them
once; a libc other than glibc is left as it is.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Set the two thresholds; whether glibc took both (False elsewhere: nothing changed)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: glibc's
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    took = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not took:
        logger.debug("glibc did not take the malloc thresholds: its defaults stay")
    return took
