"""L1 device memory: the page allocator, the device KV pool and the request-to-token table.

Slot and page arithmetic used everywhere in `hicache`::

    slot = page * page_size + offset          0 <= offset < page_size
    page = slot // page_size

Slot indices are int64 CPU tensors. A page is always handed out and given back whole, as its
`page_size` consecutive slots starting at a page boundary.

Threading: the scheduler thread owns every object in this file (allocation, freeing, the
request table). Transfer threads only read or write the bytes of slots they were handed.
"""

from __future__ import annotations

from typing import Any

import torch

# Device page 0 is never handed out: padded batch rows write their dummy K/V there, so a
# padded write can never land on a page that holds real cache (same trick as SGLang's slot 0).
PADDING_PAGE = 0

# Slot indices, page ids and the request table are all int64, the index dtype that
# index_select / index_copy_ / advanced indexing take without a conversion on the hot path.
INDEX_DTYPE = torch.int64


def pages_of(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids of page-aligned slot indices (one id per page, in the order given).

    `indices` must be whole pages as returned by `PageAllocator.alloc`; nothing is checked.
    """
    return indices[::page_size] // page_size  # [len(indices) // page_size]


def slots_of(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot indices of whole pages, each page's slots consecutive; the inverse of `pages_of`."""
    offsets = torch.arange(page_size, dtype=pages.dtype, device=pages.device)  # [page_size]
    return (pages[:, None] * page_size + offsets).reshape(-1)  # [len(pages) * page_size]


def resolve_device(device: str | torch.device) -> torch.device:
    """`"auto"` becomes CUDA when available, otherwise CPU; anything else is taken as given."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _as_index_tensor(indices: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor of slot indices, got {type(indices)!r}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor, got dtype {indices.dtype}")
    if indices.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(indices.shape)}")
    return indices.to(device="cpu", dtype=INDEX_DTYPE)


def _first(values: torch.Tensor) -> int:
    """First element of a non-empty tensor as a Python int (error paths only)."""
    return int(values[0].item())


class PageAllocator:
    """Hands out whole pages of slots; units are tokens at the API, pages inside.

    Manages pages `first_page .. first_page + num_pages - 1`. Bookkeeping is two tensors:
    `_free_mask[p - first_page]` is True while page p is free, and `_free_stack[:_num_free]`
    holds exactly the free pages (top at the end, so recently freed pages are reused first).
    Every check and update is vectorised; no Python loop runs per slot or per page.

    Threading: not thread-safe. Only the scheduler thread may call `alloc`, `free` or `reset`.
    """

    def __init__(self, num_pages: int, page_size: int, first_page: int = 0) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if first_page < 0:
            raise ValueError(f"first_page must be >= 0, got {first_page}")
        self._num_pages = num_pages
        self._page_size = page_size
        self._first_page = first_page
        self._end_page = first_page + num_pages  # one past the last managed page
        self.reset()

    def reset(self) -> None:
        """Mark every page free; a fresh allocator hands pages out in ascending order."""
        self._free_mask = torch.ones(self._num_pages, dtype=torch.bool)  # [num_pages]
        # Descending so that popping from the top yields first_page, first_page + 1, ...
        self._free_stack = torch.arange(  # [num_pages]
            self._end_page - 1, self._first_page - 1, -1, dtype=INDEX_DTYPE
        )
        self._num_free = self._num_pages

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def num_pages(self) -> int:
        """Pages managed (free or not)."""
        return self._num_pages

    @property
    def first_page(self) -> int:
        """Lowest page id managed."""
        return self._first_page

    @property
    def num_free_pages(self) -> int:
        """Pages free now."""
        return self._num_free

    def available_size(self) -> int:
        """Free tokens."""
        return self._num_free * self._page_size

    def total_size(self) -> int:
        """Tokens managed (free or not)."""
        return self._num_pages * self._page_size

    def used_size(self) -> int:
        """Tokens handed out and not yet freed."""
        return self.total_size() - self.available_size()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slot indices of `num_tokens // page_size` whole pages, or None if too few are free.

        `num_tokens` must be a multiple of `page_size`; 0 gives an empty tensor. Lack of room
        is never an error: the caller waits, evicts or recomputes.
        """
        if num_tokens < 0 or num_tokens % self._page_size != 0:
            raise ValueError(
                f"alloc needs a non-negative multiple of page_size={self._page_size} tokens, "
                f"got {num_tokens}"
            )
        n = num_tokens // self._page_size
        if n > self._num_free:
            return None
        top = self._num_free
        pages = self._free_stack[top - n : top].flip(0)  # [n], a copy
        self._num_free = top - n
        self._free_mask[pages - self._first_page] = False
        return slots_of(pages, self._page_size)  # [num_tokens]

    def free(self, indices: torch.Tensor) -> None:
        """Give back whole pages, as their slot indices (any page order).

        Raises ValueError, naming the offending slot or page, for a slot out of range, a
        partial or misaligned page, or a page that is not handed out now (freed twice, in
        this call or before, or never allocated). Nothing is freed when it raises.
        """
        pages = self._validated_pages(_as_index_tensor(indices, "free(indices)"))
        if pages.numel() == 0:
            return
        self._free_mask[pages - self._first_page] = True
        top = self._num_free
        # Pushed reversed so that the next alloc of the same size returns them in this order.
        self._free_stack[top : top + pages.numel()] = pages.flip(0)
        self._num_free = top + pages.numel()

    def _validated_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """Page ids of `slots` after every check `free` promises; never mutates state."""
        ps = self._page_size
        lo, hi = self._first_page * ps, self._end_page * ps  # valid slots: [lo, hi)
        outside = slots[(slots < lo) | (slots >= hi)]
        if outside.numel():
            raise ValueError(
                f"slot {_first(outside)} is out of range: this allocator manages slots "
                f"[{lo}, {hi}) (pages {self._first_page}..{self._end_page - 1})"
            )
        if slots.numel() % ps != 0:
            raise ValueError(
                f"free got {slots.numel()} slots, not a multiple of page_size={ps}: "
                "only whole pages can be freed (partial page)"
            )
        rows = slots.view(-1, ps)  # [n_pages, page_size]
        starts = rows[:, 0]  # [n_pages]
        expected = starts[:, None] + torch.arange(ps, dtype=INDEX_DTYPE)  # [n_pages, page_size]
        bad_rows = ((starts % ps != 0)[:, None] | (rows != expected)).any(dim=1)  # [n_pages]
        if bad_rows.any():
            row = rows[bad_rows][0].tolist()
            raise ValueError(
                f"slots {row} are not one whole page: a page is page_size={ps} consecutive "
                "slots starting at a multiple of page_size (partial or misaligned page)"
            )
        pages = starts // ps  # [n_pages]
        uniq, counts = torch.unique(pages, return_counts=True)
        if (counts > 1).any():
            page = _first(uniq[counts > 1])
            raise ValueError(f"page {page} (slot {page * ps}) is freed twice in one call")
        already_free = pages[self._free_mask[pages - self._first_page]]
        if already_free.numel():
            page = _first(already_free)
            raise ValueError(
                f"page {page} (slot {page * ps}) is not allocated: freed twice or never handed out"
            )
        return pages


class PagedSlots:
    """A pool's slot bookkeeping, delegated to its `allocator` (the device and host KV pools
    both hand out whole pages of token slots the same way)."""

    allocator: PageAllocator

    def alloc(self, num_tokens: int, window: bool = True) -> torch.Tensor | None:
        """See `PageAllocator.alloc`: slot indices of whole pages, or None (`window`: for a
        pool with window layers, `WindowedKVPool`; ignored here)."""
        return self.allocator.alloc(num_tokens)

    def free(self, indices: torch.Tensor) -> None:
        """See `PageAllocator.free`."""
        self.allocator.free(indices)

    def available_size(self) -> int:
        """Free tokens."""
        return self.allocator.available_size()

    def total_size(self) -> int:
        """Tokens the pool holds."""
        return self.allocator.total_size()


class DeviceKVPool(PagedSlots):
    """The L1 KV cache: per layer a K and a V buffer `[num_slots, kv_heads, head_dim]`.

    Page 0 is the padding page (`PADDING_PAGE`): it exists in the buffers but the allocator
    never hands it out, so the buffers hold `num_pages + 1` pages and usable slots start at
    `page_size`. Memory regions of every buffer::

        slots [0, page_size)                          padding page, dummy writes only
        slots [page_size, (num_pages + 1) * page_size) pages 1..num_pages, allocator-owned

    `device` may be "auto": CUDA when `torch.cuda.is_available()`, otherwise CPU.

    Threading: the scheduler thread owns allocation (`alloc`, `free`). The model runner writes
    K/V into slots it holds; transfer threads/streams copy only pages they were handed.
    """

    has_windows = False  # every layer by the same slots (`WindowedKVPool`: window layers not)

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        if num_layers < 1 or kv_heads < 1 or head_dim < 1:
            raise ValueError(
                "num_layers, kv_heads and head_dim must be >= 1, got "
                f"{num_layers}, {kv_heads}, {head_dim}"
            )
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.allocator = PageAllocator(num_pages, page_size, first_page=PADDING_PAGE + 1)
        self._device = resolve_device(device)
        self._dtype = dtype
        self._init_buffers()

    def _init_buffers(self) -> None:
        shape = (self.num_slots, self.kv_heads, self.head_dim)
        # Zeroed so the padding page and never-written slots read as 0, never as NaN garbage.
        self.k_buffers: list[torch.Tensor] = [  # each [num_slots, kv_heads, head_dim]
            torch.zeros(shape, dtype=self._dtype, device=self._device)
            for _ in range(self.num_layers)
        ]
        self.v_buffers: list[torch.Tensor] = [  # each [num_slots, kv_heads, head_dim]
            torch.zeros(shape, dtype=self._dtype, device=self._device)
            for _ in range(self.num_layers)
        ]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * num_layers * kv_heads * head_dim * dtype.itemsize

    @classmethod
    def pages_for_budget(
        cls,
        bytes_budget: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """Usable pages (`num_pages`) that fit `bytes_budget` bytes, padding page included."""
        page_bytes = page_size * cls.bytes_per_token(num_layers, kv_heads, head_dim, dtype)
        num_pages = bytes_budget // page_bytes - 1  # one page of the budget is the padding page
        if num_pages < 1:
            raise ValueError(
                f"a KV budget of {bytes_budget} bytes holds no usable page: one page is "
                f"{page_bytes} bytes and the pool needs at least 2 (one is padding)"
            )
        return int(num_pages)

    @property
    def num_slots(self) -> int:
        """Slots per buffer, the padding page included."""
        return (self.num_pages + 1) * self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, K and V."""
        return self.page_size * self.bytes_per_token(
            self.num_layers, self.kv_heads, self.head_dim, self._dtype
        )

    @property
    def size_bytes(self) -> int:
        """Bytes of all buffers, the padding page included."""
        return (self.num_pages + 1) * self.page_bytes

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is out of range [0, {self.num_layers})")

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of `layer`, each `[num_slots, kv_heads, head_dim]` (no copy)."""
        self._check_layer(layer)
        return self.k_buffers[layer], self.v_buffers[layer]

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k`, `v` (each `[n, kv_heads, head_dim]`) into `slots` (`[n]` int64) of `layer`.

        Values are cast to the pool dtype. Slots must be distinct (index_copy_ semantics).
        """
        self._check_layer(layer)
        want = (slots.shape[0], self.kv_heads, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(
                f"set_kv needs k and v of shape {want}, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        idx = slots.to(device=self._device, dtype=INDEX_DTYPE, non_blocking=True)  # [n]
        self.k_buffers[layer].index_copy_(0, idx, k.to(device=self._device, dtype=self._dtype))
        self.v_buffers[layer].index_copy_(0, idx, v.to(device=self._device, dtype=self._dtype))

    def batch_for(self, layer: int, batch: Any) -> Any:
        """`batch` as layer `layer` reads this pool: as it is (`WindowedKVPool` maps a window
        layer's slots)."""
        return batch

    def page_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer`, each `[num_pages + 1, page_size, kv_heads, head_dim]` (no copy)."""
        k, v = self.get_kv(layer)
        shape = (self.num_pages + 1, self.page_size, self.kv_heads, self.head_dim)
        return k.view(shape), v.view(shape)
