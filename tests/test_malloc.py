"""hicache.memory.malloc: with glibc's thresholds set, a tensor's freed memory serves the next
tensor of its size without the kernel faulting its pages in again."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from hicache.memory.malloc import MMAP_THRESHOLD_BYTES, keep_freed_memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
TENSOR_BYTES = 16 << 20  # past glibc's default 128 KiB mmap threshold, within ours
PAGE_BYTES = resource.getpagesize()
WARM_UP = 8


def faults_touching(nbytes: int) -> int:
    """Page faults taken while a new tensor of `nbytes` is written once and freed."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_tensors_are_reused_without_faults() -> None:
    assert keep_freed_memory()
    assert TENSOR_BYTES < MMAP_THRESHOLD_BYTES
    for _ in range(WARM_UP):  # the heap grows until a freed tensor fits its successor
        faults_touching(TENSOR_BYTES)
    pages = TENSOR_BYTES // PAGE_BYTES
    again = [faults_touching(TENSOR_BYTES) for _ in range(3)]
    assert max(again) < pages // 16, (again, pages)  # without the setting: every page
