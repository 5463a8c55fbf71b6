"""Paged causal attention on the CPU: the C kernel of cpu_attention.c and its torch reference.

Layouts (float32 or bfloat16, one dtype for q, the pool and the output)::

    q          [T, H, D]            the batch's new tokens; rows may be strided (a view of q|k|v)
    k/v_cache  [num_slots, KVH, D]  one layer of the device KV pool, contiguous
    slots      [sum of seq_lens]    int64: sequence 0's slots, then sequence 1's, ...
    seqs       [S, 4]               int64 rows (first row in T, prefix_len, extend_len,
                                    first entry in `slots`)
    out        [T, H, D]

New token t of sequence i (position `p = prefix_len + t`) attends keys `0 .. p` of that
sequence, or with a `window` W (a sliding-window layer) its W latest, `p - W < j <= p`;
query head h reads KV head `h // (H // KVH)`. With a `softcap` c (Gemma 2's attention logit
soft-capping) each scaled score s becomes `c * tanh(s / c)` before the softmax. Decode rows
are the case `extend_len == 1`; one call serves any mix.

The kernel computes each row the same way whatever else is in the call, so a token gets the
same bits prefilled from scratch, extending a cached prefix, or decoded (cpu_attention.c says
how; a window keeps the key blocks aligned at key 0 and skips the blocks before a row's
window). In bfloat16 it reads q, K and V exactly as float32, computes in float32 as the float32
kernel does, and rounds the output once; or multiplies bfloat16 pairs: where the CPU has AMX
and head_dim is a multiple of 64, QK^T and PV on AMX's tiles, else where it has AVX512-BF16
and head_dim is a multiple of 32, with vdpbf16ps (both with P rounded to bfloat16 for PV,
as torch's bfloat16 flash attention does), each row still alone. It needs AVX-512F, or AVX2
and FMA (the same arithmetic on two 8-float halves, so the same bits; no pair path), and a
C compiler: `load()` builds it once into `cache_dir` (`kernels/cpu_build.py`: the key, the
compiler, the shared OpenMP runtime) and returns None where either is missing or the build
fails (the caller keeps torch's SDPA).

Threading: a kernel call may come from any thread; it uses `num_threads` OpenMP threads.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from hicache_server.models.kernels import cpu_build

_SOURCE = Path(__file__).with_name("src") / "cpu_attention.c"
_SYMBOLS = {torch.float32: "hicache_paged_attention_f32",
            torch.bfloat16: "hicache_paged_attention_bf16"}
DTYPES = tuple(_SYMBOLS)
_WORKSPACE_SYMBOL = "hicache_paged_attention_workspace"
MAX_HEAD_DIM = 256  # must match cpu_attention.c
HEAD_DIM_MULTIPLE = 16  # one v16f of float32 (cpu_v16.h)
# the pair paths': whole 64-wide C tiles of the output on AMX, whole 32-dim rows of K's
# pair tiles with vdpbf16ps; other head dims stay on AVX-512F
PAIR_HEAD_DIM_MULTIPLE = {"amx": 64, "avx512bf16": 32}
# every bfloat16 path, for tests that run each the CPU has: the AVX2 build's one, then the
# AVX-512 build's (`bf16_paths` holds this CPU's)
AVX2_PATH = cpu_build.AVX2_PATH
BF16_PATHS = (AVX2_PATH, "avx512f", "avx512bf16", "amx")
_ERRORS = {-1: "unsupported shape", -2: "out of memory"}


class CpuAttentionKernel:
    """The compiled kernel (see the module docstring); build it with `load()`."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fns = {}
        for dtype, symbol in _SYMBOLS.items():
            fn = getattr(library, symbol)
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_float,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ]
            self._fns[dtype] = fn
        # bfloat16 on AMX's tiles where the CPU has them (head dims a multiple of 64), else
        # with vdpbf16ps where it has AVX512-BF16 (head dims a multiple of 32), else on
        # AVX-512F; tests set a path to run it beside this CPU's own
        self._pair_fns = {}
        self.isa = cpu_build.built_isa(path)
        self.bf16_paths = (AVX2_PATH,) if self.isa == "avx2" else ("avx512f",)
        for isa, symbol, has in (("avx512bf16", "hicache_paged_attention_bf16_dp",
                                  library.hicache_paged_attention_has_avx512bf16),
                                 ("amx", "hicache_paged_attention_bf16_amx",
                                  library.hicache_paged_attention_has_amx)):
            if not has():  # never in the AVX2 build, which has no pair path
                continue
            fn = getattr(library, symbol)
            fn.restype = ctypes.c_int
            fn.argtypes = self._fns[torch.bfloat16].argtypes
            self._pair_fns[isa] = fn
            self.bf16_paths += (isa,)
        self.bf16_path = self.bf16_paths[-1]
        self._workspace_fn = getattr(library, _WORKSPACE_SYMBOL)
        self._workspace_fn.restype = ctypes.c_int64
        self._workspace_fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int]
        # per calling thread: a float32 buffer kept and grown, so no call allocates pages
        self._local = threading.local()

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, seqs: torch.Tensor, scale: float,
                 checked: bool = False, *, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        """Attention output `[T, H, D]` in q's dtype (see the module docstring for the
        layouts; `window`: a sliding-window layer's W, None for full attention; `softcap`:
        the scores' cap, None for none).

        The kernel reads wherever its arguments point, so they are checked first (`check`),
        unless the caller already did for tensors of these very shapes, strides and indices
        (`checked`: the attention backend checks once per batch, not at every layer)."""
        if not checked:
            check(q, k_cache, v_cache, slots, seqs)
        tokens, heads, dim = q.shape
        out = torch.empty((tokens, heads, dim), dtype=q.dtype)
        if tokens == 0:
            return out
        w, cap = window_arg(window), softcap_arg(softcap)
        threads, kv_heads = torch.get_num_threads(), k_cache.shape[1]
        need = self._workspace_fn(seqs.data_ptr(), seqs.shape[0], heads, kv_heads, dim, w,
                                  threads)
        rc = self._function(q.dtype, dim)(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slots.data_ptr(), seqs.data_ptr(), seqs.shape[0], heads, kv_heads, dim, scale, w,
            cap, out.data_ptr(), self._workspace(need).data_ptr(), threads)
        raise_on_error(rc)
        return out

    def bind_layers(self, q: torch.Tensor, caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    slots: torch.Tensor, seqs: torch.Tensor, scale: float, out: torch.Tensor,
                    threads: int, *, windows: Sequence[int | None] | None = None,
                    softcaps: Sequence[float | None] | None = None) -> BoundLayers:
        """The attention of q over each `(k_cache, v_cache)` of `caches` (one per layer,
        every one of the first's layout) into `out` (contiguous, q's shape), as calls with
        every argument checked and bound now: `bound(i)` runs layer i reading q and the
        caches wherever they are at that moment. `windows`: each layer's window (None: full
        attention), or None for every layer full; `softcaps` likewise each layer's softcap
        (None: none), or None for none on any layer. For a caller that runs every layer of one
        batch over buffers it keeps (server/models/cpu_forward.py)."""
        k0, v0 = caches[0]
        check(q, k0, v0, slots, seqs)
        for k, v in caches:
            if not (k.shape == v.shape == k0.shape and k.dtype == v.dtype == k0.dtype
                    and k.is_contiguous() and v.is_contiguous() and k.device.type == "cpu"
                    and v.device.type == "cpu"):
                raise ValueError(f"every layer's caches must be contiguous {k0.dtype} "
                                 f"{tuple(k0.shape)} CPU tensors, got {k.dtype} "
                                 f"{tuple(k.shape)} and {v.dtype} {tuple(v.shape)}")
        if (out.dtype != q.dtype or out.device.type != "cpu" or not out.is_contiguous()
                or out.shape != q.shape):
            raise ValueError(f"out must be contiguous {q.dtype} {tuple(q.shape)} on the CPU, "
                             f"got {out.dtype} {tuple(out.shape)}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        ws = [window_arg(w) for w in _per_layer("windows", windows, len(caches))]
        caps = [softcap_arg(c) for c in _per_layer("softcaps", softcaps, len(caches))]
        _, heads, dim = q.shape
        kv_heads = k0.shape[1]
        # window 0 (full attention) needs the most workspace: its size serves every layer
        workspace = self._workspace(self._workspace_fn(seqs.data_ptr(), seqs.shape[0], heads,
                                                       kv_heads, dim, 0, threads))
        fn = self._function(q.dtype, dim)
        head = (slots.data_ptr(), seqs.data_ptr(), seqs.shape[0], heads, kv_heads, dim, scale)
        tail = (out.data_ptr(), workspace.data_ptr(), threads)
        calls = [functools.partial(fn, q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(),
                                   *head, w, cap, *tail)
                 for (k, v), w, cap in zip(caches, ws, caps)]
        return BoundLayers(calls, (q, caches, slots, seqs, out, workspace))

    def _function(self, dtype: torch.dtype, dim: int) -> Callable[..., int]:
        """The C function for this dtype and head dim on this CPU's (or the set) path."""
        if (dtype == torch.bfloat16 and self.bf16_path in self._pair_fns
                and dim % PAIR_HEAD_DIM_MULTIPLE[self.bf16_path] == 0):
            return self._pair_fns[self.bf16_path]
        return self._fns[dtype]

    def _workspace(self, floats: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < floats:
            buf = self._local.buf = torch.empty(floats, dtype=torch.float32)  # 64-B aligned
        return buf


class BoundLayers:
    """`CpuAttentionKernel.bind_layers`' calls: `bound(layer)` runs that layer's attention
    (RuntimeError if the kernel fails). Holds the tensors the calls point into."""

    def __init__(self, calls: list[Callable[[], int]], keep: tuple) -> None:
        self._calls = calls
        self._keep = keep  # the calls hold raw pointers into these

    def __call__(self, layer: int) -> None:
        raise_on_error(self._calls[layer]())


def _per_layer(name: str, values: Sequence | None, layers: int) -> list:
    """`values` (`windows`, `softcaps`) as a list of one per layer (None: `layers` Nones);
    ValueError naming them for another length."""
    values = [None] * layers if values is None else list(values)
    if len(values) != layers:
        raise ValueError(f"{name} must name one {name[:-1]} per layer ({layers}), got "
                         f"{len(values)}")
    return values


def window_arg(window: int | None) -> int:
    """The kernel's window argument: W, or 0 for full attention (None); ValueError unless
    W >= 1."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None (full attention) or an int >= 1, got {window!r}")
    return window


def softcap_arg(softcap: float | None) -> float:
    """A kernel's softcap argument (this one's and paged_attention.cu's): c, or 0.0 for none
    (None); ValueError unless c is a finite number > 0."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not (
            0 < softcap < math.inf):
        raise ValueError(f"softcap must be None (none) or a finite number > 0, got {softcap!r}")
    return float(softcap)


def raise_on_error(rc: int) -> None:
    """RuntimeError naming the kernel's error code, unless it is 0."""
    if rc != 0:
        raise RuntimeError(f"CPU attention kernel failed: {_ERRORS.get(rc, rc)}")


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slots: torch.Tensor, seqs: torch.Tensor, scale: float, *,
                              window: int | None = None, softcap: float | None = None
                              ) -> torch.Tensor:
    """The kernel's signature in plain torch: per sequence, gather, repeat KV heads, SDPA
    with the offset-causal mask (keys before a row's `window` hidden too); with a `softcap`
    c, the scores `scale * q.k` computed in float32, capped to `c * tanh(s / c)`, masked,
    softmax, P V."""
    _validate(q, k_cache, v_cache, slots, seqs)
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype)
    for first, prefix, extend, slot0 in seqs.tolist():
        own = slots[slot0:slot0 + prefix + extend]
        ks = k_cache.index_select(0, own).repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v_cache.index_select(0, own).repeat_interleave(group, dim=1).transpose(0, 1)
        keys = torch.arange(prefix + extend)[None, :]
        queries = torch.arange(prefix, prefix + extend)[:, None]
        allowed = keys <= queries  # [extend, seq_len]
        if window is not None:
            allowed &= keys > queries - window_arg(window)
        qs = q[first:first + extend].transpose(0, 1)  # [H, extend, D]
        if softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        else:
            s = qs.float() @ ks.float().transpose(-1, -2) * scale
            s = (torch.tanh(s / softcap_arg(softcap)) * softcap).masked_fill(~allowed, -math.inf)
            o = s.softmax(-1) @ vs.float()
        out[first:first + extend] = o.transpose(0, 1)
    return out


def _validate(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor, seqs: torch.Tensor) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in DTYPES or t.device.type != "cpu" or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D float32 or bfloat16 CPU tensor, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must be of q's dtype {q.dtype}, got {t.dtype}")
    dim, kv_heads = k_cache.shape[2], k_cache.shape[1]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape == v_cache.shape):
        raise ValueError(f"k_cache and v_cache must be contiguous and of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.shape[2] != dim or q.shape[1] % kv_heads or q.stride(2) != 1 or q.stride(1) != dim:
        raise ValueError(f"q must be [T, H, {dim}] with H a multiple of {kv_heads} and each "
                         f"row's heads contiguous, got shape {tuple(q.shape)} strides "
                         f"{q.stride()}")
    if not supports_head_dim(dim):
        raise ValueError(f"head_dim must be a multiple of {HEAD_DIM_MULTIPLE} up to "
                         f"{MAX_HEAD_DIM}, got {dim}")
    for name, t in (("slots", slots), ("seqs", seqs)):
        if t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 CPU tensor, got {t.dtype} "
                             f"on {t.device}")
    if seqs.dim() != 2 or seqs.shape[1] != 4:
        raise ValueError(f"seqs must be [S, 4], got {tuple(seqs.shape)}")


def check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slots: torch.Tensor, seqs: torch.Tensor) -> None:
    """ValueError unless the arguments have the kernel's layouts (dtypes, devices, shapes,
    strides) and every index points inside what it indexes (`check_indices`)."""
    _validate(q, k_cache, v_cache, slots, seqs)
    check_indices(slots, seqs, q.shape[0], k_cache.shape[0])


def check_indices(slots: torch.Tensor, seqs: torch.Tensor, tokens: int,
                  num_slots: int) -> None:
    """ValueError unless every `seqs` row is `(first, prefix, extend, slot0)` with its new
    tokens inside `[0, tokens)`, extend >= 1, its slots inside `slots`, and every slot inside
    the pool `[0, num_slots)`."""
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise ValueError(f"slots must lie in [0, {num_slots}), got [{int(slots.min())}, "
                         f"{int(slots.max())}]")
    for i, (first, prefix, extend, slot0) in enumerate(seqs.tolist()):
        if (first < 0 or prefix < 0 or extend < 1 or first + extend > tokens or slot0 < 0
                or slot0 + prefix + extend > slots.numel()):
            raise ValueError(f"seqs[{i}] = {(first, prefix, extend, slot0)} does not fit "
                             f"{tokens} query rows and {slots.numel()} slots")


def supports_head_dim(dim: int) -> bool:
    """Whether the kernel takes this head dim (a multiple of 16, up to MAX_HEAD_DIM)."""
    return dim % HEAD_DIM_MULTIPLE == 0 and 0 < dim <= MAX_HEAD_DIM


def supported() -> bool:
    """AVX-512F, or AVX2 and FMA, on this CPU and a C compiler (`cpu_build.isa`)."""
    return cpu_build.isa() is not None


@functools.cache
def load(cache_dir: Path) -> CpuAttentionKernel | None:
    """The kernel, compiled into `cache_dir` on first use; None where unsupported or the
    build fails (logged once)."""
    return cpu_build.load(_SOURCE, cache_dir, CpuAttentionKernel, "CPU attention kernel",
                          "SDPA", isas=("avx512", "avx2"))


def _build(cache_dir: Path) -> Path:
    """The compiled kernel's path (`cpu_build.build`, this CPU's build)."""
    return cpu_build.build(_SOURCE, cache_dir, cpu_build.ISA_FLAGS[cpu_build.isa()])
