"""Which attention backend a model runs (`make_attention_backend`), by device and by the
environment switches kept for side-by-side runs:

    HICACHE_CPU_ATTENTION    kernel (default): the C kernel (kernels/src/cpu_attention.c) where
                             it builds; sdpa: TorchAttention
    HICACHE_CUDA_ATTENTION   flashinfer (default): FlashInfer where `flashinfer` imports;
                             cupy: the CuPy decode kernel, SDPA for prefill; sdpa:
                             TorchAttention

Each falls back by itself where its first choice cannot run (no compiler, no AVX-512, no
FlashInfer, no CuPy), and says so in the log.

Threading: any thread (at model load).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from hicache_server.models.attention import (
    AttentionBackend,
    CpuKernelAttention,
    CudaPagedAttention,
    TorchAttention,
)
from hicache_server.models.flashinfer_attention import FlashInferAttention, flashinfer_available
from hicache_server.models.kernels import cpu_attention

logger = logging.getLogger(__name__)

CPU_ATTENTION_ENV = "HICACHE_CPU_ATTENTION"
CPU_ATTENTION_CHOICES = ("kernel", "sdpa")
CUDA_ATTENTION_ENV = "HICACHE_CUDA_ATTENTION"
CUDA_ATTENTION_CHOICES = ("flashinfer", "cupy", "sdpa")


def _choice(env: str, choices: tuple[str, ...]) -> str:
    """`env`'s value, `choices[0]` when unset; ValueError for any other value."""
    choice = os.environ.get(env, choices[0])
    if choice not in choices:
        raise ValueError(f"{env}={choice!r}: expected one of {', '.join(choices)}")
    return choice


def make_attention_backend(device: str | torch.device,
                           kernel_dir: Path | None = None) -> AttentionBackend:
    """On the CPU: CpuKernelAttention where the C kernel builds into `kernel_dir` (None: not
    tried), else TorchAttention. On CUDA: FlashInferAttention where FlashInfer imports, else
    CudaPagedAttention where CuPy does, else TorchAttention. The environment (module
    docstring) picks a later choice."""
    if torch.device(device).type != "cuda":
        choice = _choice(CPU_ATTENTION_ENV, CPU_ATTENTION_CHOICES)
        kernel = (cpu_attention.load(kernel_dir)
                  if kernel_dir is not None and choice == "kernel" else None)
        return TorchAttention() if kernel is None else CpuKernelAttention(kernel)
    choice = _choice(CUDA_ATTENTION_ENV, CUDA_ATTENTION_CHOICES)
    if choice == "sdpa":
        return TorchAttention()
    try:
        import cupy  # noqa: F401  (optional dependency: the `cuda` extra)
    except ImportError:
        logger.warning("CuPy is not installed: decode attention falls back to torch SDPA "
                       "(pip install -e '.[cuda]' for the paged kernel)")
        fallback: AttentionBackend = TorchAttention()
    else:
        fallback = CudaPagedAttention()
    if choice == "flashinfer" and flashinfer_available():
        return FlashInferAttention(fallback)
    return fallback
