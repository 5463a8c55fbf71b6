"""L2 host memory: the host KV pool (pinned when CUDA is present) and its two layouts.

Host pages are addressed like device pages: `PageAllocator` hands out slot indices
(`page * page_size + offset`), and `pages_of` turns them into the page ids that
`get_pages` / `set_pages` take. There is no padding page on the host.
"""

from __future__ import annotations

import os

import torch

from hicache.config import BYTES_PER_GB
from hicache.kernels.layouts import HOST_LAYOUTS, PAGE_FIRST
from hicache.memory.device import INDEX_DTYPE, PageAllocator, PagedSlots

# A host pool may take at most this share of MemAvailable. SGLang refuses to start past the
# free host memory: an oversized pinned pool cannot be swapped out and gets the process
# OOM-killed. The 10% margin leaves room for the rest of the process and the page cache.
MAX_HOST_MEM_FRACTION = 0.9
_MEMINFO = "/proc/meminfo"


def available_memory_bytes() -> int:
    """Host memory available to a new allocation, in bytes (MemAvailable, else free pages)."""
    try:
        with open(_MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except OSError:
        pass  # no procfs (macOS, some containers): the sysconf estimate below is the fallback
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(requested_bytes: int) -> None:
    """Raise MemoryError when `requested_bytes` exceeds 90% of the host memory available."""
    available = available_memory_bytes()
    if requested_bytes > MAX_HOST_MEM_FRACTION * available:
        raise MemoryError(
            f"the host KV pool needs {requested_bytes / BYTES_PER_GB:.2f} GB but only "
            f"{available / BYTES_PER_GB:.2f} GB of host memory is available (at most "
            f"{MAX_HOST_MEM_FRACTION:.0%} of it may be used); lower --hicache-size / "
            "host.size_gb or --hicache-ratio / host.ratio"
        )


class HostKVPool(PagedSlots):
    """The L2 KV cache: one CPU tensor holding `num_pages` pages of K and V for all layers.

    Layouts (`layout`), `L` = num_layers, `P` = num_pages, `S` = page_size::

        page_first   [P, L, 2, S, kv_heads, head_dim]   a page is one contiguous block over all
                                                         layers, K then V per layer; what the
                                                         storage tier reads and writes
        layer_first  [L, 2, P, S, kv_heads, head_dim]   a layer's K (or V) is contiguous; suits
                                                         per-layer load-back

    The buffer is zeroed at allocation, every page of it touched once, as vLLM zeroes its
    KV cache: where the OS (or a VM's host) backs memory only on first touch, that cost is
    paid at start, not by the serving path's first write of each page (on a 2-core VM that
    backs guest memory lazily, a 2,048-token SmolLM2 bfloat16 prefill with L2 took 140 ms
    more than without it on untouched pages, 38 ms more once zeroed). A page's bytes mean
    nothing until written. `pin_memory=None` pins when CUDA is available (pinned memory
    makes H2D/D2H copies asynchronous); pinning without CUDA is refused.

    Threading: the scheduler thread owns allocation (`alloc`, `free`). Transfer and storage
    threads only read or write the bytes of pages they were handed (`get_page(s)`,
    `set_page(s)`, `page_buffer`, `layer_kv`); they never allocate or free.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        layout: str = PAGE_FIRST,
        pin_memory: bool | None = None,
        check_available: bool = True,
    ) -> None:
        if layout not in HOST_LAYOUTS:
            raise ValueError(
                f"unknown host KV layout {layout!r}; allowed: {', '.join(HOST_LAYOUTS)}"
            )
        if num_layers < 1 or kv_heads < 1 or head_dim < 1:
            raise ValueError(
                "num_layers, kv_heads and head_dim must be >= 1, got "
                f"{num_layers}, {kv_heads}, {head_dim}"
            )
        self.allocator = PageAllocator(num_pages, page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self._dtype = dtype
        self._layout = layout
        self._init_buffer(pin_memory, check_available)

    def _init_buffer(self, pin_memory: bool | None, check_available: bool) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA; pass None or False on a CPU-only host")
        if check_available:
            check_host_memory(self.size_bytes)
        slab = (self.page_size, self.kv_heads, self.head_dim)  # one page of one layer's K or V
        if self._layout == PAGE_FIRST:
            shape = (self.num_pages, self.num_layers, 2, *slab)
        else:
            shape = (self.num_layers, 2, self.num_pages, *slab)
        self._buffer = torch.zeros(shape, dtype=self._dtype, pin_memory=pin_memory)

    @property
    def buffer(self) -> torch.Tensor:
        """The whole pool; its shape depends on `layout` (see the class docstring)."""
        return self._buffer

    @property
    def layout(self) -> str:
        return self._layout

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def is_pinned(self) -> bool:
        return self._buffer.is_pinned()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, K and V."""
        elements = 2 * self.num_layers * self.page_size * self.kv_heads * self.head_dim
        return elements * self._dtype.itemsize

    @property
    def size_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_pages * self.page_bytes


    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer`, each `[num_pages, page_size, kv_heads, head_dim]` (views).

        Strided (not contiguous) for page_first, contiguous for layer_first.
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is out of range [0, {self.num_layers})")
        if self._layout == PAGE_FIRST:
            return self._buffer[:, layer, 0], self._buffer[:, layer, 1]
        return self._buffer[layer, 0], self._buffer[layer, 1]

    def get_page(self, page: int) -> torch.Tensor:
        """One page, `[num_layers, 2, page_size, kv_heads, head_dim]`.

        A view for page_first (writes go to the pool), a contiguous copy for layer_first.
        """
        self._check_page(page)
        if self._layout == PAGE_FIRST:
            return self._buffer[page]
        return self._buffer[:, :, page].contiguous()

    def set_page(self, page: int, data: torch.Tensor) -> None:
        """Overwrite one page with `data` `[num_layers, 2, page_size, kv_heads, head_dim]`."""
        self._check_page(page)
        self._check_data(data, self._page_shape)
        if self._layout == PAGE_FIRST:
            self._buffer[page].copy_(data)
        else:
            self._buffer[:, :, page].copy_(data)

    def get_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages `pages` (`[n]` page ids), as `[n, num_layers, 2, page_size, kv_heads, head_dim]`.

        Always a copy, contiguous, in the order of `pages`.
        """
        idx = self._check_pages(pages)
        if self._layout == PAGE_FIRST:
            return self._buffer.index_select(0, idx)
        selected = self._buffer.index_select(2, idx)  # [L, 2, n, S, kv_heads, head_dim]
        return selected.permute(2, 0, 1, 3, 4, 5).contiguous()

    def set_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Write `data` `[n, num_layers, 2, page_size, kv_heads, head_dim]` into `pages` `[n]`.

        `pages` must be distinct (index_copy_ semantics).
        """
        idx = self._check_pages(pages)
        self._check_data(data, (idx.numel(), *self._page_shape))
        data = data.to(dtype=self._dtype)
        if self._layout == PAGE_FIRST:
            self._buffer.index_copy_(0, idx, data)
        else:
            self._buffer.index_copy_(2, idx, data.permute(1, 2, 0, 3, 4, 5))

    def page_buffer(self, page: int) -> memoryview:
        """The raw bytes of one page (`page_bytes` long), writable, sharing the pool's memory.

        page_first only: the storage tier copies a page straight between this and LMDB's
        mapped buffer. The view keeps the pool's memory alive; it is valid to read or write
        only while the caller holds the page (between being handed it and its ack).
        """
        if self._layout != PAGE_FIRST:
            raise ValueError(
                f"page_buffer needs layout {PAGE_FIRST!r} (a page must be one contiguous "
                f"block for storage), this pool is {self._layout!r}; use get_page/set_page"
            )
        self._check_page(page)
        raw = self._buffer[page].reshape(-1).view(torch.uint8)  # [page_bytes]
        return memoryview(raw.numpy())

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"host page {page} is out of range [0, {self.num_pages})")

    def _check_pages(self, pages: torch.Tensor) -> torch.Tensor:
        if pages.dim() != 1:
            raise ValueError(f"pages must be 1-D page ids, got shape {tuple(pages.shape)}")
        idx = pages.to(device="cpu", dtype=INDEX_DTYPE)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_pages):
            outside = idx[(idx < 0) | (idx >= self.num_pages)]
            raise IndexError(f"host page {int(outside[0])} is out of range [0, {self.num_pages})")
        return idx

    def _check_data(self, data: torch.Tensor, want: tuple[int, ...]) -> None:
        if tuple(data.shape) != want:
            raise ValueError(f"page data must have shape {want}, got {tuple(data.shape)}")

    @property
    def _page_shape(self) -> tuple[int, int, int, int, int]:
        """`[num_layers, 2, page_size, kv_heads, head_dim]`: one page in every layout."""
        return (self.num_layers, 2, self.page_size, self.kv_heads, self.head_dim)
