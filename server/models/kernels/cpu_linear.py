"""Linear layers on the CPU: the C kernels of cpu_linear.c (float32 and bfloat16, AVX-512F,
AVX512-BF16 and AMX where the CPU has them, OpenMP; on a CPU without AVX-512, its AVX2 + FMA
build, cpu_linear_avx2.h, whose every output has the same bits).

    kernel = load(cache_dir)            # None where unsupported: the caller keeps oneDNN
    packed = kernel.pack(weight)        # [N, K] -> panels, once per weight (its dtype)
    y = kernel(x, packed, N, bias)      # x [M, K] -> y [M, N] = x W^T (+ bias), x's dtype

float32: every output is one fused multiply-add chain over k = 0 .. K-1 in order, then the
bias. bfloat16: one float32 chain over the input pairs in order (vdpbf16ps's arithmetic,
which the plain AVX-512F path reproduces bit for bit), then the bias, then one rounding to
bfloat16 (cpu_linear.c). Either way, whatever the batch size, a row gets the same bits in a
one-row decode step and in a 2,048-row prefill. A decode batch streams each weight from
memory once, at the machine's bandwidth (oneDNN's small-batch kernels reached about half of
it on the AMD EPYCs here); in bfloat16 that is half the bytes of float32.

The packed weight is a second copy of W (the first stays the module's parameter, which
checkpoints load into), laid out `[ceil(N / 64)][K][64]` in float32 and
`[ceil(N / 64)][ceil(K / 2)][64][2]` in bfloat16.

Threading: a call may come from any thread; it uses torch's OpenMP thread count.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from hicache_server.models.kernels import cpu_build

_SOURCE = Path(__file__).with_name("src") / "cpu_linear.c"
PANEL = 64  # outputs per panel: must match NR in cpu_linear.c
DTYPES = (torch.float32, torch.bfloat16)
BF16_PATHS = ("avx512f", "avx512bf16", "amx")  # the ISA_ values of cpu_linear.c, in order
# the AVX2 build's one bfloat16 path: cpu_linear.c's plain path (ISA_AVX512F), in AVX2
AVX2_PATH = cpu_build.AVX2_PATH


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
        self._size_bf16 = library.hicache_linear_packed_size_bf16
        self._size_bf16.restype, self._size_bf16.argtypes = i64, [i64, i64]
        self._pack_bf16 = library.hicache_linear_pack_bf16
        self._pack_bf16.restype, self._pack_bf16.argtypes = None, [ptr, i64, i64, ptr]
        self._fn_bf16 = library.hicache_linear_bf16
        self._fn_bf16.restype = ctypes.c_int
        self._fn_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int,
                                  ctypes.c_int]
        # the bfloat16 path: AMX's tiles where the CPU has them, else vdpbf16ps, else
        # AVX-512F (vdpbf16ps's very bits), or in the AVX2 build its plain path (the same
        # bits); tests set another that this CPU runs
        self.isa = cpu_build.built_isa(path)
        self.bf16_paths = (AVX2_PATH,) if self.isa == "avx2" else ("avx512f",)
        if library.hicache_linear_has_avx512bf16():
            self.bf16_paths += ("avx512bf16",)
        if library.hicache_linear_has_amx():
            self.bf16_paths += ("amx",)
        self.bf16_path = self.bf16_paths[-1]

    def packed_size(self, out_features: int, in_features: int, dtype: torch.dtype) -> int:
        """Elements of `pack`'s result for a `[out_features, in_features]` weight."""
        size = self._size_bf16 if dtype == torch.bfloat16 else self._size
        return size(out_features, in_features)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """W `[N, K]` float32 or bfloat16 on the CPU -> its panels (a new 1-D tensor of W's
        dtype)."""
        if weight.dtype not in DTYPES or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"the weight must be a 2-D float32 or bfloat16 CPU tensor, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        w = weight.detach().contiguous()
        n, k = w.shape
        packed = torch.empty(self.packed_size(n, k, w.dtype), dtype=w.dtype)
        pack = self._pack_bf16 if w.dtype == torch.bfloat16 else self._pack
        pack(w.data_ptr(), n, k, packed.data_ptr())
        return packed

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T (+ bias)`, `[M, out_features]` in x's dtype, for `packed = pack(W)`
        (W, the bias and x of one dtype)."""
        self.check(x, packed, out_features, bias)
        y = torch.empty((x.shape[0], out_features), dtype=x.dtype)
        if self._bound(x, packed, out_features, bias, y, torch.get_num_threads())() != 0:
            raise RuntimeError(f"CPU linear kernel refused x {tuple(x.shape)} with "
                               f"{out_features} outputs")
        return y

    def bind(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
             bias: torch.Tensor | None, y: torch.Tensor, threads: int) -> Callable[[], int]:
        """`self(x, packed, out_features, bias)` into `y` (contiguous `[M, out_features]`),
        as a call with every argument checked and bound now: it reads x's rows and writes
        y wherever they are when called (0 on success), on this bfloat16 path and `threads`
        threads. For a caller that runs the same shapes many times over buffers it keeps
        (server/models/cpu_forward.py); the tensors must outlive the call."""
        self.check(x, packed, out_features, bias)
        if (y.dtype != x.dtype or y.device.type != "cpu" or not y.is_contiguous()
                or y.shape != (x.shape[0], out_features)):
            raise ValueError(f"y must be contiguous {x.dtype} [{x.shape[0]}, {out_features}] "
                             f"on the CPU, got {y.dtype} {tuple(y.shape)}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return self._bound(x, packed, out_features, bias, y, threads)

    def _bound(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None, y: torch.Tensor, threads: int) -> Callable[[], int]:
        rows, k = x.shape
        row_stride = x.stride(0) if rows > 1 else k  # one row: its stride is never used
        args = (x.data_ptr(), row_stride, rows, k, packed.data_ptr(), out_features,
                None if bias is None else bias.data_ptr(), y.data_ptr())
        if x.dtype == torch.bfloat16:
            isa = 0 if self.bf16_path == AVX2_PATH else BF16_PATHS.index(self.bf16_path)
            return functools.partial(self._fn_bf16, *args, isa, threads)
        return functools.partial(self._fn, *args, threads)

    def check(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
              bias: torch.Tensor | None) -> None:
        """ValueError unless the kernel may read these: float32 or bfloat16 CPU tensors of
        one dtype, x `[M, K]` with contiguous rows, `packed` the size of a
        `[out_features, K]` weight's panels, a bias of `out_features` contiguous values."""
        dtype = x.dtype
        if dtype not in DTYPES or x.device.type != "cpu" or x.dim() != 2 or (
                x.stride(1) != 1 and x.shape[1] > 1) or x.shape[1] < 1:
            raise ValueError(f"x must be a 2-D float32 or bfloat16 CPU tensor with contiguous "
                             f"rows, got {x.dtype} {tuple(x.shape)} strides {x.stride()} on "
                             f"{x.device}")
        if x.shape[0] > 1 and x.stride(0) < x.shape[1]:  # also stride 0: an expanded row
            raise ValueError(f"x's rows overlap: strides {x.stride()} for shape "
                             f"{tuple(x.shape)}")
        k = x.shape[1]
        size = self.packed_size(out_features, k, dtype) if out_features >= 1 else 0
        if (out_features < 1 or packed.dtype != dtype or packed.device.type != "cpu"
                or not packed.is_contiguous() or packed.numel() != size):
            raise ValueError(f"packed must be the panels of a [{out_features}, {k}] {dtype} "
                             f"weight ({size} elements), got {packed.numel()} "
                             f"{packed.dtype} on {packed.device}")
        if bias is not None and (bias.dtype != dtype or bias.device.type != "cpu"
                                 or bias.shape != (out_features,) or not bias.is_contiguous()):
            raise ValueError(f"bias must be [{out_features}] contiguous {dtype} on the CPU, "
                             f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}")


def supported() -> bool:
    """AVX-512F, or AVX2 and FMA, on this CPU and a C compiler (`cpu_build.isa`)."""
    return cpu_build.isa() is not None


@functools.cache
def load(cache_dir: Path) -> CpuLinearKernel | None:
    """The kernel, compiled into `cache_dir` on first use; None where unsupported or the
    build fails (logged once)."""
    return cpu_build.load(_SOURCE, cache_dir, CpuLinearKernel, "CPU linear kernel", "oneDNN",
                          isas=("avx512", "avx2"))
