"""L1 for a hybrid model (sliding-window layers beside full ones): two device pools and the
page map between them.

    full pool     the full layers' K/V, by the request's slots (the only slots anyone holds)
    window pool   the window layers' K/V, by window slots: window page = page_map[full page]
    page_map[p]   0 (the window pool's padding page): no window-layer KV for full page p

A request's new tokens take a full page and a window page each (`alloc`); a running request
marks its window pages spare as they leave every window (`spare_window`): kept, so that its
prompt joins the tree with them (`claim`) and a later prompt that diverges inside it still
hits, as vLLM keeps freed blocks cached, but the first taken back, oldest first, when the
window pool is short. The tree gives a node's back when it tombstones it (`drop_window`);
`free` gives both. A forward reads a window layer through
`batch_for`, which maps the batch's slots once per forward: a window layer's kernels then read
and write window slots, and a key before the window maps to the padding page, which no
kernel reads (every backend skips or masks keys before the window).

Threading: the scheduler thread owns allocation and the map, like `DeviceKVPool`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from hicache.memory.device import INDEX_DTYPE, PADDING_PAGE, DeviceKVPool, PagedSlots, pages_of

if TYPE_CHECKING:
    from typing import Any

# The most tokens one scheduler step allocates (hicache_server.engine.MAX_BATCH_TOKENS): a
# request holds window slots for its window and at most this many new tokens at a time.
STEP_TOKENS = 2048


class WindowedKVPool(PagedSlots):
    """See the module docstring. `layer_windows[l]`: layer l's window W (it reads keys
    `p - W < j <= p`), None for a full layer; both kinds must be present."""

    has_windows = True

    def __init__(self, num_pages: int, window_pages: int, page_size: int,
                 layer_windows: Sequence[int | None], kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        full = [i for i, w in enumerate(layer_windows) if w is None]
        windowed = [i for i, w in enumerate(layer_windows) if w is not None]
        if not full or not windowed:
            raise ValueError(f"WindowedKVPool needs full and window layers, got windows "
                             f"{list(layer_windows)}")
        self.page_size, self.num_pages, self.num_layers = page_size, num_pages, len(layer_windows)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.max_window = max(w for w in layer_windows if w is not None)
        self.full = DeviceKVPool(num_pages, page_size, len(full), kv_heads, head_dim, dtype,
                                 device)
        self.windowed = DeviceKVPool(window_pages, page_size, len(windowed), kv_heads,
                                     head_dim, dtype, device)
        self.allocator = self.full.allocator
        self.full_layers, self.window_layers = tuple(full), tuple(windowed)
        # each layer's pool and its buffer there
        self._route = [(self.full, full.index(i)) if i in full
                       else (self.windowed, windowed.index(i)) for i in range(self.num_layers)]
        self.k_buffers = [pool.k_buffers[j] for pool, j in self._route]
        self.v_buffers = [pool.v_buffers[j] for pool, j in self._route]
        # [num_pages + 1] full page -> window page (PADDING_PAGE: none); a copy on the device
        self._map = torch.full((num_pages + 1,), PADDING_PAGE, dtype=INDEX_DTYPE)
        self._device_map = self._map.to(self.device)
        self._spare: dict[int, None] = {}  # full pages whose window pages are spare, oldest first

    # ---------------------------------------------------------------------- geometry

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    @property
    def device(self) -> torch.device:
        return self.full.device

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, K and V (what L2 and L3 store of a page)."""
        return self.full.page_bytes + self.windowed.page_bytes

    @property
    def size_bytes(self) -> int:
        return self.full.size_bytes + self.windowed.size_bytes

    def is_window_layer(self, layer: int) -> bool:
        return self._route[layer][0] is self.windowed

    # ----------------------------------------------------------------------- slots

    def alloc(self, num_tokens: int, window: bool = True) -> torch.Tensor | None:
        """Full slots for `num_tokens` (whole pages), each page with a window page unless
        `window` is False; None, with nothing taken, when either pool is short."""
        slots = self.full.alloc(num_tokens)
        if slots is None or not window or num_tokens == 0:
            return slots
        window_slots = self._window_alloc(num_tokens)
        if window_slots is None:
            self.full.free(slots)
            return None
        self._set_map(pages_of(slots, self.page_size), pages_of(window_slots, self.page_size))
        return slots

    def give_window(self, indices: torch.Tensor) -> bool:
        """Window pages for full slots that have none (whole pages); False, with nothing
        taken, when the window pool is short."""
        window_slots = self._window_alloc(indices.numel())
        if window_slots is None:
            return False
        self._set_map(pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size),
                      pages_of(window_slots, self.page_size))
        return True

    def free(self, indices: torch.Tensor) -> None:
        """Give back full pages and the window pages mapped to them."""
        self.drop_window(indices)
        self.full.free(indices)

    def drop_window(self, indices: torch.Tensor) -> int:
        """Give back the window pages of these full slots (whole pages) that have one; the
        tokens given back."""
        pages = pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size)
        mapped = self._map[pages]
        live = mapped != PADDING_PAGE
        if not bool(live.any()):
            return 0
        self.claim(indices)
        window_pages = mapped[live]
        offsets = torch.arange(self.page_size, dtype=INDEX_DTYPE)
        self.windowed.free((window_pages[:, None] * self.page_size + offsets).reshape(-1))
        self._set_map(pages[live], torch.full_like(window_pages, PADDING_PAGE))
        return int(window_pages.numel()) * self.page_size

    def move_window(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Hand the window pages of full slots `source` to full slots `dest` (whole pages,
        aligned; `dest`'s have none): the same tokens' KV, computed twice."""
        self.claim(source)
        src = pages_of(source.to(dtype=INDEX_DTYPE), self.page_size)
        dst = pages_of(dest.to(dtype=INDEX_DTYPE), self.page_size)
        self._set_map(dst, self._map[src].clone())
        self._set_map(src, torch.full_like(src, PADDING_PAGE))

    def window_pages_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The window page of each full page of `indices` (PADDING_PAGE: none)."""
        return self._map[pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size)]

    def spare_window(self, indices: torch.Tensor) -> int:
        """No running query reads these full slots' window KV any more (whole pages of a
        request's own): keep it spare (see the module docstring); the tokens marked."""
        pages = pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size)
        live = pages[self._map[pages] != PADDING_PAGE].tolist()
        for page in live:
            self._spare[page] = None
        return len(live) * self.page_size

    def claim(self, indices: torch.Tensor) -> None:
        """These full slots' window pages are no longer spare (the tree holds them now)."""
        if self._spare:
            for page in pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size).tolist():
                self._spare.pop(page, None)

    def _window_alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Window slots, taking spare pages back, oldest first, when the pool is short."""
        short = num_tokens - self.windowed.available_size()
        if short > 0 and self._spare:
            pages = []
            while self._spare and len(pages) * self.page_size < short:
                pages.append(next(iter(self._spare)))
                del self._spare[pages[-1]]
            offsets = torch.arange(self.page_size, dtype=INDEX_DTYPE)
            self.drop_window((torch.tensor(pages, dtype=INDEX_DTYPE)[:, None] * self.page_size
                              + offsets).reshape(-1))
        return self.windowed.alloc(num_tokens)

    def window_available(self) -> int:
        """Window-layer tokens free now, or spare (taken back when needed)."""
        return self.windowed.available_size() + len(self._spare) * self.page_size

    def window_capacity(self) -> int:
        return self.windowed.total_size()

    def window_used(self) -> int:
        """Window-layer tokens held (spare ones are not)."""
        return self.windowed.allocator.used_size() - len(self._spare) * self.page_size

    def _set_map(self, pages: torch.Tensor, window_pages: torch.Tensor) -> None:
        self._map[pages] = window_pages
        if self._device_map is not self._map:
            self._device_map[pages.to(self.device)] = window_pages.to(self.device)

    # ---------------------------------------------------------------------- forward

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Window slots of full `slots` (on the pool's device): the padding page's slots
        where a page has no window KV."""
        ps = self.page_size
        return self._device_map[slots // ps] * ps + slots % ps

    def batch_for(self, layer: int, batch: Any) -> Any:
        """`batch` as layer `layer` reads the pool: a window layer's slots mapped to window
        slots (once per forward, shared by every window layer)."""
        if self._route[layer][0] is self.full:
            return batch
        return batch.memo("windowed_kv_pool/window_batch", lambda: self._window_batch(batch))

    def _window_batch(self, batch: Any) -> Any:
        tensors = [batch.out_slots, *batch.seq_slots]
        mapped = self.window_slots(torch.cat(tensors)).split([t.numel() for t in tensors])
        return replace(batch, out_slots=mapped[0], seq_slots=list(mapped[1:]))

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of `layer` in its own pool (a window layer's by window slot)."""
        pool, j = self._route[layer]
        return pool.get_kv(j)

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write into `layer`'s own pool; `slots` as `batch_for(layer)` gives them."""
        pool, j = self._route[layer]
        pool.set_kv(j, slots, k, v)
