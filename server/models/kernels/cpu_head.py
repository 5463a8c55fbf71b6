"""The LM head's greedy screen on the CPU: the C kernel of cpu_head.c (OpenMP; AVX2 + FMA,
and on AVX-512 CPUs its AVX-512 build, which takes the VNNI path where the CPU has
AVX512-VNNI). What it computes and why that is safe: models/head_screen.py.

    kernel = load(cache_dir)                  # None where unsupported (no screen)
    kernel.quantize(w, g, q, scale, reach, qnorm)   # float32 rows -> int8, scales, bounds
    packed = kernel.pack(q, path)             # q [V, K] int8 -> that path's layout
    flagged = kernel.screen(x, packed, scale, reach, qnorm, norm, slack, screened, flags,
                            err, path)

Paths (`PATHS`, both on every CPU; `kernel.best_path` the one a screen takes by default):
    fma    x in float32 against the int8 copy, one FMA chain per output
    vnni   x quantized to int8 per row too, exact int32 sums: vpdpbusd where the CPU has
           AVX512-VNNI (the default there), plain integer C elsewhere (the same sums, slower)

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
PATHS = ("fma", "vnni")
VNNI_MAX_INPUTS = 65536  # the VNNI path's int32 sums cannot overflow up to this K


class CpuHeadKernel:
    """The compiled kernel (the module docstring); build it with `load()`."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._size = library.hicache_head_packed_size
        self._size.restype, self._size.argtypes = i64, [i64, i64]
        self._packs = {"fma": library.hicache_head_pack, "vnni": library.hicache_head_pack_quads}
        for f in self._packs.values():
            f.restype, f.argtypes = None, [ptr, i64, i64, ptr]
        self._quantize = library.hicache_head_quantize
        self._quantize.restype = None
        self._quantize.argtypes = [ptr, i64, i64, ctypes.c_double, ptr, ptr, ptr, ptr]
        self._screen = library.hicache_head_screen
        self._screen.restype = i64
        self._screen.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, ctypes.c_double,
                                 ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
        self.best_path = "vnni" if library.hicache_head_has_vnni() else "fma"

    def quantize(self, w: torch.Tensor, g: float, q: torch.Tensor, scale: torch.Tensor,
                 reach: torch.Tensor, qnorm: torch.Tensor) -> None:
        """The int8 copy of the float32 rows w `[R, K]` into q `[R, K]` int8, their scales,
        reaches and ||scale q|| `[R]` float32 (cpu_head.c's `hicache_head_quantize`; `g` the
        rounding's factor)."""
        r, k = w.shape
        if not (w.dtype == torch.float32 and q.dtype == torch.int8 and q.shape == (r, k)
                and scale.dtype == reach.dtype == qnorm.dtype == torch.float32
                and scale.shape == reach.shape == qnorm.shape == (r,)
                and all(t.is_contiguous() and t.device.type == "cpu"
                        for t in (w, q, scale, reach, qnorm))):
            raise ValueError(f"cannot quantize {w.dtype} {tuple(w.shape)} into {q.dtype} "
                             f"{tuple(q.shape)}")
        self._quantize(w.data_ptr(), r, k, g, q.data_ptr(), scale.data_ptr(), reach.data_ptr(),
                       qnorm.data_ptr())

    def pack(self, q: torch.Tensor, path: str = "fma") -> torch.Tensor:
        """q `[V, K]` int8 on the CPU -> `path`'s layout (a new 1-D int8 tensor)."""
        if q.dtype != torch.int8 or q.device.type != "cpu" or q.dim() != 2:
            raise ValueError(f"q must be a 2-D int8 CPU tensor, got {q.dtype} "
                             f"{tuple(q.shape)} on {q.device}")
        self._check_path(path)
        q = q.contiguous()
        v, k = q.shape
        packed = torch.empty(self._size(v, k), dtype=torch.int8)
        self._packs[path](q.data_ptr(), v, k, packed.data_ptr())
        return packed

    def screen(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               reach: torch.Tensor, qnorm: torch.Tensor, norm: torch.Tensor, slack: float,
               screened: torch.Tensor, flags: torch.Tensor, err: torch.Tensor,
               path: str = "fma", plain_sums: bool = False) -> int:
        """Flag (`flags[p] = 1`) each panel of 64 outputs holding a candidate for the largest
        logit of some row of x `[B, K]` float32 (cpu_head.c's rule; `norm` `[B]` float64
        each row's 2-norm rounded up), on `path` (`packed` in its layout); `screened`
        `[B, V]` float32 receives the screened logits and `err` `[B]` float64 what each
        row's quantization adds to its bound (0 on the fma path). Returns the number of
        panels flagged. `plain_sums`: the vnni path's sums in plain C even where vpdpbusd
        is there (the same sums; for comparing the two)."""
        self._check_path(path)
        b, k = x.shape
        v = scale.shape[0]
        panels = -(-v // PANEL)
        ok = (x.dtype == torch.float32 and x.is_contiguous() and 1 <= b <= MAX_ROWS
              and packed.dtype == torch.int8 and packed.numel() == self._size(v, k)
              and scale.dtype == reach.dtype == qnorm.dtype == torch.float32
              and reach.shape == qnorm.shape == (v,)
              and norm.dtype == err.dtype == torch.float64 and norm.shape == err.shape == (b,)
              and screened.dtype == torch.float32 and screened.numel() >= b * v
              and flags.dtype == torch.uint8 and flags.numel() == panels
              and all(t.is_contiguous() and t.device.type == "cpu"
                      for t in (packed, scale, reach, qnorm, norm, screened, flags, err)))
        if not ok:
            raise ValueError(f"the head screen refused x {x.dtype} {tuple(x.shape)} over "
                             f"{v} outputs")
        found = self._screen(x.data_ptr(), b, k, packed.data_ptr(), scale.data_ptr(),
                             reach.data_ptr(), qnorm.data_ptr(), v, norm.data_ptr(), slack,
                             screened.data_ptr(), flags.data_ptr(), err.data_ptr(),
                             (3 if plain_sums else 1) if path == "vnni" else 0,
                             torch.get_num_threads())
        if found < 0:
            raise ValueError(f"the head screen refused x {tuple(x.shape)}, slack {slack}")
        return int(found)

    def _check_path(self, path: str) -> None:
        if path not in PATHS:
            raise ValueError(f"head screen path {path!r}: expected one of {', '.join(PATHS)}")


def supported() -> bool:
    """AVX2 and FMA (or AVX-512) on this CPU and a C compiler (`cpu_build.isa`)."""
    return cpu_build.isa() is not None


@functools.cache
def load(cache_dir: Path) -> CpuHeadKernel | None:
    """The kernel, compiled into `cache_dir` on first use; None where unsupported or the
    build fails (logged once)."""
    return cpu_build.load(_SOURCE, cache_dir, CpuHeadKernel, "CPU head screen",
                          "the whole head", isas=("avx512", "avx2"))
