"""The rest of a decoder layer on the CPU: RMSNorm (after the residual add), RoPE and
SiLU(gate) * up, from the C kernels of cpu_layer.c (float32 and bfloat16, AVX-512F or AVX2
and FMA, with the same bits either way; OpenMP).

    layer = load(cache_dir)                          # None where unsupported: torch ops
    out = layer.rms_norm(x, weight, eps)             # or, with the residual add first:
    out, h = layer.rms_norm(x, weight, eps, residual)  # h = residual + x, out = norm(h)
    layer.rope_(qk, positions, cos, sin)             # in place, [T, heads, head_dim]
                                                     # (the first 2 * cos.shape[1] of each head)
    act = layer.silu_mul(gate_up)                    # [M, 2I] -> [M, I]

Gemma's (float32 `1 + w` weights, see `gemma_rms_norm_reference` for the arithmetic):

    out = layer.gemma_rms_norm(x, one_plus_w, eps)   # x [M, H] or [T, heads, H]
    out, total = layer.gemma_norm_add_norm(x, w1, h, w2, eps)  # total = h + norm1(x),
                                                     # out = norm2(total), both new
    act = layer.gelu_tanh_mul(gate_up)               # GeGLU, [M, 2I] -> [M, I]

Each is one pass over its rows where torch dispatches four to eight ops; every row is
computed alone, so a row's bits do not depend on its batch. RoPE is torch's arithmetic
exactly; RMSNorm and SiLU round differently from torch, within float32 rounding. Every
tensor of a call has one dtype, float32 or bfloat16 (then float32 math inside, rounded to
bfloat16 where transformers' bfloat16 modules round: cpu_layer.c says where; RoPE's cos and
sin tables are then bfloat16 too).

Threading: any thread; large calls use torch's OpenMP thread count.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hicache_server.models.kernels import cpu_build

_SOURCE = Path(__file__).with_name("src") / "cpu_layer.c"


DTYPES = (torch.float32, torch.bfloat16)


class NormAdd(NamedTuple):
    """`gemma_norm_add_norm`'s result: the next norm's output and the new residual."""

    out: torch.Tensor  # [M, H], the input of the MLP (or of the next layer)
    total: torch.Tensor  # [M, H], residual + the normalised branch


def _float_rows(name: str, t: torch.Tensor, width: int | None = None) -> None:
    if t.dtype not in DTYPES or t.device.type != "cpu" or t.dim() != 2 or t.shape[1] < 1 or (
            t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be a 2-D float32 or bfloat16 CPU tensor with "
                         f"contiguous rows, got {t.dtype} {tuple(t.shape)} strides "
                         f"{t.stride()} on {t.device}")
    if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise ValueError(f"{name}'s rows overlap: strides {t.stride()}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name} must have {width} columns, got {tuple(t.shape)}")


def _row_stride(t: torch.Tensor) -> int:
    """Floats from one row to the next; a lone row's is never read: its own size."""
    return t.stride(0) if t.shape[0] > 1 else math.prod(t.shape[1:])


class CpuLayerKernel:
    """The compiled kernels (see the module docstring); build them with `load()`."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._norm = library.hicache_rms_norm_f32
        self._norm.restype = None
        self._norm.argtypes = [ptr, i64, ptr, ptr, ptr, f32, i64, i64, ptr, i32]
        self._rope = library.hicache_rope_f32
        self._rope.restype = None
        self._rope.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i32]
        self._silu = library.hicache_silu_mul_f32
        self._silu.restype = None
        self._silu.argtypes = [ptr, i64, i64, ptr, i32]
        self._gemma_norm = library.hicache_gemma_norm_f32
        self._gemma_norm.restype = None
        self._gemma_norm.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, f32, i64, i64, ptr, i32]
        self._gelu = library.hicache_gelu_tanh_mul_f32
        self._gelu.restype = None
        self._gelu.argtypes = self._silu.argtypes
        self._bf16 = {}  # the same for bfloat16, by name
        for name, f32 in (("norm", self._norm), ("rope", self._rope), ("silu", self._silu),
                          ("gemma_norm", self._gemma_norm), ("gelu", self._gelu)):
            fn = getattr(library, f32.__name__.replace("_f32", "_bf16"))
            fn.restype, fn.argtypes = None, f32.argtypes
            self._bf16[name] = fn

    def _fn(self, name: str, dtype: torch.dtype):
        return self._bf16[name] if dtype == torch.bfloat16 else getattr(self, f"_{name}")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`weight * x / sqrt(mean(x^2) + eps)` per row of x `[M, H]`. With `residual`
        (contiguous `[M, H]`): `(norm(residual + x), residual + x)`, the sum a new tensor."""
        _check_norm(x, weight, residual)
        rows, hidden = x.shape
        total = None if residual is None else torch.empty((rows, hidden), dtype=x.dtype)
        out = torch.empty((rows, hidden), dtype=x.dtype)
        if rows:
            self._norm_call(x, weight, eps, out, residual, total, torch.get_num_threads())()
        return out if total is None else (out, total)

    def bind_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      out: torch.Tensor, residual: torch.Tensor | None = None,
                      total: torch.Tensor | None = None, threads: int = 1
                      ) -> Callable[[], None]:
        """`rms_norm` into `out` (and `residual + x` into `total`, given with `residual`),
        every argument checked and bound now; the call reads and writes those tensors'
        storage wherever it is when called. The tensors must outlive the call, `out` and
        `total` may not overlap the inputs (server/models/cpu_forward.py keeps them)."""
        _check_norm(x, weight, residual)
        _check_out("out", out, x.dtype, x.shape)
        if (residual is None) != (total is None):
            raise ValueError("total is given exactly when residual is")
        if total is not None:
            _check_out("total", total, x.dtype, x.shape)
        return self._norm_call(x, weight, eps, out, residual, total, _threads(threads))

    def _norm_call(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                   residual: torch.Tensor | None, total: torch.Tensor | None,
                   threads: int) -> Callable[[], None]:
        rows, hidden = x.shape
        return functools.partial(
            self._fn("norm", x.dtype), x.data_ptr(), _row_stride(x),
            None if residual is None else residual.data_ptr(),
            None if total is None else total.data_ptr(), weight.data_ptr(), eps, rows, hidden,
            out.data_ptr(), threads)

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """Rotate `x` `[T, heads, head_dim]` (each row's heads contiguous, rows any stride)
        in place by `positions` (int64 `[T]`, each below cos's rows): rotate-half pairs of
        the first `rotary_dim` values of each head, the rest kept, cos and sin
        `[max_positions, rotary_dim // 2]` contiguous, of x's dtype (`rotary_dim` <= head_dim,
        head_dim for full rotary). Returns x.
        `checked`: the caller already checked the positions' range (once per batch)."""
        _check_rope(x, positions, cos, sin)
        if not checked:
            check_positions(positions, cos.shape[0])
        if x.shape[0]:
            self._rope_call(x, positions, cos, sin, torch.get_num_threads())()
        return x

    def bind_rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, threads: int = 1) -> Callable[[], None]:
        """`rope_` as a call bound now (layouts checked now). It reads `positions` when
        called: the caller checks their range (`check_positions`) before every call."""
        _check_rope(x, positions, cos, sin)
        return self._rope_call(x, positions, cos, sin, _threads(threads))

    def _rope_call(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, threads: int) -> Callable[[], None]:
        tokens, heads, dim = x.shape
        return functools.partial(
            self._fn("rope", x.dtype), x.data_ptr(), _row_stride(x), tokens, heads, dim,
            2 * cos.shape[1], positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), threads)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of contiguous `[M, 2 I]` (gate | up) -> `[M, I]`."""
        _check_gate_up(gate_up)
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        if rows:
            self._silu_call(gate_up, out, torch.get_num_threads())()
        return out

    def bind_silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor,
                      threads: int = 1) -> Callable[[], None]:
        """`silu_mul` into `out` (contiguous `[M, I]`), as a call bound now."""
        _check_gate_up(gate_up)
        _check_out("out", out, gate_up.dtype, (gate_up.shape[0], gate_up.shape[1] // 2))
        return self._silu_call(gate_up, out, _threads(threads))

    def _silu_call(self, gate_up: torch.Tensor, out: torch.Tensor, threads: int,
                   name: str = "silu") -> Callable[[], None]:
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        return functools.partial(self._fn(name, gate_up.dtype), gate_up.data_ptr(), rows,
                                 inter, out.data_ptr(), threads)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`gelu_tanh(gate) * up` of contiguous `[M, 2 I]` (gate | up) -> `[M, I]`, as
        `gelu_tanh_mul_reference` (Gemma's GeGLU)."""
        _check_gate_up(gate_up)
        out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
        if out.shape[0]:
            self._silu_call(gate_up, out, torch.get_num_threads(), "gelu")()
        return out

    def gemma_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> torch.Tensor:
        """`gemma_rms_norm_reference` of x `[M, H]` (rows any stride) or `[T, heads, H]`
        (each row's heads contiguous: q or k of a q|k|v row, per head), weight the float32
        `[H]` of `1 + w`; the result contiguous, x's shape and dtype."""
        rows, heads = _check_gemma_x(x, weight)
        out = torch.empty(x.shape, dtype=x.dtype)
        if rows:
            self._fn("gemma_norm", x.dtype)(
                x.data_ptr(), _row_stride(x), heads, weight.data_ptr(), None, None, None, eps,
                rows * heads, x.shape[-1], out.data_ptr(), torch.get_num_threads())
        return out

    def gemma_norm_add_norm(self, x: torch.Tensor, weight: torch.Tensor,
                            residual: torch.Tensor, next_weight: torch.Tensor,
                            eps: float) -> NormAdd:
        """`gemma_norm_add_norm_reference`: x `[M, H]` (rows any stride), residual
        contiguous `[M, H]` of x's dtype, both weights float32 `[H]`; new tensors."""
        rows, _ = _check_gemma_x(x, weight, heads_allowed=False)
        _check_gemma_weight("next_weight", next_weight, x.shape[1])
        if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
            raise ValueError(f"residual must be contiguous {x.dtype} {tuple(x.shape)}, got "
                             f"{residual.dtype} {tuple(residual.shape)} strides "
                             f"{residual.stride()}")
        out, total = torch.empty_like(residual), torch.empty_like(residual)
        if rows:
            self._fn("gemma_norm", x.dtype)(
                x.data_ptr(), _row_stride(x), 1, weight.data_ptr(), residual.data_ptr(),
                total.data_ptr(), next_weight.data_ptr(), eps, rows, x.shape[1],
                out.data_ptr(), torch.get_num_threads())
        return NormAdd(out, total)

    def bind_gelu_tanh_mul(self, gate_up: torch.Tensor, out: torch.Tensor,
                           threads: int = 1) -> Callable[[], None]:
        """`gelu_tanh_mul` into `out` (contiguous `[M, I]`), as a call bound now."""
        _check_gate_up(gate_up)
        _check_out("out", out, gate_up.dtype, (gate_up.shape[0], gate_up.shape[1] // 2))
        return self._silu_call(gate_up, out, _threads(threads), "gelu")

    def bind_gemma_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        out: torch.Tensor, residual: torch.Tensor | None = None,
                        next_weight: torch.Tensor | None = None, threads: int = 1
                        ) -> Callable[[], None]:
        """As a call bound now: `gemma_rms_norm` of x into `out` (x's shape, contiguous);
        with `residual` and `next_weight`, `gemma_norm_add_norm` with the sum written over
        the residual (row by row, each element read before it is written: the same bits as
        apart). The tensors must outlive the call (server/models/gemma_forward.py keeps
        them)."""
        rows, heads = _check_gemma_x(x, weight, heads_allowed=residual is None)
        _check_out("out", out, x.dtype, tuple(x.shape))
        if (residual is None) != (next_weight is None):
            raise ValueError("next_weight is given exactly when residual is")
        if residual is not None:
            _check_gemma_weight("next_weight", next_weight, x.shape[1])
            _check_out("residual", residual, x.dtype, tuple(x.shape))
        res = None if residual is None else residual.data_ptr()
        return functools.partial(
            self._fn("gemma_norm", x.dtype), x.data_ptr(), _row_stride(x), heads,
            weight.data_ptr(), res, res, None if next_weight is None else next_weight.data_ptr(),
            eps, rows * heads, x.shape[-1], out.data_ptr(), _threads(threads))


def _check_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    _float_rows("x", x)
    rows, hidden = x.shape
    if weight.dtype != x.dtype or weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight must be [{hidden}] contiguous {x.dtype}, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if residual is not None:
        _float_rows("residual", residual, hidden)
        if (residual.shape[0] != rows or not residual.is_contiguous()
                or residual.dtype != x.dtype):
            raise ValueError(f"residual must be contiguous {x.dtype} [{rows}, {hidden}], "
                             f"got {residual.dtype} {tuple(residual.shape)} strides "
                             f"{residual.stride()}")


def _check_out(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.shape != shape:
        raise ValueError(f"{name} must be contiguous {dtype} {tuple(shape)} on the CPU, got "
                         f"{t.dtype} {tuple(t.shape)}")


def _check_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
    if (x.dtype not in DTYPES or x.device.type != "cpu" or x.dim() != 3
            or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.shape[2] % 2
            or (x.shape[0] > 1 and x.stride(0) < x.shape[1] * x.shape[2])):
        raise ValueError(f"x must be float32 or bfloat16 [T, heads, head_dim] with each "
                         f"row's heads contiguous, got {x.dtype} {tuple(x.shape)} strides "
                         f"{x.stride()}")
    tokens, _, dim = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if (t.dtype != x.dtype or t.dim() != 2 or not 1 <= t.shape[1] <= dim // 2
                or t.shape != cos.shape or not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous {x.dtype} [positions, rotary_dim // 2 "
                             f"<= {dim // 2}], cos's shape, got {t.dtype} {tuple(t.shape)}")
    if (positions.dtype != torch.int64 or positions.shape != (tokens,)
            or not positions.is_contiguous()):
        raise ValueError(f"positions must be contiguous int64 [{tokens}], got "
                         f"{positions.dtype} {tuple(positions.shape)}")


def _check_gate_up(gate_up: torch.Tensor) -> None:
    _float_rows("gate_up", gate_up)
    if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be contiguous [M, 2 I], got "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")


def _check_gemma_x(x: torch.Tensor, weight: torch.Tensor,
                   heads_allowed: bool = True) -> tuple[int, int]:
    """(rows, heads) of a Gemma norm's input: `[M, H]` rows any stride, or (heads_allowed)
    `[T, heads, H]` with each row's heads contiguous; weight float32 contiguous `[H]`."""
    if x.dim() == 3 and heads_allowed:
        rows, heads, hidden = x.shape
        if (x.dtype not in DTYPES or x.device.type != "cpu" or x.stride(2) != 1
                or x.stride(1) != hidden or (rows > 1 and x.stride(0) < heads * hidden)):
            raise ValueError(f"x must be float32 or bfloat16 [T, heads, H] on the CPU with each "
                             f"row's heads contiguous, got {x.dtype} {tuple(x.shape)} strides "
                             f"{x.stride()} on {x.device}")
    else:
        _float_rows("x", x)
        rows, heads = x.shape[0], 1
    _check_gemma_weight("weight", weight, x.shape[-1])
    return rows, heads


def _check_gemma_weight(name: str, weight: torch.Tensor, hidden: int) -> None:
    if weight.dtype != torch.float32 or weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"a Gemma norm's {name} must be float32 [{hidden}] contiguous "
                         f"(1 + w), got {weight.dtype} {tuple(weight.shape)}")


def _threads(threads: int) -> int:
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return threads


def check_positions(positions: torch.Tensor, limit: int) -> None:
    """ValueError unless every position lies in [0, limit)."""
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= limit):
        raise ValueError(f"positions must lie in [0, {limit}), got [{int(positions.min())}, "
                         f"{int(positions.max())}]")


# ------------------------------------------------------------------------- torch references
# Gemma's ops as transformers computes them (Gemma3RMSNorm, Gemma3MLP), the kernels' shapes.


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float
                             ) -> torch.Tensor:
    """x normalised in float32, times the float32 `weight` (transformers' `1.0 +
    w.float()`: the same bits folded once), cast to x's dtype once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight).to(x.dtype)


def gemma_norm_add_norm_reference(x: torch.Tensor, weight: torch.Tensor,
                                  residual: torch.Tensor, next_weight: torch.Tensor,
                                  eps: float) -> NormAdd:
    """`total = residual + norm(x, weight)` (a norm after attention or the MLP, then the
    residual add), `out = norm(total, next_weight)` (the norm before what comes next)."""
    total = residual + gemma_rms_norm_reference(x, weight, eps)
    return NormAdd(gemma_rms_norm_reference(total, next_weight, eps), total)


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(gate) * up` of `[M, 2 I]` (transformers' Gemma MLP; each op rounds to the
    input's dtype)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def supported() -> bool:
    """AVX-512F, or AVX2 and FMA, on this CPU and a C compiler (`cpu_build.isa`)."""
    return cpu_build.isa() is not None


@functools.cache
def load(cache_dir: Path) -> CpuLayerKernel | None:
    """The kernels, compiled into `cache_dir` on first use; None where unsupported or the
    build fails (logged once)."""
    return cpu_build.load(_SOURCE, cache_dir, CpuLayerKernel, "CPU layer kernels", "torch ops",
                          isas=("avx512", "avx2"))
