"""Which C kernels a model runs on the CPU: the linear kernel (kernels/src/cpu_linear.c) and
the layer's other ops (kernels/src/cpu_layer.c), each for float32 and bfloat16 where it builds,
each switched off by an environment variable for side-by-side runs (the attention kernel's
choice is `hicache_server.models.attention_choice.make_attention_backend`).

Threading: any thread (at model load).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from hicache_server.models.kernels import cpu_layer, cpu_linear
from hicache_server.models.kernels.cpu_layer import CpuLayerKernel
from hicache_server.models.kernels.cpu_linear import CpuLinearKernel

KernelT = TypeVar("KernelT")
KERNEL_DTYPES = cpu_linear.DTYPES  # float32 and bfloat16: every CPU kernel takes both

# The CPU linear kernel by default; `onednn` keeps every Linear on oneDNN (comparisons).
CPU_LINEAR_ENV = "HICACHE_CPU_LINEAR"
CPU_LINEAR_CHOICES = ("kernel", "onednn")


def make_linear_kernel(device: str | torch.device, dtype: torch.dtype,
                       kernel_dir: Path | None) -> CpuLinearKernel | None:
    """The C linear kernel for a float32 or bfloat16 model on the CPU, built into `kernel_dir` (None: not
    tried), unless `HICACHE_CPU_LINEAR` says `onednn`; None leaves the Linears on oneDNN
    (or, on CUDA, on cuBLAS)."""
    return _cpu_kernel(CPU_LINEAR_ENV, CPU_LINEAR_CHOICES, device, dtype, kernel_dir,
                       cpu_linear.load)


# RMSNorm, RoPE and SiLU * up (Gemma's norms and GeGLU) in C by default; `torch` keeps
# torch's ops (comparisons).
CPU_LAYER_OPS_ENV = "HICACHE_CPU_LAYER_OPS"
CPU_LAYER_OPS_CHOICES = ("kernel", "torch")


def make_layer_kernel(device: str | torch.device, dtype: torch.dtype,
                      kernel_dir: Path | None) -> CpuLayerKernel | None:
    """The C kernels of a decoder layer's norms, RoPE and gated MLP, for a float32 or
    bfloat16 model on the CPU, built into `kernel_dir` (None: not tried), unless `HICACHE_CPU_LAYER_OPS`
    says `torch`; None leaves them on torch's ops."""
    return _cpu_kernel(CPU_LAYER_OPS_ENV, CPU_LAYER_OPS_CHOICES, device, dtype, kernel_dir,
                       cpu_layer.load)


def _cpu_kernel(env: str, choices: tuple[str, str], device: str | torch.device,
                dtype: torch.dtype, kernel_dir: Path | None,
                load: Callable[[Path], KernelT | None]) -> KernelT | None:
    """`load(kernel_dir)` for float32 or bfloat16 on the CPU when `env` says `choices[0]`
    (its default); else None. ValueError names an `env` value that is not one of `choices`."""
    choice = os.environ.get(env, choices[0])
    if choice not in choices:
        raise ValueError(f"{env}={choice!r}: expected one of {', '.join(choices)}")
    if (torch.device(device).type != "cpu" or dtype not in KERNEL_DTYPES or kernel_dir is None
            or choice != choices[0]):
        return None
    return load(kernel_dir)
