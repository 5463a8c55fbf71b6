"""Page transfers between the device KV pool (L1) and the host KV pool (L2).

Layouts (fixed by hicache/memory_pool*.py; `L` layers, `P` pages, `S` page_size)::

    device  k_buffers[l], v_buffers[l]   [num_slots, kv_heads, head_dim], slot = page * S + offset
    host    page_first                   [P, L, 2, S, kv_heads, head_dim]   (2 = K then V)
            layer_first                  [L, 2, P, S, kv_heads, head_dim]

In every layout one *chunk* (a page of one layer's K or V, `S * kv_heads * head_dim` elements)
is contiguous, so a transfer is a list of chunk copies: for each selected layer, K and V,
`device_pages[i]` <-> `host_pages[i]`. Layers may differ in `num_slots` (a hybrid pool's
window layers have fewer; kv_heads, head_dim, dtype and device never differ): one call takes
one page list for all its `layers`, checked against the smallest of them.

Backends (`backend=` of `d2h_pages` / `h2d_pages`, validated alike):

    reference  pure torch, per layer and K/V one gather and/or scatter of whole pages
    direct     torch `copy_` per maximal run of pages consecutive in both lists
    cuda       one CuPy kernel launch for all selected layers; the GPU reads and writes the
               pinned host buffer directly (kernels/transfer_kv.cu)

Synchronisation: on a GPU every backend enqueues its copies on `stream` (a `torch.cuda.Stream`
or a CuPy stream; None = the current torch stream) and returns without waiting, except the
reference, whose device<->host hop is synchronous. The caller records an event after the call
and waits on it before reading the destination or reusing the source. On CPU all backends are
synchronous. Page lists are int64 page ids (not slots), on CPU: there they are checked for
range and duplicate destinations, and the cuda backend uploads them through pinned memory
without blocking. Lists already on the GPU are accepted unchecked (reading them would
synchronise), and the direct and reference backends must read them (one sync per call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from hicache.kernels import transfer_kv_cuda
from hicache.kernels.cuda_utils import as_torch_stream
from hicache.kernels.layouts import HOST_LAYOUTS, LAYER_FIRST, PAGE_FIRST
from hicache.kernels.transfer_args import Transfer

__all__ = ["HOST_LAYOUTS", "LAYER_FIRST", "PAGE_FIRST", "d2h_pages", "h2d_pages", "page_runs"]
BACKENDS = ("reference", "direct", "cuda")

# The reference copies rows through a staging buffer of at most this size when both page lists
# are scattered, so the staged bytes stay in cache between the gather and the scatter.
# 16 MiB was the fastest of 1, 4, 16 and 64 MiB on a 2-core Xeon (4 MiB L2 per core).
STAGING_BYTES = 16 << 20

# Widest element the torch backends reinterpret a chunk as (the bits are unchanged). CPU
# index_put_ / index_copy_ move one element per step, so 16-byte elements are ~1.5x faster than
# bf16 ones; and index_select memcpys whole rows only while a row has < 32768 elements
# (at::internal::GRAIN_SIZE), which 16-byte elements keep true up to 512 KiB pages.
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)



# ---------------------------------------------------------------------------------------------
# Public entry points


def d2h_pages(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
    host_buffer: torch.Tensor, host_layout: str,
    device_pages: torch.Tensor, host_pages: torch.Tensor, page_size: int,
    layers: Sequence[int] | None = None, backend: str = "reference", stream: Any = None,
) -> None:
    """Copy device pages into host pages (`device_pages[i]` -> `host_pages[i]`), K and V of
    `layers` (None = all). See the module docstring for layouts, backends and synchronisation.
    """
    backend = _check_backend(backend)
    _run(_validate(k_buffers, v_buffers, host_buffer, host_layout, device_pages, host_pages,
                   page_size, layers, dst_is_host=True), backend, True, stream)


def h2d_pages(
    host_buffer: torch.Tensor, host_layout: str,
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
    host_pages: torch.Tensor, device_pages: torch.Tensor, page_size: int,
    layers: Sequence[int] | None = None, backend: str = "reference", stream: Any = None,
) -> None:
    """Copy host pages into device pages (`host_pages[i]` -> `device_pages[i]`), K and V of
    `layers` (None = all); the cuda backend lands them in one launch, so pass one layer at a
    time to land layer by layer. See the module docstring."""
    backend = _check_backend(backend)
    _run(_validate(k_buffers, v_buffers, host_buffer, host_layout, device_pages, host_pages,
                   page_size, layers, dst_is_host=False), backend, False, stream)


def _run(t: Transfer, backend: str, to_host: bool, stream: Any) -> None:
    """One validated transfer through `backend`."""
    if backend == "cuda":  # one gather_kv_d2h / scatter_kv_h2d launch for the selected layers
        transfer_kv_cuda.launch(t, "gather_kv_d2h" if to_host else "scatter_kv_h2d", stream)
        return
    with _torch_stream(stream, t):
        (_reference if backend == "reference" else _direct)(t, to_host)


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


# ---------------------------------------------------------------------------------------------
# Validation (the thin wrapper in front of every backend)


def _validate(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
    host_buffer: torch.Tensor, host_layout: str, device_pages: torch.Tensor,
    host_pages: torch.Tensor, page_size: int, layers: Sequence[int] | None, dst_is_host: bool,
) -> Transfer:
    if host_layout not in HOST_LAYOUTS:
        raise ValueError(f"host_layout must be one of {HOST_LAYOUTS}, got {host_layout!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    k_list, v_list = _check_device_buffers(k_buffers, v_buffers, page_size)
    _check_host_buffer(host_buffer, host_layout, k_list, page_size)
    t = Transfer(k_list, v_list, host_buffer, host_layout, device_pages, host_pages, page_size,
                  _check_layers(layers, len(k_list)))
    _check_pages("device_pages", device_pages, t.num_device_pages, unique=not dst_is_host)
    _check_pages("host_pages", host_pages, t.num_host_pages, unique=dst_is_host)
    if device_pages.numel() != host_pages.numel():
        raise ValueError(
            f"device_pages and host_pages must have the same length, got "
            f"{device_pages.numel()} and {host_pages.numel()}")
    return t


def _check_device_buffers(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    k_list, v_list = list(k_buffers), list(v_buffers)
    if not k_list or len(k_list) != len(v_list):
        raise ValueError(
            "k_buffers and v_buffers must hold one tensor per layer (at least one), got "
            f"{len(k_list)} and {len(v_list)}")
    first = k_list[0]
    for name, bufs in (("k_buffers", k_list), ("v_buffers", v_list)):
        for i, b in enumerate(bufs):
            if not isinstance(b, torch.Tensor) or b.dim() != 3:
                got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
                raise ValueError(
                    f"{name}[{i}] must be a [num_slots, kv_heads, head_dim] tensor, got {got}")
            if b.shape != first.shape or b.dtype != first.dtype or b.device != first.device:
                _check_other_slots(name, i, b, first, k_list, v_list, page_size)
            if not b.is_contiguous():
                raise ValueError(f"{name}[{i}] must be contiguous, got strides {b.stride()}")
    if first.shape[0] % page_size != 0:
        raise ValueError(
            f"k_buffers[0] has {first.shape[0]} slots, not a multiple of page_size={page_size}")
    return k_list, v_list


def _check_other_slots(name: str, i: int, b: torch.Tensor, first: torch.Tensor,
                       k_list: list[torch.Tensor], v_list: list[torch.Tensor],
                       page_size: int) -> None:
    """A layer's buffer unlike k_buffers[0] (the rare path): only its slot count may differ
    (a hybrid pool's window layers have fewer), and then its K and V have as many."""
    if b.shape[1:] != first.shape[1:] or b.dtype != first.dtype or b.device != first.device:
        raise ValueError(
            f"{name}[{i}] is {tuple(b.shape)} {b.dtype} on {b.device}; every layer must match "
            f"k_buffers[0]: {tuple(first.shape)} {first.dtype} on {first.device} (but for its "
            f"number of slots)")
    other = "k_buffers" if name == "v_buffers" else "v_buffers"
    pair = (k_list if name == "v_buffers" else v_list)[i]
    if isinstance(pair, torch.Tensor) and pair.shape[0] != b.shape[0]:
        raise ValueError(
            f"{name}[{i}] is {tuple(b.shape)} but {other}[{i}] {tuple(pair.shape)}: a layer's "
            f"K and V must have the same number of slots")
    if b.shape[0] % page_size != 0:
        raise ValueError(
            f"{name}[{i}] has {b.shape[0]} slots, not a multiple of page_size={page_size}")


def _check_host_buffer(
    host_buffer: torch.Tensor, host_layout: str, k_list: list[torch.Tensor], page_size: int,
) -> None:
    if not isinstance(host_buffer, torch.Tensor) or host_buffer.dim() != 6:
        got = (tuple(host_buffer.shape) if isinstance(host_buffer, torch.Tensor)
               else type(host_buffer).__name__)
        raise ValueError(f"host_buffer must be a 6-d {host_layout} tensor, got {got}")
    if host_buffer.device.type != "cpu":
        raise ValueError(f"host_buffer must be a CPU tensor, got device {host_buffer.device}")
    if host_buffer.dtype != k_list[0].dtype:
        raise ValueError(
            f"host_buffer dtype {host_buffer.dtype} must match the device KV dtype "
            f"{k_list[0].dtype}")
    if not host_buffer.is_contiguous():
        raise ValueError(f"host_buffer must be contiguous, got strides {host_buffer.stride()}")
    num_layers, (_, kv_heads, head_dim) = len(k_list), k_list[0].shape
    shape = tuple(host_buffer.shape)
    num_host_pages = shape[0] if host_layout == PAGE_FIRST else shape[2]
    want = ((num_host_pages, num_layers, 2, page_size, kv_heads, head_dim)
            if host_layout == PAGE_FIRST
            else (num_layers, 2, num_host_pages, page_size, kv_heads, head_dim))
    if shape != want:
        raise ValueError(
            f"host_buffer shape {shape} does not fit layout {host_layout!r} with "
            f"{num_layers} layers, page_size={page_size}, kv_heads={kv_heads}, "
            f"head_dim={head_dim}: expected {want}")


def _check_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    out = [int(x) for x in layers]
    bad = [x for x in out if not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"layers must lie in [0, {num_layers}), got {bad[0]} in {out}")
    if len(set(out)) != len(out):
        raise ValueError(f"layers must be distinct, got {out}")
    return out


def _check_pages(name: str, pages: torch.Tensor, limit: int, unique: bool) -> None:
    if not isinstance(pages, torch.Tensor) or pages.dim() != 1:
        got = tuple(pages.shape) if isinstance(pages, torch.Tensor) else type(pages).__name__
        raise ValueError(f"{name} must be a 1-d int64 tensor of page ids, got {got}")
    if pages.dtype != torch.int64:
        raise ValueError(f"{name} must be int64 page ids, got dtype {pages.dtype}")
    if pages.numel() == 0 or pages.device.type != "cpu":
        return  # reading a GPU list's values would synchronise: checked for dtype/shape only
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 0 or hi >= limit:
        raise ValueError(f"{name} must lie in [0, {limit}), got {lo if lo < 0 else hi}")
    if unique:  # a destination page written twice is a race on the GPU
        uniq, counts = torch.unique(pages, return_counts=True)
        if bool((counts > 1).any()):
            dup = int(uniq[counts > 1][0])
            raise ValueError(f"{name} are destinations and must be distinct, got {dup} twice")


# ---------------------------------------------------------------------------------------------
# Chunk views shared by the torch backends


def _wide_dtype(t: Transfer) -> torch.dtype:
    """Widest element that divides a chunk and every base offset (so `.view(dtype)` is legal)."""
    item = t.host_buffer.element_size()
    offsets = [b.storage_offset() * item for b in (*t.k_buffers, *t.v_buffers, t.host_buffer)]
    for dtype in _WIDE_DTYPES:
        w = dtype.itemsize
        if t.chunk_bytes % w == 0 and all(o % w == 0 for o in offsets):
            return dtype
    return torch.uint8


def _rows(t: torch.Tensor, num_pages: int, wide: torch.dtype) -> torch.Tensor:
    """A page-major view with contiguous pages -> `[num_pages, chunk_bytes / wide.itemsize]`."""
    return t.view(num_pages, -1).view(torch.uint8).view(wide)


def _layer_rows(t: Transfer, layer: int, wide: torch.dtype) -> Iterator[
        tuple[torch.Tensor, torch.Tensor]]:
    """(device rows, host rows) of `layer`'s K, then V; each `[pages, chunk]`, host strided;
    the device rows as many as that layer's own buffer holds."""
    for kv, dev in enumerate((t.k_buffers[layer], t.v_buffers[layer])):
        host = (t.host_buffer[:, layer, kv] if t.host_layout == PAGE_FIRST
                else t.host_buffer[layer, kv])  # [P, S, kv_heads, head_dim]
        yield (_rows(dev, dev.shape[0] // t.page_size, wide),
               _rows(host, t.num_host_pages, wide))


def _run_start(pages: torch.Tensor) -> int | None:
    """First id when `pages` is one run of consecutive ids (n, n+1, ...), else None."""
    n = pages.numel()
    if n == 0:
        return None
    first = int(pages[0])
    if int(pages[-1]) - first != n - 1 or (n > 1 and not bool((torch.diff(pages) == 1).all())):
        return None
    return first


@contextlib.contextmanager
def _torch_stream(stream: Any, t: Transfer) -> Iterator[None]:
    device = t.k_buffers[0].device
    if device.type != "cuda" or stream is None:
        yield
        return
    with torch.cuda.stream(as_torch_stream(stream, device)):
        yield


# ---------------------------------------------------------------------------------------------
# reference: per layer and K/V, one index_select and/or index_put_ of whole pages


class _Plan(NamedTuple):
    src_ids: torch.Tensor  # on the source's device
    dst_ids: torch.Tensor  # on the destination's device
    src_start: int | None  # set when src_ids is one run of consecutive pages
    dst_start: int | None


def _reference(t: Transfer, to_host: bool) -> None:
    """Per layer and K/V: index_select straight into the destination when its pages are one
    run, index_put_ straight from the source when its pages are one run, else both through a
    cache-sized staging buffer. Every path moves whole pages reinterpreted as wide elements."""
    if t.num_pages == 0 or not t.layers:
        return
    wide = _wide_dtype(t)
    dev_dev, host_dev = t.k_buffers[0].device, t.host_buffer.device
    src_ids, dst_ids = (t.device_pages, t.host_pages) if to_host else (t.host_pages, t.device_pages)
    src_dev, dst_dev = (dev_dev, host_dev) if to_host else (host_dev, dev_dev)
    src_start, dst_start = _run_start(src_ids), _run_start(dst_ids)
    staging: torch.Tensor | None = None
    if src_start is None and dst_start is None and src_dev == dst_dev:
        # Read the source in address order (~10% faster on CPU); the staging buffer is shared
        # by every layer.
        order = torch.argsort(src_ids)
        src_ids, dst_ids = src_ids[order], dst_ids[order]
        rows = max(1, min(t.num_pages, STAGING_BYTES // t.chunk_bytes))
        staging = torch.empty(rows, t.chunk_bytes // wide.itemsize, dtype=wide, device=src_dev)
    plan = _Plan(src_ids.to(src_dev), dst_ids.to(dst_dev), src_start, dst_start)
    for layer in t.layers:
        for dev_rows, host_rows in _layer_rows(t, layer, wide):
            src, dst = (dev_rows, host_rows) if to_host else (host_rows, dev_rows)
            _copy_rows(src, dst, plan, staging)


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, plan: _Plan,
               staging: torch.Tensor | None) -> None:
    """dst[plan.dst_ids[i]] = src[plan.src_ids[i]] for whole rows (pages)."""
    n = plan.src_ids.numel()
    if src.device != dst.device:  # gather where the source is, one hop, place on the far side
        gathered = (src[plan.src_start:plan.src_start + n] if plan.src_start is not None
                    else src.index_select(0, plan.src_ids))
        moved = gathered.to(dst.device)
        if plan.dst_start is not None:
            dst[plan.dst_start:plan.dst_start + n].copy_(moved)
        else:
            dst.index_put_((plan.dst_ids,), moved)
    elif plan.dst_start is not None:  # gather straight into the destination, no temporary
        torch.index_select(src, 0, plan.src_ids, out=dst[plan.dst_start:plan.dst_start + n])
    elif plan.src_start is not None:  # scatter straight from the source, no temporary
        dst.index_put_((plan.dst_ids,), src[plan.src_start:plan.src_start + n])
    else:  # both scattered: stage through a cache-sized buffer, reused by every layer
        assert staging is not None
        step = staging.shape[0]
        for i in range(0, n, step):
            part = staging[:min(step, n - i)]
            torch.index_select(src, 0, plan.src_ids[i:i + step], out=part)
            dst.index_put_((plan.dst_ids[i:i + step],), part)


# ---------------------------------------------------------------------------------------------
# direct: one copy_ per run of pages consecutive in both lists


def page_runs(src_pages: torch.Tensor, dst_pages: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs `(src_start, dst_start, length)` where both lists advance by one page."""
    n = src_pages.numel()
    if n == 0:
        return []
    breaks = (torch.diff(src_pages) != 1) | (torch.diff(dst_pages) != 1)  # [n - 1]
    starts = torch.cat([breaks.new_zeros(1, dtype=torch.int64),
                        torch.nonzero(breaks).flatten() + 1])  # [runs]
    lengths = torch.diff(starts, append=starts.new_full((1,), n))
    return list(zip(src_pages[starts].tolist(), dst_pages[starts].tolist(), lengths.tolist()))


def _direct(t: Transfer, to_host: bool) -> None:
    if t.num_pages == 0 or not t.layers:
        return
    wide = _wide_dtype(t)
    src_ids, dst_ids = (t.device_pages, t.host_pages) if to_host else (t.host_pages, t.device_pages)
    runs = page_runs(src_ids.cpu(), dst_ids.cpu())  # the one sync of this backend
    # Asynchronous only when the host side is pinned; a pageable one would be read after return.
    non_blocking = t.k_buffers[0].is_cuda and t.host_buffer.is_pinned()
    for layer in t.layers:
        for dev_rows, host_rows in _layer_rows(t, layer, wide):
            src, dst = (dev_rows, host_rows) if to_host else (host_rows, dev_rows)
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)
