"""The LM head's greedy screen on the CPU: the C kernel of cpu_head.c (AVX2 + FMA, OpenMP;
AVX-512 CPUs run its AVX-512 build, the same code). What it computes and why that is safe:
models/head_screen.py.

    kernel = load(cache_dir)                  # None where unsupported (no screen)
    kernel.quantize(w, g, q, scale, reach)    # float32 rows -> int8, scales, reaches
    packed = kernel.pack(q)                   # q [V, K] int8 -> groups of 16 outputs
    flagged = kernel.screen(x, packed, scale, reach, norm, slack, screened, flags)

Threading: a call may come from any thread; it uses torch's OpenMP thread count.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from hicache_server.models.kernels import cpu_build

_SOURCE = Path(__file__).with_name("src") / "cpu_head.c"
PANEL = 64      # outputs per flag: the linear kernel's panel (cpu_linear.PANEL)
MAX_ROWS = 64   # rows per screen call (cpu_head.c's MAX_ROWS)


class CpuHeadKernel:
    """The compiled kernel (the module docstring); build it with `load()`."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._size = library.hicache_head_packed_size
        self._size.restype, self._size.argtypes = i64, [i64, i64]
        self._pack = library.hicache_head_pack
        self._pack.restype, self._pack.argtypes = None, [ptr, i64, i64, ptr]
        self._quantize = library.hicache_head_quantize
        self._quantize.restype = None
        self._quantize.argtypes = [ptr, i64, i64, ctypes.c_double, ptr, ptr, ptr]
        self._screen = library.hicache_head_screen
        self._screen.restype = i64
        self._screen.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_double, ptr,
                                 ptr, ctypes.c_int]

    def quantize(self, w: torch.Tensor, g: float, q: torch.Tensor, scale: torch.Tensor,
                 reach: torch.Tensor) -> None:
        """The int8 copy of the float32 rows w `[R, K]` into q `[R, K]` int8, their scales and
        reaches `[R]` float32 (cpu_head.c's `hicache_head_quantize`; `g` the rounding's
        factor)."""
        r, k = w.shape
        if not (w.dtype == torch.float32 and q.dtype == torch.int8 and q.shape == (r, k)
                and scale.dtype == reach.dtype == torch.float32
                and scale.shape == reach.shape == (r,)
                and all(t.is_contiguous() and t.device.type == "cpu"
                        for t in (w, q, scale, reach))):
            raise ValueError(f"cannot quantize {w.dtype} {tuple(w.shape)} into {q.dtype} "
                             f"{tuple(q.shape)}")
        self._quantize(w.data_ptr(), r, k, g, q.data_ptr(), scale.data_ptr(), reach.data_ptr())

    def pack(self, q: torch.Tensor) -> torch.Tensor:
        """q `[V, K]` int8 on the CPU -> the kernel's layout (a new 1-D int8 tensor)."""
        if q.dtype != torch.int8 or q.device.type != "cpu" or q.dim() != 2:
            raise ValueError(f"q must be a 2-D int8 CPU tensor, got {q.dtype} "
                             f"{tuple(q.shape)} on {q.device}")
        q = q.contiguous()
        v, k = q.shape
        packed = torch.empty(self._size(v, k), dtype=torch.int8)
        self._pack(q.data_ptr(), v, k, packed.data_ptr())
        return packed

    def screen(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               reach: torch.Tensor, norm: torch.Tensor, slack: float,
               screened: torch.Tensor, flags: torch.Tensor) -> int:
        """Flag (`flags[p] = 1`) each panel of 64 outputs holding a candidate for the largest
        logit of some row of x `[B, K]` float32 (cpu_head.c's rule; `norm` `[B]` float64
        each row's 2-norm rounded up); `screened` `[B, V]` float32 receives the screened
        logits. Returns the number of panels flagged."""
        b, k = x.shape
        v = scale.shape[0]
        panels = -(-v // PANEL)
        ok = (x.dtype == torch.float32 and x.is_contiguous() and 1 <= b <= MAX_ROWS
              and packed.dtype == torch.int8 and packed.numel() == self._size(v, k)
              and scale.dtype == reach.dtype == torch.float32 and reach.shape == (v,)
              and norm.dtype == torch.float64 and norm.shape == (b,)
              and screened.dtype == torch.float32 and screened.numel() >= b * v
              and flags.dtype == torch.uint8 and flags.numel() == panels
              and all(t.is_contiguous() and t.device.type == "cpu"
                      for t in (packed, scale, reach, norm, screened, flags)))
        if not ok:
            raise ValueError(f"the head screen refused x {x.dtype} {tuple(x.shape)} over "
                             f"{v} outputs")
        found = self._screen(x.data_ptr(), b, k, packed.data_ptr(), scale.data_ptr(),
                             reach.data_ptr(), v, norm.data_ptr(), slack, screened.data_ptr(),
                             flags.data_ptr(), torch.get_num_threads())
        if found < 0:
            raise ValueError(f"the head screen refused x {tuple(x.shape)}, slack {slack}")
        return int(found)


def supported() -> bool:
    """AVX2 and FMA (or AVX-512) on this CPU and a C compiler (`cpu_build.isa`)."""
    return cpu_build.isa() is not None


@functools.cache
def load(cache_dir: Path) -> CpuHeadKernel | None:
    """The kernel, compiled into `cache_dir` on first use; None where unsupported or the
    build fails (logged once)."""
    return cpu_build.load(_SOURCE, cache_dir, CpuHeadKernel, "CPU head screen",
                          "the whole head", isas=("avx512", "avx2"))
