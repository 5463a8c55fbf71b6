"""Linear layers on the CPU: the C kernel of cpu_linear.c (float32, AVX-512F, OpenMP).

    kernel = load(cache_dir)            # None where unsupported: the caller keeps oneDNN
    packed = kernel.pack(weight)        # [N, K] -> panels, once per weight
    y = kernel(x, packed, N, bias)      # x [M, K] -> y [M, N] = x W^T (+ bias)

Every output is one fused multiply-add chain over k = 0 .. K-1 in order, then the bias
(cpu_linear.c), whatever the batch size: a row gets the same bits in a one-row decode step
and in a 2,048-row prefill. A decode batch streams each weight from memory once, at the
machine's bandwidth (oneDNN's small-batch kernels reached about half of it on the AMD
EPYCs here); a prefill runs as fast as oneDNN's packed matmul.

The packed weight is a second copy of W (the first stays the module's parameter, which
checkpoints load into), laid out `[ceil(N / 64)][K][64]`.

Threading: a call may come from any thread; it uses torch's OpenMP thread count.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kernels import cpu_build

_SOURCE = Path(__file__).with_name("cpu_linear.c")
PANEL = 64  # outputs per panel: must match NR in cpu_linear.c


class CpuLinearKernel:
    """The compiled kernel (see the module docstring); build it with `load()`."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._size = library.hicache_linear_packed_size
        self._size.restype, self._size.argtypes = i64, [i64, i64]
        self._pack = library.hicache_linear_pack_f32
        self._pack.restype, self._pack.argtypes = None, [ptr, i64, i64, ptr]
        self._fn = library.hicache_linear_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """W `[N, K]` float32 on the CPU -> its panels (a new 1-D tensor)."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"the weight must be a 2-D float32 CPU tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        w = weight.detach().contiguous()
        n, k = w.shape
        packed = torch.empty(self._size(n, k), dtype=torch.float32)
        self._pack(w.data_ptr(), n, k, packed.data_ptr())
        return packed

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T (+ bias)`, `[M, out_features]` float32, for `packed = pack(W)`."""
        check(x, packed, out_features, bias)
        rows, k = x.shape
        y = torch.empty((rows, out_features), dtype=torch.float32)
        row_stride = x.stride(0) if rows > 1 else k  # one row: its stride is never used
        rc = self._fn(x.data_ptr(), row_stride, rows, k, packed.data_ptr(), out_features,
                      None if bias is None else bias.data_ptr(), y.data_ptr(),
                      torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"CPU linear kernel refused x {tuple(x.shape)} with "
                               f"{out_features} outputs")
        return y


def check(x: torch.Tensor, packed: torch.Tensor, out_features: int,
          bias: torch.Tensor | None) -> None:
    """ValueError unless the kernel may read these: float32 CPU tensors, x `[M, K]` with
    contiguous rows, `packed` the size of a `[out_features, K]` weight's panels, a bias of
    `out_features` contiguous floats."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or (
            x.stride(1) != 1 and x.shape[1] > 1) or x.shape[1] < 1:
        raise ValueError(f"x must be a 2-D float32 CPU tensor with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")
    if x.shape[0] > 1 and x.stride(0) < x.shape[1]:  # also stride 0: an expanded row
        raise ValueError(f"x's rows overlap: strides {x.stride()} for shape {tuple(x.shape)}")
    k = x.shape[1]
    panels = -(-out_features // PANEL)
    if (out_features < 1 or packed.dtype != torch.float32 or packed.device.type != "cpu"
            or not packed.is_contiguous() or packed.numel() != panels * k * PANEL):
        raise ValueError(f"packed must be the panels of a [{out_features}, {k}] float32 "
                         f"weight ({panels * k * PANEL} floats), got {packed.numel()} "
                         f"{packed.dtype} on {packed.device}")
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"
                             or bias.shape != (out_features,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be [{out_features}] contiguous float32 on the CPU, got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")


def supported() -> bool:
    """AVX-512F on this CPU and a C compiler (`cpu_build.supported`)."""
    return cpu_build.supported()


@functools.cache
def load(cache_dir: Path) -> CpuLinearKernel | None:
    """The kernel, compiled into `cache_dir` on first use; None where unsupported or the
    build fails (logged once)."""
    return cpu_build.load(_SOURCE, cache_dir, CpuLinearKernel, "CPU linear kernel", "oneDNN")
